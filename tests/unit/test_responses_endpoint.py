"""/v1/responses in batches: the endpoint and its registry task, per-line validation (good
lines pass, each unsupported option is a 400 naming it), the engine-side translation to a
chat (messages, sampling params, structured output), the Response body the newest openai
SDK's ``Response`` type parses, and the merge's usage sums over Responses usage names."""

from __future__ import annotations

import io
import json
import subprocess
from types import SimpleNamespace
from typing import Any

import orjson
import pytest

from llm_batch.core.endpoints import SUPPORTED_ENDPOINTS, TASK_OF_ENDPOINT, Endpoint, parse_endpoint
from llm_batch.core.formats import RequestChecker, read_jsonl
from llm_batch.core.records import ErrorRecord
from llm_batch.core.schemas import RESPONSES_UNSUPPORTED

GOOD_BODIES: list[dict[str, Any]] = [
    {"model": "m", "input": "Say hi"},
    {"input": "Say hi", "instructions": "Be brief.", "max_output_tokens": 16, "temperature": 0.2,
     "top_p": 0.9, "metadata": {"run": "7"}},
    {"input": [{"role": "user", "content": "plain text"}]},
    {"input": [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "rules"}]},
        {"role": "user", "content": [{"type": "input_text", "text": "q1"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "a1"}]},
        {"role": "user", "content": [{"type": "input_text", "text": "q2"}, {"type": "input_text", "text": "more"}]},
    ]},
    {"input": "json please", "text": {"format": {"type": "json_schema", "name": "color", "strict": True,
                                                 "schema": {"enum": ["red", "green"]}}}},
    {"input": "x", "text": {"format": {"type": "json_object"}}},
    {"input": "x", "text": {"format": {"type": "text"}}},
    # options at their harmless value
    {"input": "x", "tools": [], "tool_choice": "auto", "store": False, "background": False, "include": [],
     "truncation": "disabled", "stream": False, "parallel_tool_calls": True, "user": "u"},
]

# option -> a value the batch cannot honour
UNSUPPORTED: dict[str, Any] = {
    "tools": [{"type": "function", "name": "f", "parameters": {}}],
    "tool_choice": "required",
    "previous_response_id": "resp_123",
    "conversation": "conv_1",
    "background": True,
    "store": True,
    "include": ["message.output_text.logprobs"],
    "reasoning": {"effort": "low"},
    "prompt": {"id": "pmpt_1"},
    "max_tool_calls": 3,
    "top_logprobs": 2,
    "truncation": "auto",
    "stream_options": {"include_usage": True},
    "context_management": [{"type": "compaction"}],
}


def _check(bodies: list[dict[str, Any]], endpoint: str | None = "/v1/responses") -> list[Any]:
    data = b"".join(orjson.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/responses",
                                  "body": b}) + b"\n" for i, b in enumerate(bodies))
    return list(read_jsonl(io.BytesIO(data), RequestChecker(endpoint), max_line_bytes=1 << 20))


# -- the endpoint ------------------------------------------------------------------------------


def test_the_endpoint_is_supported_and_served_by_chat_models():
    assert parse_endpoint("/v1/responses") is Endpoint.RESPONSES
    assert "/v1/responses" in SUPPORTED_ENDPOINTS
    assert TASK_OF_ENDPOINT[Endpoint.RESPONSES] == TASK_OF_ENDPOINT[Endpoint.CHAT_COMPLETIONS] == "generate"
    assert set(TASK_OF_ENDPOINT) == set(Endpoint)


def test_a_url_of_v1_responses_fixes_the_jobs_endpoint():
    checker = RequestChecker(None)
    (item,) = read_jsonl(io.BytesIO(b'{"custom_id": "a", "url": "/v1/responses", "body": {"input": "hi"}}\n'),
                         checker, max_line_bytes=1024)
    assert not isinstance(item, ErrorRecord)
    assert checker.endpoint is Endpoint.RESPONSES


# -- validation ---------------------------------------------------------------------------------


def test_good_lines_pass():
    items = _check(GOOD_BODIES)
    errors = [i for i in items if isinstance(i, ErrorRecord)]
    assert errors == []
    assert [i.index for i in items] == list(range(len(GOOD_BODIES)))


