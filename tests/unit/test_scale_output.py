"""A Scale job's output array holds each case in Scale's shape: v1 prompts (either route) as
``CompletionOutput`` (with ``tokens`` when asked), v2 completion and chat items as their
``text_completion`` / ``chat.completion`` bodies, a failure as an ``error`` object; one
element per input item, in input order. The bodies are the engine's (llm_batch.runtime.engine.responses)
from stand-in outputs; structure, counts and order are checked, never text."""

from __future__ import annotations

import orjson
import pytest

from llm_batch.core.input_formats import InputFormat
from llm_batch.core.records import BatchRequest
from llm_batch.core.scale_output import CompletionOutput, success_element
from llm_batch.infra.results import read_results
from llm_batch.pipeline.sharding import read_manifest
from tests.unit.data_plane_fixtures import engine_answer, new_layout, run_scale_job

V1_KEYS = {"text", "num_prompt_tokens", "num_completion_tokens", "tokens"}
PROMPTS = [f"prompt {i}" for i in range(5)]


def _v1_content(**shared):
    return {"prompts": PROMPTS, "max_new_tokens": 3, "temperature": 0.0, **shared}


def _failure(element, index):
    assert element == {"error": {"code": "context_length_exceeded", "message": "prompt is too long"},
                       "custom_id": str(index), "line": index + 1}


def test_v1_prompts_are_completion_outputs_in_input_order():
    array = run_scale_job(new_layout(), _v1_content(), InputFormat.SCALE_V1, "/v1/completions",
                          failing={2}, shards=2)
    assert len(array) == len(PROMPTS)
    _failure(array[2], 2)
    for element in array[:2] + array[3:]:
        assert set(element) == V1_KEYS
        CompletionOutput.model_validate(element, strict=True)
        assert element["num_prompt_tokens"] == 5 and element["num_completion_tokens"] == 3
        assert element["tokens"] == []  # not asked


def test_v1_prompts_asking_for_log_probs_carry_one_token_output_per_generated_token():
    array = run_scale_job(new_layout(), _v1_content(return_token_log_probs=True), InputFormat.SCALE_V1,
                          "/v1/completions")
    assert len(array) == len(PROMPTS)
    for element in array:
        assert set(element) == V1_KEYS
        tokens = element["tokens"]
        assert len(tokens) == element["num_completion_tokens"] == 3
        assert all(set(t) == {"token", "log_prob"} and isinstance(t["log_prob"], float) for t in tokens)
        assert "".join(t["token"] for t in tokens) == element["text"]


@pytest.mark.parametrize(("item", "endpoint", "kind"), [
    ({"prompt": "a", "max_tokens": 3}, "/v1/completions", "text_completion"),
    ({"messages": [{"role": "user", "content": "a"}], "max_tokens": 3}, "/v1/chat/completions", "chat.completion"),
])
def test_v2_items_are_their_response_bodies(item, endpoint, kind):
    layout = new_layout()
    array = run_scale_job(layout, [item] * 4, InputFormat.SCALE_V2, endpoint, failing={1})
    assert len(array) == 4
    _failure(array[1], 1)
    (shard,) = read_manifest(layout).shards
    bodies = {r.index: r.body for r in read_results(shard.results_uri) if r.ok}
    assert [array[i] for i in sorted(bodies)] == [bodies[i] for i in sorted(bodies)] and sorted(bodies) == [0, 2, 3]
    for element in array[:1] + array[2:]:
        assert element["object"] == kind and {"id", "created", "model", "choices", "usage"} <= set(element)
        (choice,) = element["choices"]
        assert ("message" in choice) == (kind == "chat.completion")


def test_the_success_element_follows_the_input_format():
    request = BatchRequest(index=0, custom_id="0", body={"prompt": "a", "max_tokens": 3, "logprobs": 1})
    body = engine_answer(request).body
    assert success_element(InputFormat.SCALE_V1)(body) == {
        "text": body["choices"][0]["text"], "num_prompt_tokens": body["usage"]["prompt_tokens"],
        "num_completion_tokens": body["usage"]["completion_tokens"],
        "tokens": [{"token": t, "log_prob": lp} for t, lp in zip(body["choices"][0]["logprobs"]["tokens"],
                                                                  body["choices"][0]["logprobs"]["token_logprobs"])]}
    for fmt in (InputFormat.SCALE_V2, InputFormat.JSONL, None):
        assert success_element(fmt)(body) is body


def test_cli_merge_writes_v1_elements_with_scale_v1(capsys):
    from llm_batch.cli.main import main
    from llm_batch.infra import storage

    layout = new_layout()
    run_scale_job(layout, _v1_content(), InputFormat.SCALE_V1, "/v1/completions", shards=2)
    merged = storage.read_bytes(layout.output_json)
    assert main(["merge", layout.job_id, "--scale-v1", "--no-jsonl", "--work-uri", layout.work_uri]) == 0
    assert storage.read_bytes(layout.output_json) == merged  # what the DAG's merge wrote
    assert main(["merge", layout.job_id, "--scale", "--no-jsonl", "--work-uri", layout.work_uri]) == 0
    assert all(element["object"] == "text_completion" for element in orjson.loads(storage.read_bytes(layout.output_json)))
    capsys.readouterr()
