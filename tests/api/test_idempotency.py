"""Retry-safe creates: the Idempotency-Key header on every create route and on uploads,
over raw HTTP and through the openai SDK; 50 concurrent creates with one key make one job
(SQLite and PostgreSQL); keys are per owner, checked, released after a 5xx, and deleted by
housekeeping after 24 hours."""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta

import httpx
import orjson
import pytest

from tests.api.conftest import app_on, chat_lines, mounted

pytestmark = pytest.mark.airflow

CHAT = "/v1/chat/completions"
MODEL = "tiny-random-llama"


def _key() -> str:
    return f"test-{uuid.uuid4().hex}"


def _upload(client, headers, content: bytes) -> str:
    response = client.post("/v1/files", headers=headers, files={"file": ("in.jsonl", content)}, data={"purpose": "batch"})
    assert response.status_code == 200, response.text
    return response.json()["id"]


def _inline(tag: str) -> list[dict]:
    return [{"custom_id": "0", "body": {"messages": [{"role": "user", "content": tag}], "max_tokens": 2}}]


def _create_bodies(client, alice, alice_dir) -> dict[str, tuple[str, dict, str]]:
    """route -> (path, a JSON body, the id field of its answer)."""
    file_id = _upload(client, alice, chat_lines(2))
    tag = uuid.uuid4().hex
    scale = {"output_data_path": str(alice_dir / f"idem-{tag}.json"), "content": [{"prompt": "x", "max_tokens": 2}],
             "model_config": {"model": MODEL}}
    return {
        "openai": ("/v1/batches", {"input_file_id": file_id, "endpoint": CHAT, "completion_window": "24h"}, "id"),
        "mistral": ("/v1/batch/jobs", {"requests": _inline(tag), "endpoint": CHAT, "model": MODEL}, "id"),
        "scale-v2": ("/v2/batch-completions", scale, "job_id"),
        "scale-v1": ("/v1/llm/batch-completions", {**scale, "output_data_path": str(alice_dir / f"idem-v1-{tag}.json")},
                     "job_id"),
        "native": ("/v1/jobs", {"requests": _inline(tag), "model": MODEL, "labels": {"idem": tag}}, "id"),
    }


@pytest.mark.parametrize("route", ["openai", "mistral", "scale-v2", "scale-v1", "native"])
def test_same_key_same_body_replays_the_first_response(client, creds, api_store, alice_dir, route):
    alice = creds.key("alice")
    path, body, id_field = _create_bodies(client, alice, alice_dir)[route]
    key = _key()
    raw = orjson.dumps(body)
    headers = {**alice, "Idempotency-Key": key, "Content-Type": "application/json"}
    first = client.post(path, headers=headers, content=raw)
    assert first.status_code == 200, first.text
    again = client.post(path, headers=headers, content=raw)
    assert again.status_code == first.status_code and again.content == first.content
    assert again.headers.get("idempotent-replayed") == "true" and "idempotent-replayed" not in first.headers
    job_id = first.json()[id_field]
    assert api_store.get_job(job_id).owner == "alice"
    jobs, _ = api_store.list_jobs(owner="alice", limit=1000)
    assert [j.id for j in jobs].count(job_id) == 1

    # Another body with the key: 422 naming the header, in the route's dialect.
    changed = client.post(path, headers=headers, content=orjson.dumps({**body, "metadata": {"other": "body"}}))
    assert changed.status_code == 422, changed.text
    error = changed.json().get("error") or changed.json()
    assert error["code"] == "idempotency_key_reused" and error["param"] == "Idempotency-Key"
    _conforms(client, path, changed)  # the body the route documents for its 422

    # The key is the owner's: bob's same key is his own, a new job.
    if route in ("mistral", "native"):
        bob = client.post(path, headers={**creds.key("bob"), "Idempotency-Key": key, "Content-Type": "application/json"},
                          content=raw)
        assert bob.status_code == 200 and bob.json()[id_field] != job_id


def _conforms(client, path: str, response) -> None:
    """`response` (to POST `path`) has a body its OpenAPI document allows for its status."""
    import jsonschema

    document = client.get("/openapi.json").json()
    declared = document["paths"][path]["post"]["responses"]
    assert str(response.status_code) in declared, (path, response.status_code, sorted(declared))
    schema = declared[str(response.status_code)]["content"]["application/json"]["schema"]
    jsonschema.Draft202012Validator({**schema, "components": document["components"]}).validate(response.json())