@pytest.mark.parametrize("option", sorted(UNSUPPORTED))
def test_each_unsupported_option_is_a_400_naming_it(option):
    assert option in RESPONSES_UNSUPPORTED
    (item,) = _check([{"input": "x", option: UNSUPPORTED[option]}])
    assert isinstance(item, ErrorRecord)
    assert item.code == "invalid_body" and item.line == 1 and item.custom_id == "r0"
    assert item.message.startswith(f"body.{option}: {option} is not supported in a /v1/responses")


@pytest.mark.parametrize(("body", "where", "words"), [
    ({}, "body.input", "field required"),
    ({"input": ""}, "body.input", "empty"),
    ({"input": []}, "body.input", "empty"),
    ({"input": 5}, "body.input", "string or a list"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "body.input[0]",
     '"function_call" are not supported'),
    ({"input": [{"role": "robot", "content": "x"}]}, "body.input[0].role", "robot"),
    ({"input": [{"role": "user"}]}, "body.input[0].content", "field required"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "ok"},
                                              {"type": "input_image", "image_url": "https://x"}]}]},
     "body.input[0].content[1]", "'input_image' are not supported"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "body.input[0].content[0]",
     "needs a 'text' string"),
    ({"input": "x", "max_output_tokens": 0}, "body.max_output_tokens", "greater than or equal to 1"),
    ({"input": "x", "temperature": 2.5}, "body.temperature", "less than or equal to 2"),
    ({"input": "x", "top_p": 0}, "body.top_p", "greater than 0"),
    ({"input": "x", "instructions": 3}, "body.instructions", "string"),
    ({"input": "x", "metadata": {"k": 1}}, "body.metadata", "string values"),
    ({"input": "x", "metadata": {f"k{i}": "v" for i in range(17)}}, "body.metadata", "at most 16"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}}, "body.text.format",
     "needs a 'schema'"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {}}}}, "body.text.format",
     "needs a 'name'"),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, "body.text.format.type", "yaml"),
    ({"input": "x", "stream": True}, "body.stream", "stream must be false"),
])
def test_bad_lines_say_where_and_what(body, where, words):
    (item,) = _check([body])
    assert isinstance(item, ErrorRecord), body
    assert item.code == "invalid_body"
    assert item.message.startswith(where + ":"), item.message
    assert words in item.message, item.message


def test_bad_lines_keep_their_line_numbers_beside_good_ones():
    items = _check([GOOD_BODIES[0], {"input": "x", "tools": UNSUPPORTED["tools"]}, GOOD_BODIES[1],
                    {"input": "x", "store": True}])
    assert [isinstance(i, ErrorRecord) for i in items] == [False, True, False, True]
    assert [i.line for i in items if isinstance(i, ErrorRecord)] == [2, 4]


# -- the engine-side translation ----------------------------------------------------------------


def test_a_responses_body_runs_as_a_chat():
    from llm_batch.runtime.engine.sampling import parse_body, sampling_params

    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    body = parse_body(Endpoint.RESPONSES, {
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "q"}]},
                  {"role": "assistant", "content": [{"type": "output_text", "text": "a"}]},
                  {"role": "user", "content": "q2"}],
        "instructions": "sys", "max_output_tokens": 7, "temperature": 0.3, "top_p": 0.5,
        "text": {"format": {"type": "json_schema", "name": "obj", "schema": schema}},
        "n": 4, "max_tokens": 99, "seed": 1,  # chat fields, not Responses ones: ignored
    })
    assert body.messages == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": [{"type": "text", "text": "q"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "a"}]},
        {"role": "user", "content": "q2"},
    ]
    params = sampling_params(body)
    assert params.n == 1 and params.max_tokens == 7 and params.seed is None
    assert params.temperature == pytest.approx(0.3) and params.top_p == pytest.approx(0.5)
    # the chat path's response_format json_schema mapping: vLLM structured outputs
    assert params.structured_outputs is not None and params.structured_outputs.json == schema


def test_json_object_format_and_no_format():
    from llm_batch.runtime.engine.sampling import parse_body, sampling_params

    json_object = sampling_params(parse_body(Endpoint.RESPONSES, {
        "input": "x", "text": {"format": {"type": "json_object"}}}))
    assert json_object.structured_outputs.json_object is True
    plain = parse_body(Endpoint.RESPONSES, {"input": "x"})
    assert plain.messages == [{"role": "user", "content": "x"}]
    assert sampling_params(plain).structured_outputs is None


