"""Checked outputs on the real engine (the tiny random Llama, whose answers are random
tokens): answers that fail the job's check are tried again with a new seed up to the job's
limit, then recorded as ``invalid_output`` with the last answer; answers that pass keep
their retries' count; a greedy answer is not tried again (a new seed cannot change it); the
results still leave in input order; the merge's error lines hold the last answer and its
counts say how many lines and tries.
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from llm_batch.core.endpoints import Endpoint
from llm_batch.core.output_check import INVALID_OUTPUT, OutputCheck
from llm_batch.core.records import BatchRequest, ResultRecord, dumps_line
from llm_batch.infra import storage
from llm_batch.infra.results import ResultsWriter
from llm_batch.pipeline.merge import merge_job
from llm_batch.pipeline.sharding import plan_shards
from tests.unit.data_plane_fixtures import new_layout

pytestmark = pytest.mark.engine

MODEL = "tiny-random-llama"


def _chat(text: str, **sampling: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": 6, **sampling}


def _run(llm, check: OutputCheck, bodies: list[dict[str, Any]]) -> list[ResultRecord]:
    from llm_batch.runtime.engine.runner import EngineRunner

    runner = EngineRunner(llm, Endpoint.CHAT_COMPLETIONS, MODEL, "assistant", output_check=check)
    emitted: list[ResultRecord] = []
    requests = [BatchRequest(index=i, custom_id=f"r{i}", body=b) for i, b in enumerate(bodies)]
    assert runner.run(requests, lambda record, usage: emitted.append(record)) is None
    return emitted


def test_failing_answers_are_tried_again_then_recorded_invalid(tiny_llm):
    digits = OutputCheck(regex=r"\d+", max_retries=2)
    bodies = [_chat(f"say a number {i}", temperature=1.0) for i in range(4)] + [_chat("greedy", temperature=0)]
    results = _run(tiny_llm, digits, bodies)
    assert [r.index for r in results] == list(range(5))
    # Random tokens are (almost) never only digits: each sampled line used its two retries.
    invalid = [r for r in results if r.error and r.error.code == INVALID_OUTPUT]
    assert len(invalid) >= 4
    for record in invalid:
        assert record.status_code == 422 and "regex" in record.error.message
        assert record.body["choices"][0]["message"]["content"] is not None  # the last answer is kept
    sampled = [r for r in invalid if r.index < 4]
    assert all(r.retries == 2 and r.retry_tokens > 0 for r in sampled)
    greedy = results[4]
    assert greedy.retries is None, "a greedy answer was tried again"

    anything = OutputCheck(regex=r"(?s).*", max_retries=2)
    passed = _run(tiny_llm, anything, bodies[:2])
    assert all(r.ok and r.retries is None for r in passed)


def test_merge_keeps_the_last_answer_and_counts_the_tries(tiny_llm):
    check = OutputCheck(json_schema={"type": "object", "required": ["answer"]}, max_retries=1)
    bodies = [_chat(f"json please {i}", temperature=0.8, seed=i) for i in range(3)]
    results = _run(tiny_llm, check, bodies)
    layout = new_layout()
    requests = [BatchRequest(index=i, custom_id=f"r{i}", body=b) for i, b in enumerate(bodies)]
    storage.write_bytes(layout.validated, b"".join(dumps_line(r) for r in requests))
    storage.write_bytes(layout.validation_errors, b"")
    (plan,) = plan_shards(layout, 1)
    with ResultsWriter.open(plan.results_uri) as writer:
        for record in results:
            writer.write(record)
    counts = merge_job(layout)
    assert counts.total == 3 and counts.invalid_output == 3 and counts.failed == 3
    assert counts.output_retries == 3 and counts.retry_tokens > 0
    errors = [orjson.loads(line) for line in storage.read_bytes(layout.errors_jsonl).splitlines()]
    assert [e["error"]["code"] for e in errors] == [INVALID_OUTPUT] * 3
    assert all("not JSON" in e["error"]["message"] for e in errors)
    assert all(e["response"]["status_code"] == 422 and e["response"]["body"]["object"] == "chat.completion"
               for e in errors)
