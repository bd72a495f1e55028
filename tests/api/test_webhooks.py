"""Webhooks through the API and the CLI: endpoints per owner (create shows the secret once,
list, get, delete, test, attempts), refused destinations, and the events of every dialect's
jobs arriving signed at a real local receiver (verified with the openai SDK's
``webhooks.unwrap``), retried after a 500, with the attempts listed.

The app under test is create_app() with settings that allow 127.0.0.1 (the receiver); the
session app keeps the defaults, which refuse it."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from llm_batch.jobs import JobStatus
from tests.unit.test_webhook_outbox import Receiver, unwrap

pytestmark = pytest.mark.airflow

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def hook_settings():
    from llm_batch.config import get_settings

    return get_settings().model_copy(update=dict(
        webhook_allowed_hosts=["127.0.0.1"], webhook_retry_base_s=0.05, webhook_timeout_s=2.0,
        webhook_poll_interval_s=0.05,
    ))


@pytest.fixture(scope="module")
def hook_app(auth_manager, api_store, hook_settings, airflow_dags_in_db):
    from fastapi import FastAPI

    from llm_batch_plugin.app import create_app

    api = create_app(settings=hook_settings, store=api_store)
    api.state.auth_manager = auth_manager
    outer = FastAPI()
    outer.state.auth_manager = auth_manager
    outer.mount("/batch", api)
    return outer


@pytest.fixture()
def api(hook_app, api_store) -> Iterator:
    from fastapi.testclient import TestClient

    with TestClient(hook_app, base_url="http://testserver/batch", raise_server_exceptions=False) as client:
        yield client
    for endpoint in api_store.list_webhook_endpoints():  # no endpoint outlives its test
        if endpoint.url.startswith("http://127.0.0.1"):
            api_store.delete_webhook_endpoint(endpoint.id)


@pytest.fixture()
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


def _deliver_all(store, settings, done, timeout: float = 60.0) -> None:
    from llm_batch.webhooks import Deliverer

    deliverer = Deliverer(store, settings)
    try:
        deadline = time.monotonic() + timeout
        while not done():
            assert time.monotonic() < deadline, "not delivered in time"
            if not deliverer.run_once():
                time.sleep(0.05)
    finally:
        deliverer.close()


def test_endpoints_crud_secret_once_and_per_owner(api, creds, receiver):
    created = api.post("/v1/webhooks", headers=creds.key("alice"),
                       json={"url": receiver.url, "events": ["batch.completed", "batch.failed"], "description": "ci"})
    assert created.status_code == 200, created.text
    body = created.json()
    assert body["secret"].startswith("whsec_") and body["object"] == "webhook_endpoint"
    assert body["events"] == ["batch.completed", "batch.failed"] and body["owner"] == "alice"
    endpoint_id = body["id"]
    got = api.get(f"/v1/webhooks/{endpoint_id}", headers=creds.jwt("alice"))
    assert got.status_code == 200 and "secret" not in got.json()
    listed = api.get("/v1/webhooks", headers=creds.key("alice")).json()["data"]
    assert endpoint_id in [e["id"] for e in listed] and all("secret" not in e for e in listed)
    # Someone else's endpoint looks missing; a viewer may read but not create; admins see everyone's.
    assert api.get(f"/v1/webhooks/{endpoint_id}", headers=creds.key("bob")).status_code == 404
    assert endpoint_id not in api.get("/v1/webhooks", headers=creds.key("bob")).text
    assert api.delete(f"/v1/webhooks/{endpoint_id}", headers=creds.key("bob")).status_code == 404
    assert api.post("/v1/webhooks", headers=creds.jwt("vic"), json={"url": receiver.url}).status_code == 403
    assert endpoint_id in api.get("/v1/webhooks", headers=creds.key("admin-key")).text
    default = api.post("/v1/webhooks", headers=creds.key("alice"), json={"url": receiver.url}).json()
    assert default["events"] == ["batch.completed", "batch.failed", "batch.expired", "batch.cancelled"]
    bad = api.post("/v1/webhooks", headers=creds.key("alice"), json={"url": receiver.url, "events": ["batch.started"]})
    assert bad.status_code == 422
    deleted = api.delete(f"/v1/webhooks/{endpoint_id}", headers=creds.key("alice"))
    assert deleted.json() == {"id": endpoint_id, "object": "webhook_endpoint.deleted", "deleted": True}
    assert api.get(f"/v1/webhooks/{endpoint_id}", headers=creds.key("alice")).status_code == 404


@pytest.mark.parametrize("url", ["http://169.254.169.254/latest/meta-data/", "http://10.0.0.1/hook",
                                 "http://[::1]/hook", "http://[::ffff:10.0.0.1]/hook", "ftp://example.com/x"])
def test_refused_urls_are_400_naming_the_url(api, creds, url):
    response = api.post("/v1/webhooks", headers=creds.key("alice"), json={"url": url})
    assert response.status_code == 400, response.text
    body = response.json()
    assert url in body["detail"] and body["param"] == "url" and body["code"] == "webhook_url_refused"


def test_loopback_is_refused_unless_an_admin_allowed_it(client, creds, receiver):
    """The session app has the default settings: 127.0.0.1 is refused there."""
    response = client.post("/v1/webhooks", headers=creds.key("alice"), json={"url": receiver.url})
    assert response.status_code == 400 and receiver.url in response.json()["detail"]
    assert "LLM_BATCH_WEBHOOK_ALLOWED_HOSTS" in response.json()["detail"]
    # A name that resolves to a refused address is refused.
    response = client.post("/v1/webhooks", headers=creds.key("alice"), json={"url": "http://localhost:8080/hook"})
    assert response.status_code == 400 and "resolves to 127.0.0.1" in response.json()["detail"]


def test_test_event_is_signed_and_its_attempt_listed(api, creds, receiver):
    created = api.post("/v1/webhooks", headers=creds.key("alice"), json={"url": receiver.url}).json()
    result = api.post(f"/v1/webhooks/{created['id']}/test", headers=creds.key("alice"),
                      json={"event_type": "batch.expired"})
    assert result.status_code == 200, result.text
    answer = result.json()
    assert answer["delivered"] is True and answer["status_code"] == 200 and answer["error"] is None
    headers, body = receiver.requests[-1]
    event = unwrap(headers, body, created["secret"])
    assert (event.type, event.data.id) == ("batch.expired", "batch_test")
    assert headers["webhook-id"] == answer["webhook_id"]
    attempts = api.get(f"/v1/webhooks/{created['id']}/attempts", headers=creds.key("alice")).json()["data"]
    assert [(a["webhook_id"], a["status_code"], a["job_id"]) for a in attempts] == [(answer["webhook_id"], 200, None)]
    assert api.post(f"/v1/webhooks/{created['id']}/test", headers=creds.key("bob")).status_code == 404


def test_every_dialects_job_end_arrives_once_retried_after_a_500(api, creds, api_store, hook_settings):
    receiver = Receiver([(500, 0.0), (200, 0.0)])
    try:
        created = api.post("/v1/webhooks", headers=creds.key("alice"), json={"url": receiver.url}).json()
        ends = {"openai": JobStatus.SUCCEEDED, "mistral": JobStatus.FAILED, "scale": JobStatus.TIMEOUT_EXCEEDED}
        jobs = {}
        for dialect, status in ends.items():
            job = api_store.create_job(dialect=dialect, endpoint=CHAT, model="tiny", owner="alice")
            api_store.end_job(job.id, status, "test")
            jobs[job.id] = status
        cancelled = api_store.create_job(dialect="openai", endpoint=CHAT, model="tiny", owner="alice")
        api_store.request_cancel(cancelled.id)
        api_store.transition(cancelled.id, JobStatus.CANCELLED)
        jobs[cancelled.id] = JobStatus.CANCELLED

        def delivered() -> bool:
            rows = [d for d in api_store.list_webhook_deliveries(endpoint_id=created["id"])]
            return len(rows) == 4 and all(d.status == "delivered" for d in rows)

        _deliver_all(api_store, hook_settings, delivered)
        events = {}
        for headers, body in receiver.requests:
            event = unwrap(headers, body, created["secret"])
            events.setdefault(event.data.id, set()).add((event.type, headers["webhook-id"], event.id))
        expected = {"SUCCEEDED": "batch.completed", "FAILED": "batch.failed", "TIMEOUT_EXCEEDED": "batch.expired",
                    "CANCELLED": "batch.cancelled"}
        assert set(events) == set(jobs)
        for job_id, seen in events.items():
            assert len(seen) == 1, seen  # repeats of one event carry the same webhook-id and event id
            assert next(iter(seen))[0] == expected[jobs[job_id].value]
        attempts = api.get(f"/v1/webhooks/{created['id']}/attempts", headers=creds.key("alice")).json()["data"]
        assert len(attempts) == len(receiver.requests) == 5  # the first one answered 500
        failed = [a for a in attempts if a["status_code"] == 500]
        assert len(failed) == 1 and failed[0]["error"] == "HTTP 500" and failed[0]["delivery_status"] == "delivered"
        retried = [a for a in attempts if a["webhook_id"] == failed[0]["webhook_id"]]
        assert sorted((a["attempt"], a["status_code"]) for a in retried) == [(1, 500), (2, 200)]
        one_job = api.get(f"/v1/webhooks/{created['id']}/attempts", headers=creds.key("alice"),
                          params={"job_id": cancelled.id}).json()["data"]
        assert {a["job_id"] for a in one_job} == {cancelled.id}
        assert api.get(f"/v1/webhooks/{created['id']}/attempts", headers=creds.key("bob")).status_code == 404
    finally:
        receiver.close()


@pytest.fixture(scope="module")
def hook_server(hook_app) -> Iterator[str]:
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(hook_app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the test API server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}/batch"
    server.should_exit = True
    thread.join(timeout=10)


def test_cli_add_list_test_remove(hook_server, creds, receiver, monkeypatch, capsys, api_store):
    from llm_batch.cli import main

    monkeypatch.setenv("LLM_BATCH_API_URL", hook_server)
    monkeypatch.setenv("LLM_BATCH_API_KEY", creds.keys["alice"])
    try:
        assert main(["webhook", "add", receiver.url, "--events", "batch.completed,batch.cancelled"]) == 0
        out, err = capsys.readouterr()
        secret = out.strip().splitlines()[-1]
        assert secret.startswith("whsec_") and out == secret + "\n"  # the secret alone on its line
        endpoint_id = next(line.split(": ", 1)[1] for line in err.splitlines() if line.startswith("id: "))
        assert main(["webhook", "list"]) == 0
        listing = capsys.readouterr().out
        assert endpoint_id in listing and "batch.completed,batch.cancelled" in listing
        assert main(["webhook", "test", endpoint_id]) == 0
        assert "delivered, HTTP 200" in capsys.readouterr().out
        headers, body = receiver.requests[-1]
        assert unwrap(headers, body, secret).type == "batch.completed"
        assert main(["webhook", "attempts", endpoint_id]) == 0
        assert headers["webhook-id"] in capsys.readouterr().out
        assert main(["webhook", "add", "http://169.254.169.254/x"]) == 2
        assert "169.254.169.254" in capsys.readouterr().err
        assert main(["webhook", "remove", endpoint_id]) == 0
        assert main(["webhook", "remove", endpoint_id]) == 2
    finally:
        for endpoint in api_store.list_webhook_endpoints(owner="alice"):
            if endpoint.url == receiver.url:
                api_store.delete_webhook_endpoint(endpoint.id)
