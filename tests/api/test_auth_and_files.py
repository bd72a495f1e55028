"""Auth (Airflow JWT, API keys in three forms, revoked keys, viewers) and the files API."""

from __future__ import annotations

import base64

import pytest

from tests.api.conftest import chat_lines

pytestmark = pytest.mark.airflow


def upload(client, headers, content: bytes, filename="in.jsonl", purpose="batch"):
    return client.post("/v1/files", headers=headers, files={"file": (filename, content)}, data={"purpose": purpose})


def test_health_needs_no_credentials(client):
    response = client.get("/health")
    assert response.status_code == 200
    assert response.json()["status"] == "healthy"


@pytest.mark.parametrize("path", ["/v1/files", "/v1/batches", "/v1/batch/jobs", "/v2/batch-completions"])
def test_no_credentials_is_401(client, path):
    response = client.get(path)
    assert response.status_code == 401


def test_openai_routes_answer_openai_error_shape(client):
    body = client.get("/v1/batches").json()
    assert set(body["error"]) == {"message", "type", "param", "code"}


def test_api_key_in_each_of_three_forms(client, creds):
    key = creds.keys["alice"]
    forms = [
        {"Authorization": f"Bearer {key}"},
        {"x-api-key": key},
        {"Authorization": "Basic " + base64.b64encode(f"{key}:".encode()).decode()},
    ]
    for headers in forms:
        response = client.get("/v1/batch/jobs", headers=headers)
        assert response.status_code == 200, (headers, response.text)


def test_wrong_api_key_is_401(client):
    assert client.get("/v1/files", headers={"x-api-key": "lbk_not-a-key"}).status_code == 401


def test_revoked_key_fails(client, api_store):
    record, key = api_store.create_api_key("carol", "to revoke")
    assert client.get("/v1/files", headers={"x-api-key": key}).status_code == 200
    api_store.revoke_api_key(record.id)
    response = client.get("/v1/files", headers={"x-api-key": key})
    assert response.status_code == 401
    assert "revoked" in response.json()["error"]["message"]


def test_airflow_jwt_works_and_garbage_jwt_does_not(client, creds):
    assert client.get("/v1/files", headers=creds.jwt("alice")).status_code == 200
    assert client.get("/v1/files", headers={"Authorization": "Bearer not.a.jwt"}).status_code in (401, 403)


def test_viewer_can_read_but_not_upload(client, creds):
    assert client.get("/v1/files", headers=creds.jwt("vic")).status_code == 200
    response = upload(client, creds.jwt("vic"), chat_lines(1))
    assert response.status_code == 403


def test_upload_get_list_content_delete(client, creds):
    content = chat_lines(3)
    created = upload(client, creds.key("alice"), content)
    assert created.status_code == 200, created.text
    file = created.json()
    assert file["bytes"] == len(content) and file["purpose"] == "batch" and file["object"] == "file"

    assert client.get(f"/v1/files/{file['id']}", headers=creds.key("alice")).json()["id"] == file["id"]
    listed = client.get("/v1/files", headers=creds.key("alice")).json()
    assert file["id"] in [f["id"] for f in listed["data"]]
    downloaded = client.get(f"/v1/files/{file['id']}/content", headers=creds.key("alice"))
    assert downloaded.status_code == 200 and downloaded.content == content

    deleted = client.delete(f"/v1/files/{file['id']}", headers=creds.key("alice"))
    assert deleted.json() == {"id": file["id"], "object": "file", "deleted": True}
    assert client.get(f"/v1/files/{file['id']}", headers=creds.key("alice")).status_code == 404


def test_someone_elses_file_is_404_but_admin_sees_it(client, creds):
    file = upload(client, creds.key("alice"), chat_lines(1)).json()
    for path in (f"/v1/files/{file['id']}", f"/v1/files/{file['id']}/content"):
        assert client.get(path, headers=creds.key("bob")).status_code == 404
        assert client.get(path, headers=creds.jwt("bob")).status_code == 404
        assert client.get(path, headers=creds.key("admin-key")).status_code == 200
        assert client.get(path, headers=creds.jwt("root")).status_code == 200
    assert client.delete(f"/v1/files/{file['id']}", headers=creds.key("bob")).status_code == 404
    assert file["id"] not in [f["id"] for f in client.get("/v1/files", headers=creds.key("bob")).json()["data"]]


def test_upload_wrong_purpose_is_400_saying_why(client, creds):
    response = upload(client, creds.key("alice"), chat_lines(1), purpose="fine-tune")
    assert response.status_code == 400
    assert "purpose" in response.json()["error"]["message"]
    assert response.json()["error"]["param"] == "purpose"


