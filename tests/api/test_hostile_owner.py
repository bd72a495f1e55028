"""A user with ordinary credentials attacks the API (tracker issue 35), each as a class:

- a page on another port of the host makes the browser send the Airflow session cookie to
  every state-changing route of the app (read from ``app.routes``: a new route is covered);
- ``?after=<someone else's id>`` on every list route that pages by cursor (also read from
  the app) must answer exactly as an unknown id;
- a file uploaded for another use (purpose ``ocr``, not JSONL-checked) named as a job's
  input on every route that takes file ids;
- an Airflow user or a key owner whose name is not an owner name.

Users of tests/api/conftest.py: alice and bob (user), vic (viewer), root (admin).
"""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.routing import APIRoute

from llm_batch.api.errors import OPENAI_PREFIXES
from tests.api.conftest import chat_lines

pytestmark = pytest.mark.airflow

SAFE_METHODS = {"GET", "HEAD", "OPTIONS"}
MODEL = "tiny-random-llama"


def _code(path: str, body: dict[str, Any]) -> str | None:
    return body["error"]["code"] if path.startswith(OPENAI_PREFIXES) else body.get("code")


def _upload(client, headers, purpose: str = "batch", content: bytes | None = None) -> str:
    response = client.post("/v1/files", headers=headers, files={"file": ("f", content or chat_lines(1))},
                           data={"purpose": purpose})
    assert response.status_code == 200, response.text
    return response.json()["id"]


@pytest.fixture
def no_dag_runs(batch_api):
    """Creates reach the store; the trigger records nothing in Airflow."""
    from llm_batch.api.dag_trigger import get_trigger, run_id_for

    batch_api.dependency_overrides[get_trigger] = lambda: (lambda job_id, conf, submitted_at: run_id_for(job_id))
    yield
    batch_api.dependency_overrides.pop(get_trigger, None)


def _writes(app) -> list[tuple[str, str]]:
    """(method, path) of every state-changing route of the app."""
    found = [(method, route.path) for route in app.routes if isinstance(route, APIRoute)
             for method in sorted(route.methods - SAFE_METHODS)]
    assert len(found) >= 15, found
    return found


def test_the_session_cookie_alone_changes_nothing(client, creds, batch_api):
    """CSRF: with only the _token cookie (what another page can make the browser send),
    every write is refused before it does anything; with the same JWT in a header, it is
    not refused for that reason."""
    cookie = {"Cookie": f"_token={creds.tokens['alice']}"}
    for method, template in _writes(batch_api):
        path = template.replace("{", "").replace("}", "")  # ids: names of no object
        refused = client.request(method, path, headers=cookie)
        assert refused.status_code == 403, (method, template, refused.text)
        assert _code(path, refused.json()) == "csrf_refused", (method, template, refused.text)
        with_header = client.request(method, path, headers={**cookie, **creds.jwt("alice")})
        assert with_header.status_code == 422 or _code(path, with_header.json()) != "csrf_refused", (method, template)


def test_a_multipart_upload_with_the_cookie_alone_is_refused(client, creds, api_store):
    before = api_store.list_files(owner="alice", limit=1000)[1]
    response = client.post("/v1/files", headers={"Cookie": f"_token={creds.tokens['alice']}"},
                           files={"file": ("in.jsonl", chat_lines(1))}, data={"purpose": "batch"})
    assert response.status_code == 403 and response.json()["error"]["code"] == "csrf_refused"
    assert api_store.list_files(owner="alice", limit=1000)[1] == before


def _cursor_lists(app) -> list[str]:
    """Paths of the list routes that page with an ``after`` cursor."""
    return [route.path for route in app.routes if isinstance(route, APIRoute) and "GET" in route.methods
            and any(p.name == "after" for p in route.dependant.query_params)]


def test_someone_elses_id_as_a_cursor_answers_like_an_unknown_id(client, creds, batch_api, no_dag_runs):
    """No existence oracle on any list route: bob gives alice's ids as ``after``."""
    alice = creds.key("alice")
    file_id = _upload(client, alice)
    batch = client.post("/v1/batches", headers=alice, json={"input_file_id": file_id, "endpoint": "/v1/chat/completions",
                                                           "completion_window": "24h"}).json()["id"]
    job = client.post("/v1/jobs", headers=alice, json={"model": MODEL, "requests": [
        {"custom_id": "0", "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}}]}).json()["id"]
    lists = _cursor_lists(batch_api)
    assert {"/v1/files", "/v1/batches", "/v1/jobs", "/ui/api/jobs"} <= set(lists), lists
    for path in lists:
        for real in (file_id, batch, job):
            unknown = real[:-1] + ("0" if real[-1] != "0" else "1")  # the same shape, no object
            for headers in (creds.key("bob"), creds.jwt("bob")):
                theirs = client.get(path, params={"after": real}, headers=headers)
                missing = client.get(path, params={"after": unknown}, headers=headers)
                assert theirs.status_code == missing.status_code == 400, (path, real, theirs.text)
                assert theirs.text.replace(real, unknown) == missing.text, (path, real)
    own = {"/v1/files": file_id, "/v1/batches": batch, "/v1/jobs": job, "/ui/api/jobs": job}
    for path, cursor in own.items():  # the owner pages on with her own ids
        assert client.get(path, params={"after": cursor}, headers=alice).status_code == 200, path


def test_only_batch_uploads_are_batch_input(client, creds, no_dag_runs):
    """An upload of another purpose (ocr, audio: media, never checked as JSONL) named as a
    job's input is refused on every route that takes file ids, naming the file."""
    alice = creds.key("alice")
    media = _upload(client, alice, purpose="ocr", content=chat_lines(1))
    chat = [{"custom_id": "0", "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}}]
    creates = {
        "/v1/batches": {"input_file_id": media, "endpoint": "/v1/chat/completions", "completion_window": "24h"},
        "/v1/batch/jobs": {"input_files": [media], "endpoint": "/v1/chat/completions", "model": MODEL},
        "/v1/jobs": {"input_file_ids": [media], "model": MODEL},
    }
    for path, body in creates.items():
        response = client.post(path, headers=alice, json=body)
        assert response.status_code == 400, (path, response.text)
        assert media in response.text and "purpose 'ocr'" in response.text, (path, response.text)
        assert _code(path, response.json()) == "invalid_input_file", (path, response.text)
    assert client.post("/v1/jobs", headers=alice, json={"requests": chat, "model": MODEL}).status_code == 200


def test_a_caller_whose_name_is_no_owner_name_is_refused(client, auth_manager, api_store):
    """An Airflow user spelled ``Alice`` (or an old key of a folding spelling) would share
    alice's rows and folder: refused, saying why."""
    from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser

    token = auth_manager.generate_jwt(SimpleAuthManagerUser(username="Alice", role="user"), expiration_time_in_seconds=60)
    response = client.get("/v1/jobs", headers={"Authorization": f"Bearer {token}"})
    assert response.status_code == 403 and response.json()["code"] == "invalid_owner_name"
    assert "'Alice'" in response.json()["detail"]
