"""Request-body schemas: what each endpoint accepts, precise errors, and the fast path
never accepting what the full model refuses."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from llm_batch.core.endpoints import Endpoint
from llm_batch.core.schemas import (
    MAX_N,
    OCR_UNSUPPORTED,
    RESPONSES_UNSUPPORTED,
    TRANSCRIPTION_UNSUPPORTED,
    body_model_for,
    describe_validation_error,
    fast_check_for,
    prompt_chars,
)
from tests.fuzzing import examples

CHAT, COMPLETIONS, EMBEDDINGS = Endpoint.CHAT_COMPLETIONS, Endpoint.COMPLETIONS, Endpoint.EMBEDDINGS
USER = [{"role": "user", "content": "Hello"}]


def error_of(endpoint: Endpoint, body: dict) -> str:
    with pytest.raises(ValidationError) as caught:
        body_model_for(endpoint).model_validate(body)
    return describe_validation_error(caught.value)


@pytest.mark.parametrize("endpoint, body", [
    (CHAT, {"messages": USER}),
    (CHAT, {"messages": [{"role": "system", "content": "Be brief."},
                         {"role": "developer", "content": "Answer in French."},
                         {"role": "user", "content": [{"type": "text", "text": "Hi"},
                                                      {"type": "image_url",
                                                       "image_url": {"url": "data:,"}}]},
                         {"role": "assistant", "content": None,
                          "tool_calls": [{"id": "c1", "type": "function",
                                          "function": {"name": "f", "arguments": "{}"}}]},
                         {"role": "tool", "content": "42", "tool_call_id": "c1"}],
            "max_completion_tokens": 20, "temperature": 0, "top_p": 1, "top_k": -1, "n": 2,
            "stop": ["\n"], "seed": 7, "logprobs": True, "top_logprobs": 20,
            "presence_penalty": -2, "frequency_penalty": 2, "min_tokens": 2,
            "repetition_penalty": 1.1, "user": "u", "model": "ignored", "stream": False,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "x", "schema": {"type": "object"}}}}),
    (CHAT, {"messages": USER, "response_format": {"type": "json_object"}, "stop": "END"}),
    (CHAT, {"messages": USER, "some_future_field": {"a": 1}}),
    (COMPLETIONS, {"prompt": "Once", "max_tokens": 5, "logprobs": 3, "echo": False}),
    (COMPLETIONS, {"prompt": ["a", "b"]}),
    (COMPLETIONS, {"prompt": [1, 2, 3]}),
    (COMPLETIONS, {"prompt": [[1, 2], [3]]}),
    (EMBEDDINGS, {"input": "text", "encoding_format": "base64", "dimensions": 64}),
    (EMBEDDINGS, {"input": ["a", "b"], "model": "m"}),
    (EMBEDDINGS, {"input": [5, 6]}),
])
def test_valid_bodies_are_accepted(endpoint: Endpoint, body: dict) -> None:
    body_model_for(endpoint).model_validate(body)


@pytest.mark.parametrize("endpoint, body, expected", [
    (CHAT, {"messages": []}, "body.messages: must not be empty"),
    (CHAT, {"messages": [{"role": "robot", "content": "x"}]}, "body.messages[0].role:"),
    (CHAT, {"messages": USER, "max_tokens": -1}, "body.max_tokens: Input should be greater"),
    (CHAT, {"messages": USER, "n": 0}, "body.n:"),
    (CHAT, {"messages": USER, "n": MAX_N + 1}, "body.n:"),
    (CHAT, {"messages": USER, "temperature": 2.01}, "body.temperature:"),
    (CHAT, {"messages": USER, "top_p": 0}, "body.top_p:"),
    (CHAT, {"messages": USER, "top_p": 1.5}, "body.top_p:"),
    (CHAT, {"messages": USER, "max_tokens": "5"}, '(got "5")'),
    (CHAT, {"messages": USER, "max_tokens": 5.0}, "body.max_tokens: Input should be a valid integer"),
    (CHAT, {"messages": USER, "logprobs": 1}, "body.logprobs:"),
    (CHAT, {"messages": USER, "stream": True}, "body.stream: stream must be false"),
    (CHAT, {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {}}},
     "body.response_format: response_format.json_schema needs a 'schema'"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "body.messages[0].content[0].text:"),
    (CHAT, {"messages": [{"role": "assistant"}]}, "assistant message needs content, tool_calls"),
    (COMPLETIONS, {"prompt": ""}, "body.prompt: prompt must not be an empty string"),
    (COMPLETIONS, {"prompt": [[]]}, "body.prompt:"),
    (COMPLETIONS, {"prompt": "a", "logprobs": -1}, "body.logprobs:"),
    (EMBEDDINGS, {"input": []}, "body.input:"),
    (EMBEDDINGS, {"input": "a", "dimensions": 0}, "body.dimensions:"),
])
def test_invalid_bodies_say_what_and_where(endpoint: Endpoint, body: dict, expected: str) -> None:
    assert expected in error_of(endpoint, body)


def test_several_problems_are_listed_and_capped() -> None:
    message = error_of(CHAT, {"messages": USER, "n": 0, "top_p": 0, "temperature": 9,
                              "max_tokens": 0, "seed": "x"})
    assert message.count("body.") == 3 and message.endswith("and 2 more")


def test_body_model_for_takes_strings() -> None:
    assert body_model_for("/v1/embeddings") is body_model_for(EMBEDDINGS)
    with pytest.raises(ValueError):
        body_model_for("/v1/conversations")


def test_prompt_chars() -> None:
    assert prompt_chars({"messages": [{"role": "user", "content": "abcd"},
                                      {"role": "user", "content": [{"type": "text",
                                                                    "text": "ef"}]}]}) == 6
    assert prompt_chars({"prompt": ["ab", "c"]}) == 3
    assert prompt_chars({"input": [1, 2]}) == 8


# -- the fast path ------------------------------------------------------------------------------

def test_fast_path_takes_the_common_shape() -> None:
    body = {"messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": "Hello"}],
            "max_tokens": 64, "temperature": 0.7, "model": "m"}
    assert fast_check_for(CHAT)(body) == len("Be brief.") + len("Hello")
    assert fast_check_for(COMPLETIONS)({"prompt": "abc", "max_tokens": 3}) == 3
    assert fast_check_for(EMBEDDINGS)({"input": "abcd"}) == 4


def test_fast_path_defers_anything_unusual() -> None:
    fast = fast_check_for(CHAT)
    assert fast({"messages": [{"role": "user", "content": "x", "name": "n"}]}) is None
    assert fast({"messages": USER, "min_tokens": 3}) is None
    assert fast({"messages": USER, "max_tokens": True}) is None
    assert fast({"messages": []}) is None


BOUNDARY_VALUES = [-3, -2, -1.5, -1, 0, 0.0, 0.5, 1, 1.0, 2, 2.0, 2.5, 20, MAX_N, MAX_N + 1,
                   True, False, None, "x", "", ["a", "b"], [1], [], {},
                   2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**64 - 1]
FAST_FIELDS = ["max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "n",
               "seed", "stop", "presence_penalty", "frequency_penalty", "user", "model"]


def _model_accepts(endpoint: Endpoint, body: dict) -> bool:
    try:
        body_model_for(endpoint).model_validate(body)
    except ValidationError:
        return False
    return True


def test_fast_path_agrees_with_the_model_at_every_boundary() -> None:
    taken = 0
    for endpoint, base in ((CHAT, {"messages": USER}), (COMPLETIONS, {"prompt": "p"})):
        for field in FAST_FIELDS:
            for value in BOUNDARY_VALUES:
                body = {**base, field: value}
                fast = fast_check_for(endpoint)(body)
                assert fast is None or _model_accepts(endpoint, body), (endpoint, field, value)
                taken += fast is not None
    assert taken > 100  # the fast path is really exercised


values = st.one_of(st.integers(-3, 40), st.floats(-2.5, 2.5), st.sampled_from(BOUNDARY_VALUES))
messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "developer", "tool", "robot", 3]),
     "content": st.one_of(st.text(max_size=5), st.none(), st.integers())}), max_size=3)
fields = st.dictionaries(st.sampled_from(FAST_FIELDS + ["min_tokens", "logprobs", "stream"]),
                         values, max_size=4)
@settings(max_examples=examples(400), deadline=None)
@given(messages=messages, fields=fields, prompt=st.one_of(st.text(max_size=3), values))
def test_fast_path_never_accepts_what_the_model_refuses(messages, fields, prompt) -> None:
    for endpoint, body in ((CHAT, {"messages": messages, **fields}),
                           (COMPLETIONS, {"prompt": prompt, **fields}),
                           (EMBEDDINGS, {"input": prompt, **fields})):
        if fast_check_for(endpoint)(body) is not None:
            body_model_for(endpoint).model_validate(body)  # must not raise


# -- tried as a user: what the openai SDK's types (and vLLM) allow must pass -----------------

SDK_VALID_CHAT_MESSAGES = [
    # assistant turns that carry no content (the SDK makes every field but role optional)
    [*USER, {"role": "assistant", "refusal": "I can't."}, *USER],
    [*USER, {"role": "assistant", "audio": {"id": "audio_1"}}, *USER],
    [*USER, {"role": "assistant", "content": None,
             "function_call": {"name": "f", "arguments": "{}"}},
     {"role": "function", "name": "f", "content": "42"}],  # the deprecated function role
    [*USER, {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]}],
    [*USER, {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "42"}]}],
    # Mistral's SDK: tool call ids and a tool message's tool_call_id are optional
    [*USER, {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]},
     {"role": "tool", "name": "f", "content": "42"}],
    # content part types vLLM's chat parser reads besides the SDK's
    [{"role": "user", "content": [{"type": "input_text", "text": "a"},
                                  {"type": "input_image", "image_url": "https://x/y.png"},
                                  {"type": "video_url", "video_url": {"url": "https://x/v.mp4"}},
                                  {"type": "audio_url", "audio_url": {"url": "https://x/a.wav"}},
                                  {"type": "input_audio",
                                   "input_audio": {"data": "AAA", "format": "wav"}},
                                  {"type": "image_embeds", "image_embeds": "base64"},
                                  {"type": "thinking", "thinking": "hmm"},
                                  {"type": "file", "file": {"file_id": "file-1"}}]}],
    [{"role": "user", "content": [{"type": "image_url",
                                   "image_url": {"url": "https://x/y.png", "detail": "low"}}]}],
]


@pytest.mark.parametrize("messages", SDK_VALID_CHAT_MESSAGES)
def test_messages_the_sdk_allows_are_accepted(messages: list) -> None:
    body_model_for(CHAT).model_validate({"messages": messages})


def test_sdk_request_options_are_accepted() -> None:
    body_model_for(CHAT).model_validate({
        "messages": USER,
        "tools": [{"type": "function", "function": {
            "name": "f", "description": "d", "strict": True,
            "parameters": {"type": "object", "properties": {}}}}],
        "tool_choice": {"type": "function", "function": {"name": "f"}},
        "parallel_tool_calls": False, "logit_bias": {"50256": -100},
        "functions": [{"name": "f"}], "function_call": "auto",
        "store": False, "metadata": {"k": "v"}, "service_tier": "auto",
        "reasoning_effort": "low", "modalities": ["text"], "stream_options": None,
        "prediction": {"type": "content", "content": "x"}, "web_search_options": {},
        "temperature": None, "max_tokens": None, "n": None, "stop": None, "seed": -1,
    })
    body_model_for(COMPLETIONS).model_validate({"prompt": "x", "logit_bias": {"1": 5},
                                                "best_of": 2, "n": 2})


@pytest.mark.parametrize("endpoint, body, expected", [
    (CHAT, {"messages": [{"role": "function", "content": "42"}]},
     "body.messages[0]: a function message needs name"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url",
                                                       "image_url": "https://x/y.png"}]}]},
     "body.messages[0].content[0]: image_url must be an object with a 'url' string"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "input_text"}]}]},
     "body.messages[0].content[0]: a content part of type 'input_text' needs a 'text' field"),
    (CHAT, {"messages": USER, "temperature": True}, "body.temperature: Input should be a valid "
                                                    "number (got true)"),
    # orjson reads an integer literal past 64 bits as a float
    (CHAT, {"messages": USER, "max_tokens": 1e26},
     "body.max_tokens: Input should be an integer that fits in 64 bits"),
    (CHAT, {"messages": USER, "seed": 2**63}, "body.seed: Input should be less than or equal to "
                                              "9223372036854775807"),
    (CHAT, {"messages": ["hi"]}, 'body.messages[0]: must be a JSON object (got "hi")'),
    (CHAT, {"messages": [*USER, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "custom", "custom": {"name": "f", "input": "x"}}]}]},
     "body.messages[1].tool_calls[0]: a tool call of type 'custom' is not supported"),
    (CHAT, {"messages": USER, "tool_choice": 5}, "body.tool_choice: tool_choice must be a string"),
    (COMPLETIONS, {"prompt": ["a", ""]}, "body.prompt[1]: must not be an empty string"),
    (EMBEDDINGS, {"input": ["", "a"]}, "body.input[0]: must not be an empty string"),
])
def test_user_mistakes_say_what_and_where(endpoint: Endpoint, body: dict, expected: str) -> None:
    assert error_of(endpoint, body).startswith(expected)



_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
                     max_leaves=8)
# Each option a rule refuses, on the endpoint that has the rule, with a body that is otherwise valid.
_REFUSED_OPTIONS = [
    (Endpoint.RESPONSES, {"model": "m", "input": "hi"}, option) for option in RESPONSES_UNSUPPORTED
] + [
    (Endpoint.TRANSCRIPTIONS, {"model": "m", "file_id": "file-1"}, option) for option in TRANSCRIPTION_UNSUPPORTED
] + [
    (Endpoint.OCR, {"model": "m", "document": {"type": "document_url", "document_url": "a.pdf"}}, option)
    for option in OCR_UNSUPPORTED
]


@pytest.mark.parametrize(("endpoint", "body", "option"), _REFUSED_OPTIONS)
@settings(max_examples=examples(60), deadline=None)
@given(value=_JSON)
def test_a_refusing_rule_never_raises_whatever_the_value(endpoint: Endpoint, body: dict, option: str, value) -> None:
    """Any JSON value of a refused option is that line's error or accepted, never an exception
    out of validation (one bad line never fails a batch)."""
    try:
        body_model_for(endpoint).model_validate({**body, option: value})
    except ValidationError:
        pass