def test_every_route_taking_a_key_documents_its_refusals(client):
    """A malformed key (400) and a reused one (422, the API's own error body) are documented
    wherever the header is taken: creates, uploads, retry and rerun."""
    document = client.get("/openapi.json").json()
    keyed = [(path, method, operation) for path, item in document["paths"].items() for method, operation in item.items()
             if any(p.get("name") == "Idempotency-Key" for p in operation.get("parameters", []))]
    assert {p for p, *_ in keyed} >= {"/v1/jobs", "/v1/jobs/{job_id}/retry", "/v1/jobs/{job_id}/rerun", "/v1/batches"}
    for path, method, operation in keyed:
        assert {"400", "422"} <= set(operation["responses"]), (method, path, sorted(operation["responses"]))


def test_same_key_on_another_route_is_a_conflict(client, creds, alice_dir):
    alice = creds.key("alice")
    bodies = _create_bodies(client, alice, alice_dir)
    key = _key()
    path, body, _ = bodies["native"]
    assert client.post(path, headers={**alice, "Idempotency-Key": key}, json=body).status_code == 200
    other, _, _ = bodies["mistral"]
    reused = client.post(other, headers={**alice, "Idempotency-Key": key}, json=body)
    assert reused.status_code == 422 and reused.json()["code"] == "idempotency_key_reused"
    assert "/v1/jobs" in reused.json()["message"]
    # Every 422 of the dialect has FastAPI's per-field list, this refusal's too.
    assert [problem["loc"] for problem in reused.json()["detail"]] == [["header", "Idempotency-Key"]]


def test_upload_with_a_key_is_stored_once(client, creds, api_store):
    alice = {**creds.key("alice"), "Idempotency-Key": _key()}
    content = chat_lines(3)
    first = client.post("/v1/files", headers=alice, files={"file": ("a.jsonl", content)}, data={"purpose": "batch"})
    assert first.status_code == 200, first.text
    # A new multipart boundary, the same content and purpose: the same file.
    again = client.post("/v1/files", headers=alice, files={"file": ("a.jsonl", content)}, data={"purpose": "batch"})
    assert again.status_code == 200 and again.json() == first.json()
    other = client.post("/v1/files", headers=alice, files={"file": ("a.jsonl", chat_lines(4))}, data={"purpose": "batch"})
    assert other.status_code == 422
    assert other.json()["error"]["code"] == "idempotency_key_reused"
    assert other.json()["error"]["param"] == "Idempotency-Key"
    files, _ = api_store.list_files(owner="alice", limit=1000)
    assert [f.id for f in files].count(first.json()["id"]) == 1