def test_audio_and_ocr_uploads_are_kept_as_they_are_within_the_media_limit(client, creds, batch_api, monkeypatch):
    """Files that /v1/audio/transcriptions and /v1/ocr lines name by id are not JSONL: their
    content is checked where a line names them (llm_batch.infra.media)."""
    for purpose, content in (("audio", b"RIFF\x00\x00\x00\x00WAVE..."), ("ocr", b"\x89PNG\r\n\x1a\n...")):
        response = upload(client, creds.key("alice"), content, filename=f"f.{purpose}", purpose=purpose)
        assert response.status_code == 200, response.text
        assert response.json()["purpose"] == purpose and response.json()["bytes"] == len(content)
    assert upload(client, creds.key("alice"), b"", purpose="audio").status_code == 400
    monkeypatch.setattr(batch_api.state.llm_batch.settings, "max_media_bytes", 10)
    assert upload(client, creds.key("alice"), b"x" * 11, purpose="ocr").status_code == 413


@pytest.mark.parametrize(
    "content, words",
    [(b"not json at all\n", "not valid JSON"), (b"[1, 2]\n", "not an object"), (b"", "empty")],
)
def test_upload_not_jsonl_is_400_saying_why(client, creds, content, words):
    response = upload(client, creds.key("alice"), content)
    assert response.status_code == 400
    assert words in response.json()["error"]["message"]


def test_upload_too_large_is_413_with_the_limit(client, creds, batch_api, monkeypatch):
    monkeypatch.setattr(batch_api.state.llm_batch.settings, "max_input_bytes", 100)
    response = upload(client, creds.key("alice"), chat_lines(5))
    assert response.status_code == 413
    assert "100 bytes" in response.json()["error"]["message"]


def test_admin_sees_every_users_jobs_others_only_their_own(client, creds):
    body = {"requests": [{"body": {"messages": [{"role": "user", "content": "hi"}]}}], "endpoint": "/v1/chat/completions", "model": "tiny-random-llama"}
    mine = client.post("/v1/batch/jobs", headers=creds.key("alice"), json=body).json()["id"]
    for headers in (creds.key("admin-key"), creds.jwt("root")):
        assert client.get(f"/v1/batch/jobs/{mine}", headers=headers).status_code == 200
        seen = client.get("/v1/batch/jobs", headers=headers, params={"page_size": 1000}).json()["data"]
        assert mine in [j["id"] for j in seen]
    theirs = client.get("/v1/batch/jobs", headers=creds.key("bob"), params={"page_size": 1000}).json()["data"]
    assert mine not in [j["id"] for j in theirs]


def test_json_body_over_the_limit_is_413(api_store, auth_manager, monkeypatch):
    from fastapi.testclient import TestClient

    from llm_batch.api import app as app_module

    monkeypatch.setattr(app_module, "MAX_JSON_BODY_BYTES", 1000)
    small = app_module.create_app(store=api_store)
    small.state.auth_manager = auth_manager
    with TestClient(small) as test_client:
        response = test_client.post("/v1/batch/jobs", content=b"{" + b" " * 2000 + b"}", headers={"content-type": "application/json"})
        openai = test_client.post("/v1/batches", content=b"{" + b" " * 2000 + b"}", headers={"content-type": "application/json"})
    # Refused before routing, in the route's dialect all the same.
    assert response.status_code == 413 and response.json()["code"] == "body_too_large"
    assert "1000 bytes" in response.json()["message"]
    assert openai.status_code == 413 and "1000 bytes" in openai.json()["error"]["message"]


@pytest.mark.parametrize("path, params", [("/v1/batches", {"limit": 101}), ("/v1/batch/jobs", {"page_size": 1001}), ("/v1/files", {"limit": 1001})])
def test_page_sizes_are_capped(client, creds, path, params):
    assert client.get(path, headers=creds.key("alice"), params=params).status_code == 422


def test_storage_failure_is_503_saying_what(client, creds, monkeypatch):
    from llm_batch.api import uploads
    from llm_batch.infra import storage

    def broken(uri):
        raise storage.StorageError(uri, "connection refused")

    monkeypatch.setattr(uploads.storage, "open_write", broken)
    response = client.post("/v1/files", headers=creds.key("alice"), files={"file": ("a.jsonl", chat_lines(1))}, data={"purpose": "batch"})
    assert response.status_code == 503
    assert "connection refused" in response.json()["error"]["message"]
