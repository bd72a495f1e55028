"""The SDK matrix: each client release in its own venv (scripts/sdk_venvs.sh), its flow
script (tests/sdk/flows/) run as a subprocess against the real app over HTTP (live_server).

A test calls `sdk(release).run(step, ...)` for each step of a flow, and drives the job
through its states with `finish` (simulate_run, no engine) between the steps."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest

from tests.api.conftest import (  # noqa: F401 - fixtures re-used as they are
    api_store,
    auth_manager,
    batch_api,
    batch_app,
    chat_lines,
    creds,
    live_server,
    simulate_run,
)

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "sdk_venvs.sh"
FLOWS = Path(__file__).parent / "flows"
FLOW_OF = {"openai": "openai_flow.py", "mistralai": "mistralai_flow.py", "scale-llm-engine": "scale_flow.py"}


@functools.cache
def matrix() -> dict[str, str]:
    """Release name -> its requirements, from the script (the one place they are pinned)."""
    listed = subprocess.run([SCRIPT, "--list"], check=True, capture_output=True, text=True).stdout
    return dict(line.split("\t", 1) for line in listed.splitlines())


def releases(package: str) -> list[str]:
    """The matrix's releases of one client, e.g. releases("openai") -> ["openai-3.57.0", ...]."""
    return [name for name in matrix() if name.rsplit("-", 1)[0] == package]


def since(release: str, version: str) -> bool:
    """Whether a release is `version` or newer: since(r, "1.22.0") for a call that came then."""
    from packaging.version import Version

    return Version(release.rsplit("-", 1)[1]) >= Version(version)


def newest(package: str) -> str:
    """The newest release of ``package`` in the matrix: the index's newest when it answers."""
    from packaging.version import Version

    return max(releases(package), key=lambda name: Version(name.rsplit("-", 1)[1]))


def venv_python(release: str) -> str:
    """The python of one release's venv, built alone (not the whole matrix) or found up to date."""
    built = subprocess.run([SCRIPT, release], check=True, capture_output=True, text=True, timeout=1200)
    return built.stdout.strip().splitlines()[-1].split("\t", 1)[1]


def newest_flow(package: str, base_url: str, key: str, script: str) -> Flow:
    """The flow ``script`` on the newest release of ``package`` in the matrix, calling
    ``base_url`` (``<server>/batch``) with ``key``."""
    release = newest(package)
    return Flow(release, venv_python(release), base_url, key, script)


@pytest.fixture(scope="session")
def sdk_pythons() -> dict[str, str]:
    """Every release's venv python, built (or found up to date) by scripts/sdk_venvs.sh."""
    started = time.monotonic()
    done = subprocess.run([SCRIPT], capture_output=True, text=True, timeout=1200)
    if done.returncode:
        pytest.fail(f"scripts/sdk_venvs.sh failed:\n{done.stderr}")
    if done.stderr:  # something was built: say how long it took
        print(f"\n{done.stderr}sdk_venvs: {time.monotonic() - started:.0f} s")
    return dict(line.split("\t", 1) for line in done.stdout.splitlines())


@dataclass(frozen=True)
class Flow:
    release: str
    python: str
    base_url: str  # <server>/batch
    key: str  # the default caller's API key
    flow: str | None = None  # the script in tests/sdk/flows/; default the dialect's FLOW_OF

    def with_flow(self, script: str) -> Flow:
        """The same release running another flow script of tests/sdk/flows/."""
        return Flow(self.release, self.python, self.base_url, self.key, script)

    def run(self, step: str, key: str | None = None, **args: Any) -> dict[str, Any]:
        """One step of the release's flow script; what it observed (its JSON summary)."""
        key = key or self.key
        env = {
            "PATH": os.environ["PATH"],
            "HOME": os.environ.get("HOME", "/tmp"),
            "PYTHONNOUSERSITE": "1",
            "LLM_BATCH_BASE_URL": self.base_url,
            "LLM_BATCH_API_KEY": key,
            "LLM_ENGINE_BASE_PATH": f"{self.base_url}/",
            "SCALE_API_KEY": key,
            "LLM_ENGINE_DISABLE_VERSION_CHECK": "true",  # no PyPI lookup at import
        }
        script = FLOWS / (self.flow or FLOW_OF[self.release.rsplit("-", 1)[0]])
        done = subprocess.run([self.python, script, step, json.dumps(args)], env=env, cwd=FLOWS,
                              capture_output=True, text=True, timeout=120)
        if done.returncode:
            pytest.fail(f"{self.release} {step} failed (exit {done.returncode}):\n{done.stderr[-6000:]}", pytrace=False)
        observed = json.loads(done.stdout.strip().splitlines()[-1])
        package, version = self.release.rsplit("-", 1)
        assert observed["client"] == f"{package}=={version}", "the flow ran another release than its venv's"
        return observed