@pytest.mark.parametrize("key, why", [("", "empty"), ("k" * 256, "longer than 255"), ("bad\x7fkey", "printable")])
def test_bad_key_is_400_naming_the_header(client, creds, key, why):
    body = {"requests": _inline("x"), "model": MODEL}
    response = client.post("/v1/jobs", headers={**creds.key("alice"), "Idempotency-Key": key}, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["param"] == "Idempotency-Key" and response.json()["code"] == "invalid_idempotency_key"
    assert why in response.json()["detail"]
    openai = client.post("/v1/batches", headers={**creds.key("alice"), "Idempotency-Key": key},
                         json={"input_file_id": "file-x", "endpoint": CHAT})
    assert openai.status_code == 400 and openai.json()["error"]["param"] == "Idempotency-Key"


def test_a_4xx_is_kept_a_5xx_releases_the_key(client, creds, monkeypatch):
    from llm_batch.api.native import jobs as jobs_router

    alice = {**creds.key("alice"), "Idempotency-Key": _key()}
    missing = {"input_file_ids": ["file-missing"], "model": MODEL}
    first = client.post("/v1/jobs", headers=alice, json=missing)
    assert first.status_code == 404
    again = client.post("/v1/jobs", headers=alice, json=missing)
    assert again.status_code == 404 and again.json() == first.json() and again.headers["idempotent-replayed"] == "true"

    key = {**creds.key("alice"), "Idempotency-Key": _key()}
    body = {"requests": _inline(uuid.uuid4().hex), "model": MODEL}
    real_submit = jobs_router.submit

    def broken(*args, **kwargs):
        raise RuntimeError("store exploded")

    monkeypatch.setattr(jobs_router, "submit", broken)
    assert client.post("/v1/jobs", headers=key, json=body).status_code == 500
    monkeypatch.setattr(jobs_router, "submit", real_submit)
    retried = client.post("/v1/jobs", headers=key, json=body)
    assert retried.status_code == 200, retried.text
    assert "idempotent-replayed" not in retried.headers


def test_openai_sdk_extra_headers(live_server, creds, api_store):
    from openai import OpenAI, UnprocessableEntityError

    client = OpenAI(api_key=creds.keys["alice"], base_url=f"{live_server}/batch/v1", max_retries=0)
    content = chat_lines(2)
    upload_key = _key()
    uploaded = client.files.create(file=("in.jsonl", content), purpose="batch", extra_headers={"Idempotency-Key": upload_key})
    again = client.files.create(file=("in.jsonl", content), purpose="batch", extra_headers={"Idempotency-Key": upload_key})
    assert again.id == uploaded.id

    key = _key()
    batch = client.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h",
                                  metadata={"sdk": "idem"}, extra_headers={"Idempotency-Key": key})
    retried = client.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h",
                                    metadata={"sdk": "idem"}, extra_headers={"Idempotency-Key": key})
    assert retried.id == batch.id and retried.created_at == batch.created_at
    with pytest.raises(UnprocessableEntityError) as caught:
        client.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h",
                              metadata={"sdk": "other"}, extra_headers={"Idempotency-Key": key})
    assert caught.value.code == "idempotency_key_reused" and caught.value.param == "Idempotency-Key"


def _fifty_at_once(base_url: str, headers: dict[str, str], body: dict) -> list[httpx.Response]:
    key = _key()
    with httpx.Client(base_url=base_url, headers={**headers, "Idempotency-Key": key}, timeout=120) as http:
        with ThreadPoolExecutor(max_workers=50) as pool:
            return list(pool.map(lambda _: http.post("/v1/batch/jobs", json=body), range(50)))


def _assert_one_job(responses: list[httpx.Response], store, owner: str, tag: str) -> None:
    assert [r.status_code for r in responses] == [200] * 50, {r.status_code: r.text for r in responses if r.status_code != 200}
    assert len({r.content for r in responses}) == 1
    assert sum(1 for r in responses if "idempotent-replayed" not in r.headers) == 1
    jobs, total = store.list_jobs(owner=owner, metadata={"wave": tag}, limit=1000)
    assert total == 1 and jobs[0].id == responses[0].json()["id"]


def test_50_concurrent_creates_with_one_key_make_one_job_sqlite(live_server, creds, api_store):
    tag = uuid.uuid4().hex
    body = {"requests": _inline(tag), "endpoint": CHAT, "model": MODEL, "metadata": {"wave": tag}}
    responses = _fifty_at_once(f"{live_server}/batch", creds.key("bob"), body)
    _assert_one_job(responses, api_store, "bob", tag)


