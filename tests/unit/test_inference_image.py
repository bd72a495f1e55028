"""The inference image: its Dockerfile runs the worker the tests run, installs the core only,
and the core's worker path imports with Airflow unavailable.

The image cannot be built here (no Docker engine); instead a subprocess with an import hook
that refuses ``airflow`` imports the worker and the CLI and drives ``llm-batch worker`` to a
usage exit, so an Airflow import anywhere on that path fails this test.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "inference_image" / "Dockerfile"


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    pairs = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            pairs.append((keyword.upper(), rest.strip()))
    return pairs


def test_base_image_is_a_pinned_vllm_cuda_image():
    bases = [args for keyword, args in _instructions() if keyword == "FROM"]
    assert len(bases) == 1
    image, _, tag = bases[0].partition(":")
    assert image == "vllm/vllm-openai"
    assert re.fullmatch(r"v\d+\.\d+\.\d+", tag), f"base tag {tag!r} is not a pinned release"


def test_entrypoint_is_the_worker_command():
    entrypoints = [json.loads(args) for keyword, args in _instructions() if keyword == "ENTRYPOINT"]
    assert entrypoints == [["llm-batch", "worker"]]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["llm-batch"] == "llm_batch.cli.main:main"

    from llm_batch.cli.main import build_parser
    from llm_batch.cli.worker import worker

    # The tests run `python -m llm_batch.cli.main worker ...`: the same parser and function.
    assert build_parser().parse_args(entrypoints[0][1:]).func is worker


def test_image_installs_the_core_without_extras():
    runs = " ".join(args for keyword, args in _instructions() if keyword == "RUN")
    installs = re.findall(r"pip install ([^&;]*)", runs)
    assert installs, "the Dockerfile installs nothing"
    for arguments in installs:
        assert "[" not in arguments and "airflow" not in arguments, arguments


_WITHOUT_AIRFLOW = """
import importlib.abc, sys

class NoAirflow(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "airflow" or name.startswith("airflow."):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked)")
        return None

sys.meta_path.insert(0, NoAirflow())
import llm_batch.runtime.worker, llm_batch.cli.main
from llm_batch.core import exit_codes
code = llm_batch.cli.main.main(["worker", "--job-id", "j", "--shard", "0", "--endpoint",
                           "/v1/chat/completions", "--model-config", '{"model": "no-such-model"}'])
assert code == exit_codes.USAGE, code
heavy = sorted({m.split(".")[0] for m in sys.modules} & {"airflow", "vllm", "torch"})
assert not heavy, heavy
print("ok")
"""


def test_worker_and_cli_import_without_airflow(llm_batch_home):
    done = subprocess.run([sys.executable, "-c", _WITHOUT_AIRFLOW], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "ok"
