"""OpenAI bodies -> vLLM parameters (no engine): fields honoured, errors named."""

from __future__ import annotations

import pytest

from llm_batch.core.endpoints import Endpoint


@pytest.fixture(scope="module", autouse=True)
def _vllm_side() -> None:
    """The names under test import vLLM: bound when the module's first test runs, not when collected."""
    global InvalidRequest, RequestOutputKind, parse_body, pooling_params, sampling_params
    from vllm.sampling_params import RequestOutputKind

    from llm_batch.runtime.engine.sampling import InvalidRequest, parse_body, pooling_params, sampling_params


CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def _params(endpoint: Endpoint, body: dict):
    return sampling_params(parse_body(endpoint, body))


def test_chat_fields_map_to_sampling_params():
    p = _params(Endpoint.CHAT_COMPLETIONS, {
        **CHAT, "model": "ignored", "stream": False, "n": 2, "temperature": 0.5, "top_p": 0.9, "top_k": 20,
        "max_tokens": 99, "max_completion_tokens": 50, "stop": ["\n"], "seed": 3, "presence_penalty": 0.1,
        "frequency_penalty": 0.2, "repetition_penalty": 1.1, "min_tokens": 2, "logprobs": True, "top_logprobs": 4,
        "ignore_eos": True,
    })
    assert (p.n, p.temperature, p.top_p, p.top_k, p.seed) == (2, 0.5, 0.9, 20, 3)
    assert p.max_tokens == 50  # max_completion_tokens wins, as in OpenAI's API
    assert (p.stop, p.min_tokens, p.logprobs, p.ignore_eos) == (["\n"], 2, 4, True)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.1, 0.2, 1.1)
    assert p.output_kind == RequestOutputKind.FINAL_ONLY
    assert p.structured_outputs is None


def test_chat_defaults_leave_vllm_defaults_and_no_logprobs():
    p = _params(Endpoint.CHAT_COMPLETIONS, CHAT)
    assert (p.n, p.max_tokens, p.logprobs, p.ignore_eos) == (1, None, None, False)
    assert _params(Endpoint.CHAT_COMPLETIONS, {**CHAT, "logprobs": True}).logprobs == 0


def test_completions_default_max_tokens_and_logprobs():
    p = _params(Endpoint.COMPLETIONS, {"prompt": "x", "logprobs": 3})
    assert (p.max_tokens, p.logprobs) == (16, 3)


def test_response_formats_become_structured_outputs():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    p = _params(Endpoint.CHAT_COMPLETIONS, {**CHAT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
    assert p.structured_outputs.json == schema
    p = _params(Endpoint.CHAT_COMPLETIONS, {**CHAT, "response_format": {"type": "json_object"}})
    assert p.structured_outputs.json_object is True
    assert _params(Endpoint.CHAT_COMPLETIONS, {**CHAT, "response_format": {"type": "text"}}).structured_outputs is None


@pytest.mark.parametrize(("endpoint", "body", "message"), [
    (Endpoint.CHAT_COMPLETIONS, {}, "messages: Field required"),
    (Endpoint.CHAT_COMPLETIONS, {"messages": []}, "messages: List should have at least 1 item"),
    (Endpoint.CHAT_COMPLETIONS, {"messages": [{"content": "x"}]}, "messages\\[0\\] has no 'role'"),
    (Endpoint.CHAT_COMPLETIONS, {**CHAT, "temperature": "hot"}, "temperature: Input should be a valid number"),
    (Endpoint.CHAT_COMPLETIONS, {**CHAT, "temperature": 3}, "temperature"),
    (Endpoint.CHAT_COMPLETIONS, {**CHAT, "top_p": 0}, "top_p"),
    (Endpoint.CHAT_COMPLETIONS, {**CHAT, "n": 0}, "n must be at least 1"),
    (Endpoint.CHAT_COMPLETIONS, {**CHAT, "top_logprobs": 2}, "top_logprobs needs logprobs"),
    (Endpoint.CHAT_COMPLETIONS, {**CHAT, "response_format": {"type": "xml"}}, "response_format.type"),
    (Endpoint.CHAT_COMPLETIONS, {**CHAT, "response_format": {"type": "json_schema", "json_schema": {}}},
     "response_format.json_schema.schema"),
    (Endpoint.COMPLETIONS, {"prompt": "x", "echo": True}, "echo is not supported"),
    (Endpoint.COMPLETIONS, {"prompt": "x", "max_tokens": 0}, "max_tokens"),
])
def test_bad_bodies_name_the_field(endpoint, body, message):
    with pytest.raises(InvalidRequest, match=message):
        _params(endpoint, body)


def test_completion_prompt_shapes():
    one = lambda prompt: parse_body(Endpoint.COMPLETIONS, {"prompt": prompt}).single_prompt()  # noqa: E731
    assert one("text") == "text"
    assert one(["only"]) == "only"
    assert one([1, 2, 3]) == [1, 2, 3]
    assert one([[1, 2]]) == [1, 2]
    with pytest.raises(InvalidRequest, match="a list of 2 prompts"):
        one(["a", "b"])
    with pytest.raises(InvalidRequest, match="must not be empty"):
        one([])


def test_embedding_inputs_and_params():
    body = parse_body(Endpoint.EMBEDDINGS, {"input": ["a", "b"], "dimensions": 8})
    assert body.inputs() == ["a", "b"]
    assert parse_body(Endpoint.EMBEDDINGS, {"input": "a"}).inputs() == ["a"]
    assert parse_body(Endpoint.EMBEDDINGS, {"input": [3, 4]}).inputs() == [[3, 4]]
    params = pooling_params(body)
    assert (params.task, params.dimensions) == ("embed", 8)
    with pytest.raises(InvalidRequest, match="encoding_format"):
        parse_body(Endpoint.EMBEDDINGS, {"input": "a", "encoding_format": "int8"})