@pytest.mark.postgres
def test_50_concurrent_creates_with_one_key_make_one_job_postgres(postgres_db_url, auth_manager, airflow_dags_in_db):
    import threading
    import time

    import uvicorn

    from llm_batch.infra.jobstore import JobStore

    store = JobStore(postgres_db_url)
    key = store.create_api_key("carol", "pg test key")[1]
    outer = mounted(app_on(store, auth_manager), auth_manager)
    server = uvicorn.Server(uvicorn.Config(outer, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "the test API server did not start"
            time.sleep(0.05)
        port = server.servers[0].sockets[0].getsockname()[1]
        tag = uuid.uuid4().hex
        body = {"requests": _inline(tag), "endpoint": CHAT, "model": MODEL, "metadata": {"wave": tag}}
        responses = _fifty_at_once(f"http://127.0.0.1:{port}/batch", {"Authorization": f"Bearer {key}"}, body)
        _assert_one_job(responses, store, "carol", tag)
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        store.close()


def test_a_pending_key_past_its_lease_is_free_and_housekeeping_drops_old_keys(client, creds, api_store):
    from llm_batch.api import idempotency
    from llm_batch.pipeline import housekeeping

    key = _key()
    past = datetime.now(UTC) - idempotency.LEASE - timedelta(seconds=5)
    taken, _ = api_store.reserve_idempotency_key("alice", key, "POST /v1/jobs", "0" * 64, idempotency.LEASE, now=past)
    assert taken  # a request that never finished
    body = {"requests": _inline(uuid.uuid4().hex), "model": MODEL}
    response = client.post("/v1/jobs", headers={**creds.key("alice"), "Idempotency-Key": key}, json=body)
    assert response.status_code == 200, response.text
    assert api_store.get_idempotency_key("alice", key).status_code == 200

    assert housekeeping.delete_old_idempotency_keys(api_store, now=datetime.now(UTC) + timedelta(hours=23)) >= 0
    assert api_store.get_idempotency_key("alice", key) is not None  # kept 24 hours
    assert housekeeping.delete_old_idempotency_keys(api_store, now=datetime.now(UTC) + timedelta(hours=25)) >= 1
    assert api_store.get_idempotency_key("alice", key) is None
    again = client.post("/v1/jobs", headers={**creds.key("alice"), "Idempotency-Key": key}, json=body)
    assert again.status_code == 200 and again.json()["id"] != response.json()["id"]


def test_the_header_is_in_the_openapi_document(client):
    document = client.get("/openapi.json").json()
    for path in ("/v1/files", "/v1/batches", "/v1/batch/jobs", "/v2/batch-completions", "/v1/llm/batch-completions",
                 "/v1/jobs"):
        names = [p["name"] for p in document["paths"][path]["post"].get("parameters", [])]
        assert "Idempotency-Key" in names, path


def test_the_cli_client_sends_a_derived_key(live_server, creds, tmp_path):
    from llm_batch.infra.api_client import BatchClient, submit_key

    batch = tmp_path / "batch.jsonl"
    batch.write_bytes(chat_lines(2) + f'{{"custom_id": "{uuid.uuid4().hex}", "body": {{"messages": []}}}}\n'.encode())
    with BatchClient(f"{live_server}/batch", creds.keys["alice"]) as cli:
        first = cli.submit(batch, endpoint=CHAT, model=MODEL)
        assert cli.submit(batch, endpoint=CHAT, model=MODEL).id == first.id  # the same command: the same job
        assert cli.submit(batch, endpoint=CHAT, model=MODEL, new=True).id != first.id
        other = cli.submit(batch, endpoint=CHAT, model=MODEL, idempotency_key=_key())
        assert other.id != first.id
        # With shards (and any other option) the same: upload + native create, both keyed.
        sharded = cli.submit(batch, endpoint=CHAT, model=MODEL, shards=2)
        assert cli.submit(batch, endpoint=CHAT, model=MODEL, shards=2).id == sharded.id
    assert submit_key(batch, model=MODEL) == submit_key(batch, model=MODEL) != submit_key(batch, model="other")
    batch.write_bytes(chat_lines(3))
    assert submit_key(batch, model=MODEL) != submit_key(tmp_path / "batch.jsonl", model="x")


def test_the_operator_hook_sends_a_key_of_its_job_id(live_server, creds, monkeypatch):
    from types import SimpleNamespace

    from llm_batch.airflow.hooks.llm_batch import LLMBatchHook, idempotency_key_for

    hook = LLMBatchHook()
    conn = SimpleNamespace(conn_id="llm_batch_default", host=live_server, schema=None, port=None,
                           password=creds.keys["alice"])
    monkeypatch.setattr(hook, "get_connection", lambda _: conn)
    job_id = f"job_{uuid.uuid4().hex}"
    body = {"id": job_id, "model": MODEL, "requests": _inline("op")}
    first = hook.create_job(body)
    again = hook.create_job(body)
    # The replay answers the job as it is now (a retried task sees it ended, if it has).
    assert again["id"] == first["id"] == job_id and again["replayed"] and "replayed" not in first
    assert idempotency_key_for(job_id).endswith(job_id)
    changed = hook.create_job({**body, "labels": {"changed": "yes"}})  # re-attaches by id, as before
    assert changed["id"] == job_id