@pytest.fixture()
def sdk(sdk_pythons, live_server, creds):
    """sdk(release) -> the Flow of that release, as alice."""

    def flow(release: str) -> Flow:
        return Flow(release, sdk_pythons[release], f"{live_server}/batch", creds.keys["alice"])

    return flow


# What scale-llm-engine's v2 response types refuse in every real chat or completion body (OpenAI's,
# vLLM's, what Scale's own model-engine writes): 0.0.0b45's types, generated from an OpenAI spec
# without its `nullable` marks, require a chat message's `refusal` as a string and a choice's
# `logprobs` as an object, where those bodies have null (or no `refusal`) unless asked.
SCALE_V2_TYPES_REFUSE = {("choices.*.message.refusal", "value_error.missing"),
                         ("choices.*.logprobs", "type_error.none.not_allowed")}


def error_of(refusal: dict[str, Any] | None) -> tuple[str, int] | None:
    """A flow's record of a refused call as (client error class, HTTP status)."""
    return refusal and (refusal["type"], refusal["status"])


def chat_file(path: Path, n: int, model: str = "tiny-random-llama") -> Path:
    """A batch JSONL file of n chat requests, custom_ids req-0 ... req-<n-1> (as simulate_run names its results)."""
    path.write_bytes(chat_lines(n, model))
    return path


def models_file(path: Path, models: list[str]) -> Path:
    """A batch JSONL file of one chat request per model named, line i naming models[i] as its
    body.model (custom_ids req-0 ... as simulate_run names its results)."""
    path.write_bytes(b"".join(chat_lines(1, model).replace(b'"req-0"', f'"req-{i}"'.encode()) for i, model in enumerate(models)))
    return path


def finish(store, job_id: str, ok: int, failed: int, while_running=None) -> None:
    """Run the job to SUCCEEDED with simulate_run (results req-0 ... req-<ok-1>), calling
    `while_running()` while it is running, then record the error file the merge would write:
    one OpenAI-shaped error line per failed request (req-<ok> ... req-<ok+failed-1>). A Scale
    job's array is the one its run writes: its own input validated, the engine's bodies for
    the first `ok` requests (engine errors for the next `failed`), merged as the DAG merges."""
    from llm_batch.core.config import get_settings
    from llm_batch.core.layout import JobLayout
    from llm_batch.infra import storage
    from tests.unit.data_plane_fixtures import run_scale_job

    run = simulate_run(store, job_id, ok=ok, failed=failed)
    next(run)
    if while_running:
        while_running()
    next(run, None)
    layout = JobLayout(get_settings().work_uri, job_id)
    job = store.get_job(job_id)
    if job.array_output_uri:
        run_scale_job(layout, job.input.uri, job.input_format, job.endpoint, failing=range(ok, ok + failed),
                      array_output_uri=job.array_output_uri)
    errors = [
        {"id": f"batch_req_e{i}", "custom_id": f"req-{i}", "line": i + 1, "response": None,
         "error": {"code": "invalid_request", "message": "simulated failure"}}
        for i in range(ok, ok + failed)
    ]
    storage.write_bytes(layout.errors_jsonl, b"".join(orjson.dumps(e) + b"\n" for e in errors))
    error_file = store.create_file(
        owner=store.get_job(job_id).owner, purpose="batch_error", filename=f"{job_id}_error.jsonl",
        bytes=storage.size(layout.errors_jsonl), uri=layout.errors_jsonl, kind="error", job_id=job_id,
    )
    store.set_outputs(job_id, error_file_id=error_file.id)
