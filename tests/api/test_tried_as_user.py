"""Regressions for what broke when the API was tried as a new user would, against a real
``airflow api-server`` with the official SDKs and raw HTTP (docs/api.md, "Tried as a user").
Each test names the input that used to be accepted, crash a job later, or answer vaguely."""

from __future__ import annotations

import orjson
import pytest
from pydantic import BaseModel

from tests.api.conftest import app_on, chat_lines, mounted, simulate_run

pytestmark = pytest.mark.airflow


def upload(client, headers, content: bytes, filename: str = "in.jsonl"):
    return client.post("/v1/files", headers=headers, files={"file": (filename, content)}, data={"purpose": "batch"})


def uploaded_id(client, creds, content: bytes | None = None) -> str:
    response = upload(client, creds.key("alice"), content or chat_lines(2))
    assert response.status_code == 200, response.text
    return response.json()["id"]


# --- bodies the server could not parse ------------------------------------------------


class TextBody(BaseModel):
    text: str



def test_streamed_body_over_the_limit_is_413_naming_the_limit():
    """A chunked body (no Content-Length) over the limit was a vague 400 ("error parsing
    the body"): FastAPI wrapped the middleware's own exception."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from llm_batch.api.app import BodyLimit
    from llm_batch.api.errors import install_error_handlers

    app = FastAPI()
    install_error_handlers(app)

    @app.post("/v1/batch/jobs")
    def create(body: TextBody) -> dict:
        return {"n": len(body.text)}

    app.add_middleware(BodyLimit, json_limit=1000, upload_limit=1000)
    client = TestClient(app)
    chunks = (b'{"text": "' + b"x" * 600, b"x" * 600 + b'"}')
    response = client.post("/v1/batch/jobs", content=iter(chunks), headers={"content-type": "application/json"})
    assert response.status_code == 413
    assert response.json()["code"] == "body_too_large" and "1000 bytes" in response.json()["detail"]
    small = client.post("/v1/batch/jobs", json={"text": "hi"})
    assert small.status_code == 200 and small.json() == {"n": 2}


def test_body_that_is_not_json_says_so(client, creds):
    path = "/v2/batch-completions"
    broken = client.post(path, headers={**creds.key("alice"), "content-type": "application/json"}, content=b'{"a": ')
    assert broken.status_code == 422
    assert broken.json()["param"] == "body" and "not valid JSON" in broken.json()["message"]

    not_utf8 = client.post(path, headers={**creds.key("alice"), "content-type": "application/json"}, content=b'{"a": "\xff"}')
    assert not_utf8.status_code == 400
    assert not_utf8.json()["param"] == "body" and "UnicodeDecodeError" in not_utf8.json()["detail"]

    plain = client.post(path, headers={**creds.key("alice"), "content-type": "text/plain"}, content=b'{"a": 1}')
    assert plain.status_code == 422
    assert "Content-Type: application/json" in plain.json()["message"] and "text/plain" in plain.json()["message"]


def test_unknown_route_and_method_name_what_was_asked(client, creds):
    missing = client.get("/v1/models", headers=creds.key("alice"))
    assert missing.status_code == 404 and "GET /batch/v1/models" in missing.json()["detail"]
    wrong_method = client.put("/v1/batch/jobs/job_x", headers=creds.key("alice"))
    assert wrong_method.status_code == 405
    assert "PUT /batch/v1/batch/jobs/job_x" in wrong_method.json()["detail"] and "GET" in wrong_method.json()["detail"]


# --- models that cannot serve the endpoint ---------------------------------------------


def test_generate_model_on_embeddings_is_refused_at_submission(client, creds):
    """Was accepted; the worker would have failed the whole job at its start."""
    response = client.post(
        "/v1/batches", headers=creds.key("alice"),
        json={"input_file_id": uploaded_id(client, creds), "endpoint": "/v1/embeddings", "completion_window": "24h"},
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "model_endpoint_mismatch" and "tiny-random-llama" in error["message"]


def test_embedding_model_on_chat_is_refused_at_submission(client, creds):
    response = client.post(
        "/v1/batch/jobs", headers=creds.key("alice"),
        json={"requests": [{"body": {"messages": []}}], "endpoint": "/v1/chat/completions", "model": "all-minilm-l6-v2"},
    )
    assert response.status_code == 400, response.text
    assert response.json()["code"] == "model_endpoint_mismatch" and response.json()["param"] == "model"


# --- Mistral input files ----------------------------------------------------------------


def test_mistral_same_file_twice_is_refused(client, creds):
    """Was accepted: every request would have run twice under the same custom_id."""
    file_id = uploaded_id(client, creds)
    response = client.post(
        "/v1/batch/jobs", headers=creds.key("alice"),
        json={"input_files": [file_id, file_id], "endpoint": "/v1/chat/completions", "model": "tiny-random-llama"},
    )
    assert response.status_code == 400
    assert response.json()["param"] == "input_files[1]" and response.json()["code"] == "duplicate_input_file"


def test_mistral_job_on_an_output_file_is_refused(client, creds, api_store):
    created = client.post(
        "/v1/batch/jobs", headers=creds.key("alice"),
        json={"input_files": [uploaded_id(client, creds)], "endpoint": "/v1/chat/completions", "model": "tiny-random-llama"},
    ).json()
    for _ in simulate_run(api_store, created["id"], ok=2, failed=0):
        pass
    output_file = api_store.get_job(created["id"]).output_file_id
    response = client.post(
        "/v1/batch/jobs", headers=creds.key("alice"),
        json={"input_files": [output_file], "endpoint": "/v1/chat/completions", "model": "tiny-random-llama"},
    )
    assert response.status_code == 400
    assert response.json()["param"] == "input_files[0]" and "output file" in response.json()["detail"]


# --- Scale paths and content --------------------------------------------------------------


@pytest.fixture()
def scale_paths(alice_dir):
    folder = alice_dir / "tried-as-user"
    folder.mkdir(exist_ok=True)
    files = {
        "good": orjson.dumps([{"prompt": "hi", "max_tokens": 2}]),
        "text": b"hello world\n",
        "empty": b"",
        "jsonl": chat_lines(2),
        "empty_array": b"[]",
    }
    for name, content in files.items():
        (folder / f"{name}.json").write_bytes(content)
    return folder


@pytest.mark.parametrize(
    ("input_name", "wanted"),
    [("text", "expected a JSON array"), ("empty", "is empty"), ("jsonl", "not valid JSON"), ("empty_array", "no requests")],
)
def test_scale_input_that_is_not_a_request_array_is_refused(client, creds, scale_paths, input_name, wanted):
    """Were accepted (anything not starting with '{' was taken for an array)."""
    response = client.post(
        "/v2/batch-completions", headers=creds.key("alice"),
        json={"input_data_path": str(scale_paths / f"{input_name}.json"), "output_data_path": str(scale_paths / "out.json"),
              "model_config": {"model": "tiny-random-llama"}},
    )
    assert response.status_code == 400, response.text
    assert response.json()["param"] == "input_data_path" and wanted in response.json()["detail"]


@pytest.mark.parametrize(("output_name", "wanted"), [(".", "is a directory"), ("good.json", "is the input_data_path")])
def test_scale_output_path_must_be_a_new_file(client, creds, scale_paths, output_name, wanted):
    """Were accepted: the job would have failed only after all its inference (directory) or
    overwritten its own requests."""
    response = client.post(
        "/v2/batch-completions", headers=creds.key("alice"),
        json={"input_data_path": str(scale_paths / "good.json"), "output_data_path": str(scale_paths / output_name),
              "model_config": {"model": "tiny-random-llama"}},
    )
    assert response.status_code == 400, response.text
    assert response.json()["param"] == "output_data_path" and wanted in response.json()["detail"]


def test_scale_empty_inline_content_is_refused(client, creds, scale_paths):
    response = client.post(
        "/v2/batch-completions", headers=creds.key("alice"),
        json={"content": [], "output_data_path": str(scale_paths / "out.json"), "model_config": {"model": "tiny-random-llama"}},
    )
    assert response.status_code == 400 and response.json()["param"] == "content"


def test_scale_checkpoint_outside_the_roots_is_refused(client, creds, scale_paths):
    """Was accepted (checkpoint_path skipped every check); the worker would refuse it."""
    response = client.post(
        "/v2/batch-completions", headers=creds.key("alice"),
        json={"input_data_path": str(scale_paths / "good.json"), "output_data_path": str(scale_paths / "out.json"),
              "model_config": {"model": "mine", "checkpoint_path": "/etc"}},
    )
    assert response.status_code == 400, response.text
    assert response.json()["param"] == "model_config.checkpoint_path" and "outside" in response.json()["detail"]


# --- uploads and deletes ------------------------------------------------------------------


def test_upload_skips_leading_blank_lines_as_the_pipeline_does(client, creds):
    assert upload(client, creds.key("alice"), b"\n\r\n" + chat_lines(1)).status_code == 200
    blank = upload(client, creds.key("alice"), b" \n\n ")
    assert blank.status_code == 400 and "empty" in blank.json()["error"]["message"]
    bad = upload(client, creds.key("alice"), b"\n\nnot json\n")
    assert bad.status_code == 400 and "line 3" in bad.json()["error"]["message"]


def test_upload_of_two_files_in_one_request_is_refused(client, creds):
    """Was 200 with only the last file kept."""
    response = client.post(
        "/v1/files", headers=creds.key("alice"), data={"purpose": "batch"},
        files=[("file", ("a.jsonl", chat_lines(1))), ("file", ("b.jsonl", chat_lines(1)))],
    )
    assert response.status_code == 400 and "2 'file' parts" in response.json()["error"]["message"]


def test_file_read_by_a_live_job_cannot_be_deleted(client, creds, api_store):
    """Was deleted: the queued job would have failed for want of its input."""
    file_id = uploaded_id(client, creds)
    batch = client.post(
        "/v1/batches", headers=creds.key("alice"),
        json={"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"},
    ).json()
    refused = client.delete(f"/v1/files/{file_id}", headers=creds.key("alice"))
    assert refused.status_code == 409
    assert refused.json()["error"]["code"] == "file_in_use" and batch["id"] in refused.json()["error"]["message"]
    assert client.get(f"/v1/files/{file_id}/content", headers=creds.key("alice")).status_code == 200

    from llm_batch.core.jobs import JobStatus

    api_store.transition(batch["id"], JobStatus.CANCELLED)
    assert client.delete(f"/v1/files/{file_id}", headers=creds.key("alice")).status_code == 200


def test_own_storage_outside_the_roots_is_a_server_error_not_the_users(auth_manager, api_store, creds, tmp_path):
    """Was 400 path_not_allowed naming an internal path, as if the user had sent it."""
    from fastapi.testclient import TestClient

    from llm_batch.core.config import get_settings

    settings = get_settings().model_copy(update={"files_uri": str(tmp_path / "outside-the-roots")})
    outer = mounted(app_on(api_store, auth_manager, settings), auth_manager)
    with TestClient(outer, base_url="http://testserver/batch", raise_server_exceptions=False) as client:
        response = upload(client, creds.key("alice"), chat_lines(1))
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "storage_misconfigured"
    assert "LLM_BATCH_LOCAL_ROOTS" in response.json()["error"]["message"]


# --- round two: cancel, lists, auth, limits, output paths ----------------------------------


def test_cancel_of_an_ended_job_is_409_naming_its_status(client, creds, api_store):
    """Was 200 with the job unchanged: the caller could not tell nothing happened."""
    from llm_batch.core.jobs import JobStatus

    batch = client.post(
        "/v1/batches", headers=creds.key("alice"),
        json={"input_file_id": uploaded_id(client, creds), "endpoint": "/v1/chat/completions", "completion_window": "24h"},
    ).json()
    for status in (JobStatus.VALIDATING, JobStatus.RUNNING, JobStatus.SUCCEEDED):
        api_store.transition(batch["id"], status)
    openai = client.post(f"/v1/batches/{batch['id']}/cancel", headers=creds.key("alice"))
    assert openai.status_code == 409 and "'completed'" in openai.json()["error"]["message"]
    mistral = client.post(f"/v1/batch/jobs/{batch['id']}/cancel", headers=creds.key("alice"))
    assert mistral.status_code == 409 and "'SUCCESS'" in mistral.json()["detail"]
    scale = client.post(f"/v2/batch-completions/{batch['id']}/actions/cancel", headers=creds.key("alice"))
    assert scale.status_code == 200 and scale.json() == {"success": False}
    assert client.get(f"/v1/batches/{batch['id']}", headers=creds.key("alice")).json()["status"] == "completed"


def test_cancel_twice_is_idempotent(client, creds):
    batch = client.post(
        "/v1/batches", headers=creds.key("alice"),
        json={"input_file_id": uploaded_id(client, creds), "endpoint": "/v1/chat/completions", "completion_window": "24h"},
    ).json()
    first = client.post(f"/v1/batches/{batch['id']}/cancel", headers=creds.key("alice"))
    second = client.post(f"/v1/batches/{batch['id']}/cancel", headers=creds.key("alice"))
    assert first.status_code == second.status_code == 200
    assert first.json()["cancelling_at"] == second.json()["cancelling_at"] is not None


@pytest.mark.parametrize("created_after", ["0001-01-01T00:00:00", "9999-12-31T23:59:59"])
def test_mistral_list_with_extreme_naive_created_after(client, creds, created_after):
    """Year 1 without a zone was a 500 (local-time conversion overflowed)."""
    response = client.get("/v1/batch/jobs", headers=creds.key("alice"), params={"created_after": created_after})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    ("credentials", "wanted"),
    [("!!!", "malformed"), (":password", "no user name"), ("", "no user name")],
)
def test_basic_auth_without_a_key_says_what_is_wrong(client, credentials, wanted):
    """Was a bare "Not authenticated" (FastAPI's HTTPBasic answered before our check)."""
    import base64

    value = credentials if credentials in ("!!!", "") else base64.b64encode(credentials.encode()).decode()
    response = client.get("/v2/batch-completions", headers={"Authorization": f"Basic {value}"})
    assert response.status_code == 401 and wanted in response.json()["detail"]


def test_basic_auth_with_the_key_and_no_colon_works(client, creds):
    import base64

    value = base64.b64encode(creds.keys["alice"].encode()).decode()
    assert client.get("/v2/batch-completions", headers={"Authorization": f"Basic {value}"}).status_code == 200


def test_metadata_and_labels_are_bounded(client, creds, scale_paths):
    """1000 pairs of 1000 characters were stored as they came."""
    many = {str(i): "v" for i in range(65)}
    mistral = client.post(
        "/v1/batch/jobs", headers=creds.key("alice"),
        json={"requests": [{"body": {"messages": []}}], "endpoint": "/v1/chat/completions", "model": "tiny-random-llama", "metadata": many},
    )
    assert mistral.status_code == 422 and mistral.json()["param"] == "metadata"
    scale = client.post(
        "/v2/batch-completions", headers=creds.key("alice"),
        json={"content": [{"prompt": "x"}], "output_data_path": str(scale_paths / "out.json"),
              "model_config": {"model": "tiny-random-llama"}, "labels": {"team": "x" * 513}},
    )
    assert scale.status_code == 422 and scale.json()["param"] == "labels"


def test_scale_output_below_a_file_is_refused(client, creds, scale_paths):
    response = client.post(
        "/v2/batch-completions", headers=creds.key("alice"),
        json={"content": [{"prompt": "x"}], "output_data_path": str(scale_paths / "good.json" / "out.json"),
              "model_config": {"model": "tiny-random-llama"}},
    )
    assert response.status_code == 400 and "which is a file" in response.json()["detail"]


def test_every_dialect_refuses_an_output_that_is_a_directory(client, creds, scale_paths):
    """Scale's rule was Scale's alone: a native job naming a folder failed after all its inference."""
    response = client.post("/v1/jobs", headers=creds.key("alice"), json={
        "requests": [{"body": {"prompt": "x"}}], "endpoint": "/v1/completions", "model": "tiny-random-llama",
        "output_uri": str(scale_paths)})
    assert response.status_code == 400, response.text
    assert response.json()["param"] == "output_uri" and "is a directory" in response.json()["message"]


def test_scale_output_that_names_a_bucket_is_refused():
    from llm_batch.pipeline.admission import check_output_object

    for uri in ("s3://bucket", "s3://bucket/", "s3://bucket/folder/"):
        with pytest.raises(Exception, match="names a bucket or folder"):
            check_output_object(uri, "output_data_path")
    check_output_object("s3://bucket/out.json", "output_data_path")  # an object: fine


def test_openai_batch_on_a_file_with_leading_blank_lines(client, creds):
    """Uploads skip leading blank lines, so the model must come from the first request line."""
    file_id = uploaded_id(client, creds, b"\n\n" + chat_lines(2))
    response = client.post(
        "/v1/batches", headers=creds.key("alice"),
        json={"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"},
    )
    assert response.status_code == 200, response.text
    assert response.json()["model"] == "tiny-random-llama"
    no_model = uploaded_id(client, creds, b"\n" + orjson.dumps({"custom_id": "a", "body": {"messages": []}}) + b"\n")
    refused = client.post(
        "/v1/batches", headers=creds.key("alice"),
        json={"input_file_id": no_model, "endpoint": "/v1/chat/completions", "completion_window": "24h"},
    )
    assert refused.status_code == 400 and "line 2" in refused.json()["error"]["message"]


def test_inline_json_bodies_are_capped_by_a_small_upload_limit(auth_manager, api_store, creds):
    """Inline requests become an input file: with LLM_BATCH_MAX_INPUT_BYTES below 64 MiB the
    JSON body limit follows it (was always 64 MiB)."""
    from fastapi.testclient import TestClient

    from llm_batch.core.config import get_settings

    settings = get_settings().model_copy(update={"max_input_bytes": 10_000})
    outer = mounted(app_on(api_store, auth_manager, settings), auth_manager)
    body = {"requests": [{"body": {"messages": [{"role": "user", "content": "x" * 1000}]}}] * 2000,
            "endpoint": "/v1/chat/completions", "model": "tiny-random-llama"}
    with TestClient(outer, base_url="http://testserver/batch", raise_server_exceptions=False) as client:
        response = client.post("/v1/batch/jobs", headers=creds.key("alice"), json=body)
    assert response.status_code == 413


@pytest.mark.parametrize(
    "route, payload, param",
    [
        ("/v1/batch/jobs",
         '{"endpoint": "/v1/chat/completions", "model": "tiny-random-llama", "requests": ['
         '{"custom_id": "ok", "body": {"messages": [{"role": "user", "content": "hi"}]}},'
         '{"custom_id": "big", "body": {"messages": [{"role": "user", "content": "hi"}],'
         ' "max_tokens": 100000000000000000000000}}]}',
         "requests[1].body.max_tokens"),
        ("/v1/batch/jobs",
         '{"endpoint": "/v1/chat/completions", "model": "tiny-random-llama", "requests": ['
         '{"custom_id": "s", "body": {"messages": [{"role": "user", "content": "\\ud800"}]}}]}',
         "requests[0].body.messages[0].content"),
        ("/v2/batch-completions",
         '{"output_data_path": "OUT", "model_config": {"model": "tiny-random-llama"},'
         ' "content": [{"prompt": "hi", "max_tokens": NaN}]}',
         "content[0].max_tokens"),
    ],
)
def test_inline_values_json_cannot_carry_are_400_naming_where(client, creds, alice_dir, route, payload, param):
    """Python's JSON parser accepts lone surrogates, integers past 64 bits and NaN; writing
    them for the pipeline used to fail with a 500."""
    payload = payload.replace("OUT", str(alice_dir / "scale-out" / "nan.json"))
    response = client.post(route, headers={**creds.key("alice"), "content-type": "application/json"},
                           content=payload.encode())
    assert response.status_code == 400, response.text
    assert param in response.text