@pytest.mark.parametrize("option", sorted(UNSUPPORTED))
def test_the_engine_refuses_unsupported_options_too(option):
    from llm_batch.runtime.engine.sampling import InvalidRequest, parse_body

    with pytest.raises(InvalidRequest, match=f"{option} is not supported"):
        parse_body(Endpoint.RESPONSES, {"input": "x", option: UNSUPPORTED[option]})


# -- the Response body --------------------------------------------------------------------------


def _fake_output(text: str, finish_reason: str, prompt: int, generated: int, cached: int | None) -> Any:
    completion = SimpleNamespace(index=0, text=text, token_ids=list(range(generated)),
                                 finish_reason=finish_reason, logprobs=None)
    return SimpleNamespace(outputs=[completion], prompt_token_ids=list(range(prompt)),
                           num_cached_tokens=cached)


def _responses() -> list[dict[str, Any]]:
    from llm_batch.runtime.engine.responses import response_object

    fmt = {"type": "json_schema", "name": "color", "schema": {"enum": ["red"]}, "strict": True}
    return [
        response_object(_fake_output('"red"', "stop", 11, 3, 8), "tiny", instructions="sys",
                        metadata={"k": "v"}, max_output_tokens=50, temperature=0.5, top_p=1.0,
                        text_format=fmt),
        response_object(_fake_output("cut", "length", 4, 2, None), "tiny", max_output_tokens=2),
    ]


def _check_structure(done: dict[str, Any], cut: dict[str, Any]) -> None:
    assert done["object"] == "response" and done["id"].startswith("resp_")
    assert done["status"] == "completed" and done["incomplete_details"] is None
    assert done["output"][0]["content"][0] == {"type": "output_text", "text": '"red"', "annotations": [],
                                               "logprobs": []}
    assert done["usage"] == {"input_tokens": 11, "input_tokens_details": {"cached_tokens": 8, "cache_write_tokens": 0},
                             "output_tokens": 3, "output_tokens_details": {"reasoning_tokens": 0},
                             "total_tokens": 14}
    assert cut["status"] == "incomplete" and cut["incomplete_details"] == {"reason": "max_output_tokens"}
    assert cut["output"][0]["status"] == "incomplete"
    assert cut["usage"]["input_tokens_details"]["cached_tokens"] == 0  # unknown: the SDK needs an int


def test_the_response_body_has_the_responses_shape():
    _check_structure(*_responses())


_SDK_CHECK = """
import json, sys
from openai.types.responses import Response
done, cut = (Response.model_validate(b) for b in json.load(sys.stdin))
assert done.output_text == '"red"', done.output_text
assert done.output[0].type == "message" and done.output[0].role == "assistant"
assert done.usage.input_tokens == 11 and done.usage.output_tokens == 3 and done.usage.total_tokens == 14
assert done.usage.input_tokens_details.cached_tokens == 8
assert done.usage.output_tokens_details.reasoning_tokens == 0
assert done.text.format.type == "json_schema" and done.text.format.name == "color"
assert done.instructions == "sys" and done.metadata == {"k": "v"} and done.max_output_tokens == 50
assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
import openai
print(openai.__version__)
"""


@pytest.mark.sdk  # a client release in its own venv (scripts/sdk_venvs.sh): not in the quick lane
def test_the_newest_openai_sdk_parses_the_response():
    from tests.sdk.conftest import newest, venv_python

    release = newest("openai")
    run = subprocess.run([venv_python(release), "-c", _SDK_CHECK], input=json.dumps(_responses()),
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == release.rsplit("-", 1)[1]


# -- the merge's usage sums ---------------------------------------------------------------------


def test_merge_sums_responses_usage_names():
    from llm_batch.pipeline.merge import _UsageSum

    total = _UsageSum()
    for body in _responses():
        total.add(body)
    total.add({"usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6,
                         "prompt_tokens_details": {"cached_tokens": 2},
                         "completion_tokens_details": {"reasoning_tokens": 1}}})
    assert (total.prompt, total.completion, total.cached, total.reasoning) == (11 + 4 + 5, 3 + 2 + 1, 8 + 0 + 2, 1)
