"""/v1/classifications, /v1/chat/classifications, /v1/moderations and /v1/chat/moderations:
served by classify models (a sequence-classification checkpoint on vLLM's pooling runner;
moderations need the registry's map of its labels to moderation categories), their labels
read from the checkpoint, and per-line validation of Mistral's bodies (errors name the field
and line: a moderation takes a ClassificationRequest, a chat moderation one conversation as
a list of messages or a list of them)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import orjson
import pytest

from llm_batch.core.endpoints import Endpoint, endpoints_served, parse_endpoint, serving_problem
from llm_batch.core.model_config import InvalidModelConfig
from llm_batch.infra.model_registry import ModerationMap, load_registry
from llm_batch.infra.model_resolution import _class_labels, _task_of
from llm_batch.pipeline.validation import ValidationLimits, validate_batch

LIMITS = ValidationLimits(max_requests=1000, max_input_bytes=10**7, max_line_bytes=2**20, max_reported_errors=100)
CHAT = [{"role": "user", "content": "is this good?"}, {"role": "assistant", "content": "yes"}]
USER, ASSISTANT = CHAT


def test_classify_models_serve_both_classification_endpoints():
    for value in ("/v1/classifications", "/v1/chat/classifications"):
        assert parse_endpoint(value).value == value
    assert endpoints_served("classify") == [Endpoint.CLASSIFICATIONS, Endpoint.CHAT_CLASSIFICATIONS]
    assert serving_problem("/v1/classifications", "c", "classify") is None
    assert ("model 'c' (classify task) serves /v1/classifications, /v1/chat/classifications, not "
            "/v1/chat/completions") == serving_problem("/v1/chat/completions", "c", "classify")
    assert "(generate task)" in serving_problem("/v1/chat/classifications", "g", "generate")
    spec = load_registry().models["tiny-random-classifier"]
    assert (spec.task, spec.classifier_target, spec.engine_args["runner"]) == ("classify", "sentiment", "pooling")
    assert load_registry().models["tiny-random-llama"].classifier_target == "label"  # the default


def test_a_checkpoint_outside_the_registry_is_a_classifier_when_converted_so():
    assert _task_of({"runner": "pooling", "convert": "classify"}) == "classify"
    assert _task_of({"runner": "pooling"}) == "embed"
    assert _task_of({}) == "generate"


def test_labels_come_from_the_checkpoint_in_score_order(tmp_path: Path):
    (tmp_path / "config.json").write_text(json.dumps({"id2label": {"1": "b", "0": "a", "2": "c"}}))
    assert _class_labels(tmp_path) == ("a", "b", "c")
    (tmp_path / "config.json").write_text(json.dumps({"num_labels": 2}))
    assert _class_labels(tmp_path) == ("LABEL_0", "LABEL_1")


def _validate(endpoint: str, *bodies):
    data = b"".join(orjson.dumps({"custom_id": f"c{i}", "body": b}) + b"\n" for i, b in enumerate(bodies))
    valid = io.BytesIO()
    report = validate_batch(io.BytesIO(data), fmt="jsonl", endpoint=endpoint, limits=LIMITS,
                            validated_out=valid, errors_out=io.BytesIO())
    ids = [json.loads(line)["custom_id"] for line in valid.getvalue().splitlines()]
    return report, ids, {e.line: e.message for e in report.errors}


def test_classification_lines_are_checked_one_by_one():
    report, ids, errors = _validate(
        "/v1/classifications",
        {"model": "m", "input": "one text"},
        {"input": ["a", "b"], "metadata": {"k": 1}},
        {"input": ""},           # 3
        {"input": ["a", ""]},    # 4
        {"input": []},           # 5
        {"input": [1, 2]},       # 6: token ids are not Mistral's input
        {"inputs": "x"},         # 7: the SDK's field name, not the wire's
        {"input": "x", "metadata": "m"},  # 8
    )
    assert (report.total, report.valid) == (8, 2) and ids == ["c0", "c1"]
    assert errors == {
        3: "body.input: input must not be an empty string",
        4: "body.input[1]: must not be an empty string",
        5: "body.input: input must be a non-empty string or a non-empty list of strings",
        6: "body.input: input must be a non-empty string or a non-empty list of strings",
        7: "body.input: field required",
        8: 'body.metadata: must be a JSON object (got "m")',
    }
    assert report.estimated_prompt_tokens > 0


def test_chat_classification_lines_are_checked_one_by_one():
    report, ids, errors = _validate(
        "/v1/chat/classifications",
        {"model": "m", "input": {"messages": CHAT}},
        {"input": [{"messages": CHAT[:1]}, {"messages": CHAT}]},
        {"input": [{"messages": [{"role": "robot", "content": "x"}]}]},  # 3
        {"input": {"messages": []}},                                   # 4
        {"input": "just text"},                                        # 5
        {"input": [{"messages": CHAT}, {"msgs": CHAT}]},               # 6
        {"input": {"messages": [{"role": "user"}]}},                   # 7
    )
    assert (report.total, report.valid) == (7, 2) and ids == ["c0", "c1"]
    assert errors[3].startswith("body.input[0].messages[0].role: Input should be 'system'")
    assert errors[4] == "body.input.messages: must not be empty"
    assert errors[5].startswith("body.input: input must be a conversation")
    assert errors[6] == "body.input[1].messages: field required"
    assert errors[7] == "body.input.messages[0]: a user message needs content"


@pytest.mark.parametrize("endpoint", ["/v1/classifications", "/v1/chat/classifications"])
def test_llm_batch_validate_takes_the_endpoints(capsys, tmp_path: Path, endpoint: str):
    from llm_batch.cli.main import main

    good = {"input": "x"} if endpoint == "/v1/classifications" else {"input": {"messages": CHAT}}
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"".join(orjson.dumps({"custom_id": c, "body": b}) + b"\n" for c, b in [("a", good), ("b", {})]))
    assert main(["validate", str(path), "--endpoint", endpoint, "--json"]) == 1
    printed = json.loads(capsys.readouterr().out)
    assert (printed["valid"], printed["invalid"]) == (1, 1) and printed["errors"][0]["line"] == 2


# -- moderations ---------------------------------------------------------------------------


def test_moderation_needs_a_classifier_with_a_moderation_map():
    assert endpoints_served("classify", ["moderation"]) == [
        Endpoint.CLASSIFICATIONS, Endpoint.CHAT_CLASSIFICATIONS, Endpoint.MODERATIONS, Endpoint.CHAT_MODERATIONS]
    assert Endpoint.MODERATIONS not in endpoints_served("classify")
    assert serving_problem("/v1/moderations", "c", "classify") == (
        "model 'c' has no 'moderation' entry in the model registry, which /v1/moderations needs (docs/models.md)")
    assert "(generate task)" in serving_problem("/v1/chat/moderations", "g", "generate", ["fim"])
    registry = load_registry()
    assert registry.models["tiny-random-moderator"].features == ["moderation"]
    assert registry.models["tiny-random-classifier"].features == []


def test_the_moderation_map_and_its_thresholds(tmp_path: Path):
    moderation = load_registry().models["tiny-random-moderator"].moderation
    assert moderation.threshold_of("selfharm") == 0.3 and moderation.threshold_of("pii") == 0.5
    assert [label for label, c in moderation.pairs() if c == "violence_and_threats"] == ["violence", "threat"]
    # A label may count for several categories; each category once, in the map's order.
    several = ModerationMap(categories={"harm": ["self-harm", "self-harm/intent"], "hate": "hate", "slur": ["hate"]},
                            thresholds={"self-harm/intent": 0.2})
    assert several.pairs() == [("harm", "self-harm"), ("harm", "self-harm/intent"), ("hate", "hate"), ("slur", "hate")]
    assert several.category_names == ["self-harm", "self-harm/intent", "hate"]
    with pytest.raises(ValueError):
        ModerationMap(categories={"harm": []})
    assert load_registry().models["tiny-random-moderator-openai"].moderation.category_names[:2] == ["sexual", "sexual/minors"]
    with pytest.raises(ValueError, match="thresholds name categories the map does not have: gore"):
        ModerationMap(categories={"v": "violence"}, thresholds={"gore": 0.2})
    with pytest.raises(ValueError):
        ModerationMap(categories={})

    path = tmp_path / "models.yaml"
    path.write_text("default_chat_model: a\ndefault_embedding_model: a\nmodels:\n  a:\n    checkpoint: /m\n"
                    "    task: generate\n    moderation: {categories: {x: y}}\n")
    with pytest.raises(InvalidModelConfig, match="moderation is for classify models, not a generate model"):
        load_registry(path)


def test_moderation_lines_take_mistral_classification_requests():
    report, ids, errors = _validate("/v1/moderations", {"model": "m", "input": "x"}, {"input": ["a", "b"]},
                                    {"input": ["a", ""]}, {"input": {"messages": [USER]}})
    assert ids == ["c0", "c1"] and sorted(errors) == [3, 4]
    assert errors[3] == "body.input[1]: must not be an empty string"
    # OpenAI's multi-modal input: the classifiers here read text, so that line's 400.
    report, ids, errors = _validate("/v1/moderations", {"input": "ok"}, {"input": [
        {"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "x"}}]})
    assert ids == ["c0"] and "list of strings" in errors[2]


def test_chat_moderation_lines_are_checked_one_by_one():
    report, ids, errors = _validate(
        "/v1/chat/moderations",
        {"model": "m", "input": [USER, ASSISTANT]},         # one conversation
        {"input": [[USER], [USER, ASSISTANT]]},             # two
        {"input": []},                                       # 3
        {"input": [[USER], []]},                             # 4
        {"input": [USER, {"role": "robot", "content": "x"}]},  # 5
        {"input": [[USER], [{"role": "user"}]]},             # 6
        {"input": {"messages": [USER]}},                     # 7: chat classification's shape, not this one's
        {"input": [USER, [USER]]},                           # 8: mixed
    )
    assert (report.total, report.valid) == (8, 2) and ids == ["c0", "c1"]
    assert errors[3].startswith("body.input: input must be a non-empty list of messages")
    assert errors[4] == "body.input[1]: must not be empty"
    assert errors[5].startswith("body.input[1].role: Input should be 'system'")
    assert errors[6] == "body.input[1][0]: a user message needs content"
    assert errors[7].startswith("body.input: input must be a non-empty list of messages")
    assert errors[8].startswith("body.input[1]: must be a JSON object")
