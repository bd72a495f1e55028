"""Webhooks through the API and the CLI: endpoints per owner (create shows the secret once,
list, get, delete, test, attempts), refused destinations, and the events of every dialect's
jobs arriving signed at a real local receiver (verified with the openai SDK's
``webhooks.unwrap``), retried after a 500, with the attempts listed.

The app under test is create_app() with settings that allow 127.0.0.1 (the receiver); the
session app keeps the defaults, which refuse it."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import pytest

from llm_batch.core.jobs import JobStatus
from llm_batch.infra.webhooks import Deliverer
from tests.api.conftest import app_on, mounted
from tests.unit.test_webhook_outbox import Receiver, deliver_until, unwrap

pytestmark = pytest.mark.airflow

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def hook_settings():
    from llm_batch.core.config import get_settings

    return get_settings().model_copy(update=dict(
        webhook_allowed_hosts=["127.0.0.1"], webhook_retry_base_s=0.05, webhook_timeout_s=2.0,
        webhook_poll_interval_s=0.05, webhook_test_per_minute=1000,
    ))


def mounted_with(settings, store, auth_manager):
    """create_app(settings) mounted at /batch, as airflow api-server serves it."""
    return mounted(app_on(store, auth_manager, settings), auth_manager)


@contextlib.contextmanager
def client_of(app) -> Iterator:
    from fastapi.testclient import TestClient

    with TestClient(app, base_url="http://testserver/batch", raise_server_exceptions=False) as client:
        yield client


@pytest.fixture(scope="module")
def hook_app(auth_manager, api_store, hook_settings, airflow_dags_in_db):
    return mounted_with(hook_settings, api_store, auth_manager)


@pytest.fixture(autouse=True)
def no_endpoints(api_store) -> Iterator[None]:
    """Each test starts and ends with no endpoint of anyone's: the listings it checks are its
    own, whatever the API tests before it left (theirs are not this module's to keep)."""
    def clear() -> None:
        for endpoint in api_store.list_webhook_endpoints():
            api_store.delete_webhook_endpoint(endpoint.id)

    clear()
    yield
    clear()


@pytest.fixture()
def api(hook_app) -> Iterator:
    with client_of(hook_app) as client:
        yield client


@pytest.fixture()
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


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

        deliver_until(Deliverer(api_store, hook_settings), delivered, timeout=60)
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


@contextlib.contextmanager
def serving(app) -> Iterator[str]:
    """`app` on a real HTTP port of 127.0.0.1 (uvicorn in a thread): its /batch base URL."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the test API server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}/batch"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def hook_server(hook_app) -> Iterator[str]:
    with serving(hook_app) as base:
        yield base


def test_cli_add_list_test_remove(hook_server, creds, receiver, cli, capsys, api_store):
    main = cli(hook_server, creds.keys["alice"])
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


# The threads the API runs its blocking calls on (anyio's default limiter).
API_THREADS = 40


def test_concurrent_tests_against_a_slow_receiver_leave_other_owners_fast(
    auth_manager, api_store, hook_settings, airflow_dags_in_db, creds
):
    """80 tests at once against a receiver that never answers in time: the excess ones are
    429 with Retry-After at once, the admitted ones end at the delivery deadline, and while
    they wait on the receiver bob's reads stay fast. More are admitted than the API has
    threads (anyio's 40): were a waiting test to hold one, bob's read would wait for it."""
    import asyncio

    import httpx

    bound, deadline = 48, 6.0
    settings = hook_settings.model_copy(update=dict(
        webhook_timeout_s=deadline, webhook_test_concurrency=bound, webhook_test_concurrency_total=bound))
    slow = Receiver([(200, 30.0)])
    endpoint_id = api_store.create_webhook_endpoint("alice", slow.url)[0].id

    async def flood(base: str) -> tuple[list[httpx.Response], list[float], int]:
        async with httpx.AsyncClient(base_url=base, timeout=60) as client:
            tests = [asyncio.create_task(client.post(f"/v1/webhooks/{endpoint_id}/test", headers=creds.key("alice")))
                     for _ in range(80)]
            give_up = time.monotonic() + deadline
            while len(slow.requests) < bound and time.monotonic() < give_up:
                await asyncio.sleep(0.02)  # until every admitted test waits on the receiver
            reads = []
            for _ in range(10):
                started = time.monotonic()
                assert (await client.get("/v1/jobs", headers=creds.key("bob"))).status_code == 200
                reads.append(time.monotonic() - started)
            waiting = sum(not t.done() for t in tests)
            return await asyncio.gather(*tests), reads, waiting

    try:
        with serving(mounted_with(settings, api_store, auth_manager)) as base:
            answers, reads, waiting = asyncio.run(flood(base))
    finally:
        api_store.delete_webhook_endpoint(endpoint_id)
        slow.close()
    print(f"\nbob's GET /v1/jobs while {waiting} tests wait on a slow receiver: max {max(reads):.3f} s, "
          f"median {sorted(reads)[5]:.3f} s")
    # More tests than the API has threads still waited after bob's reads: had each held a
    # thread, a read would have waited for one to free at the delivery deadline. (On a slow
    # machine the first admitted may reach its deadline during the reads: hence > API_THREADS, not
    # == bound.) The time bound is only a backstop with room for a loaded machine.
    assert waiting > API_THREADS and max(reads) < deadline / 2, (waiting, reads)
    statuses = [a.status_code for a in answers]
    assert statuses.count(200) == bound and statuses.count(429) == 80 - bound, statuses
    for answer in answers:
        if answer.status_code == 429:
            assert int(answer.headers["retry-after"]) >= 1 and answer.json()["code"] == "rate_limit_exceeded"
        else:
            result = answer.json()
            assert result["delivered"] is False and result["status_code"] is None and "Timeout" in result["error"]
            assert deadline * 1000 * 0.9 <= result["latency_ms"] < (deadline + 0.5) * 1000


def test_tests_are_throttled_per_owner_with_retry_after(auth_manager, api_store, hook_settings, airflow_dags_in_db,
                                                       creds, receiver):
    settings = hook_settings.model_copy(update=dict(webhook_test_per_minute=2))
    mine = api_store.create_webhook_endpoint("alice", receiver.url)[0].id
    theirs = api_store.create_webhook_endpoint("bob", receiver.url)[0].id
    try:
        with client_of(mounted_with(settings, api_store, auth_manager)) as api:
            ours = [api.post(f"/v1/webhooks/{mine}/test", headers=creds.key("alice")) for _ in range(2)]
            assert [r.status_code for r in ours] == [200, 200]
            refused = api.post(f"/v1/webhook_endpoints/{mine}/test", headers=creds.key("alice"),
                               json={"event_type": "batch.failed"})
            assert refused.status_code == 429 and 1 <= int(refused.headers["retry-after"]) <= 60
            assert refused.json()["error"]["code"] == "rate_limit_exceeded"  # OpenAI's shape on its route
            assert "at most 2 webhook tests a minute" in refused.json()["error"]["message"]
            assert api.post(f"/v1/webhooks/{theirs}/test", headers=creds.key("bob")).status_code == 200
        assert len(receiver.requests) == 3  # the refused test sent nothing
    finally:
        api_store.delete_webhook_endpoint(mine)
        api_store.delete_webhook_endpoint(theirs)


# -- OpenAI's webhook endpoints API: the same endpoints -------------------------------------------


def test_openai_endpoints_are_the_same_resource_as_ours(api, creds, receiver):
    created = api.post("/v1/webhook_endpoints", headers=creds.key("alice"),
                       json={"url": receiver.url, "name": "ci", "event_types": ["batch.completed"]})
    assert created.status_code == 200, created.text
    body = created.json()
    assert sorted(body) == ["created_at", "event_types", "id", "name", "object", "signing_secret",
                            "signing_secret_hint", "updated_at", "url"]
    assert body["signing_secret_hint"] == "whsec_..." + body["signing_secret"][-4:]
    assert body["updated_at"] == body["created_at"]
    ours = api.get(f"/v1/webhooks/{body['id']}", headers=creds.key("alice")).json()
    assert (ours["url"], ours["events"], ours["description"]) == (receiver.url, ["batch.completed"], "ci")
    theirs = api.get(f"/v1/webhook_endpoints/{body['id']}", headers=creds.key("alice")).json()
    assert "signing_secret" not in theirs and theirs["signing_secret_hint"] == body["signing_secret_hint"]
    made_by_us = api.post("/v1/webhooks", headers=creds.key("alice"), json={"url": receiver.url}).json()
    listed = api.get("/v1/webhook_endpoints", headers=creds.key("alice")).json()
    assert [e["id"] for e in listed["data"]] == [made_by_us["id"], body["id"]]  # newest first
    assert (listed["first_id"], listed["last_id"], listed["has_more"]) == (made_by_us["id"], body["id"], False)
    deleted = api.delete(f"/v1/webhooks/{made_by_us['id']}", headers=creds.key("alice")).json()
    assert deleted == {"id": made_by_us["id"], "object": "webhook_endpoint.deleted", "deleted": True}
    assert api.get(f"/v1/webhook_endpoints/{made_by_us['id']}", headers=creds.key("alice")).status_code == 404
    types = api.get("/v1/webhook_event_types", headers=creds.key("bob")).json()
    assert types == {"object": "list", "data": ["batch.completed", "batch.failed", "batch.expired", "batch.cancelled"]}


def test_openai_routes_answer_openai_errors(api, creds, receiver):
    def error(response, status):
        assert response.status_code == status, response.text
        return response.json()["error"]

    created = api.post("/v1/webhook_endpoints", headers=creds.key("alice"),
                       json={"url": receiver.url, "name": "ci", "event_types": ["batch.completed"]}).json()
    one = f"/v1/webhook_endpoints/{created['id']}"
    refused = error(api.post(one, headers=creds.key("alice"), json={"url": "http://[2002:a00:1::1]/hook"}), 400)
    assert (refused["type"], refused["param"], refused["code"]) == ("invalid_request_error", "url", "webhook_url_refused")
    assert "6to4" in refused["message"]
    assert error(api.get(one, headers=creds.key("bob")), 404)["type"] == "not_found_error"
    assert error(api.post(f"{one}/rotate_secret", headers=creds.key("bob")), 404)["code"] == "not_found"
    assert error(api.post(one, headers=creds.jwt("vic"), json={"name": "x"}), 403)["type"] == "permission_error"
    unsent = error(api.post("/v1/webhook_endpoints", headers=creds.key("alice"),
                            json={"url": receiver.url, "name": "x", "event_types": ["response.completed"]}), 422)
    assert unsent["param"] == "event_types[0]"
    assert error(api.get("/v1/webhook_endpoints", headers=creds.key("alice"), params={"after": "we_x"}), 400)["code"] \
        == "invalid_cursor"
    # A receiver that gives no HTTP answer: OpenAI's test result needs a status, so it is an error the SDK won't retry.
    receiver.close()
    gone = api.post(f"{one}/test", headers=creds.key("alice"), json={"event_type": "batch.completed"})
    assert error(gone, 502)["code"] == "webhook_no_answer" and gone.headers["x-should-retry"] == "false"
    # The per-owner endpoint limit is one count over both paths.
    for _ in range(19):
        api.post("/v1/webhooks", headers=creds.key("alice"), json={"url": receiver.url})
    over = api.post("/v1/webhook_endpoints", headers=creds.key("alice"),
                    json={"url": receiver.url, "name": "21st", "event_types": ["batch.failed"]})
    assert error(over, 429)["code"] == "limit_exceeded"


@pytest.mark.sdk
def test_the_newest_openai_client_manages_endpoints_unchanged(hook_server, creds, api_store, receiver):
    """create -> retrieve -> update -> list -> test -> rotate_secret -> delete with the newest
    openai release in its own venv, each answer validated by the client's own type; the test
    events verify with the secret in force, both secrets during a rotation's grace period."""
    import openai

    from tests.sdk.conftest import newest_flow

    other = Receiver()
    try:
        flow = newest_flow("openai", hook_server, creds.keys["alice"], "openai_webhooks_flow.py")
        seen = flow.run("lifecycle", url=receiver.url, other_url=other.url)
    finally:
        other.close()
    created, kept, rotated = seen["created"], seen["kept"], seen["rotated"]
    endpoint_fields = ["created_at", "event_types", "id", "name", "object", "signing_secret_hint", "updated_at", "url"]
    assert created["keys"] == sorted(endpoint_fields + ["signing_secret"]) == kept["keys"] == rotated["keys"]
    assert seen["retrieved"]["keys"] == seen["updated"]["keys"] == endpoint_fields
    assert created["event_types"] == ["batch.completed", "batch.failed"] and created["name"] == "ci"
    assert seen["retrieved"]["id"] == created["id"] and seen["retrieved"]["name"] == "ci"
    assert seen["updated"]["name"] == "ci-renamed" and seen["updated"]["updated_at"] >= created["updated_at"]
    assert seen["updated"]["event_types"] == ["batch.completed", "batch.failed", "batch.cancelled"]
    assert seen["first_page"] == {"ids": [seen["other"]], "has_more": True}
    assert seen["listed"] == [seen["other"], created["id"]]  # newest first, one page each, no repeats
    assert [(t["event_type"], t["status_code"], t["success"]) for t in seen["tests"]] == [
        ("batch.completed", 200, True), ("batch.failed", 200, True), ("batch.cancelled", 200, True)]
    assert all(t["webhook_endpoint_id"] == created["id"] and t["object"] == "webhook_endpoint.test" for t in seen["tests"])
    assert len({created["signing_secret"], kept["signing_secret"], rotated["signing_secret"]}) == 3
    assert seen["after_rotation"]["signing_secret_hint"] == "whsec_..." + rotated["signing_secret"][-4:]
    assert seen["event_types"]["data"] == ["batch.completed", "batch.failed", "batch.expired", "batch.cancelled"]
    assert seen["deleted"] == {"keys": ["deleted", "id", "object"], "id": created["id"], "deleted": True,
                               "object": "webhook_endpoint.deleted"}
    refused = seen["refused"]
    assert (refused["deleted"]["type"], refused["deleted"]["status"]) == ("NotFoundError", 404)
    assert (refused["private_url"]["type"], refused["private_url"]["status"]) == ("BadRequestError", 400)
    assert refused["unsent_event_type"]["status"] == 422

    (first, first_body), (during, during_body), (after, after_body) = receiver.requests
    assert unwrap(first, first_body, created["signing_secret"]).type == "batch.completed"
    assert len(during["webhook-signature"].split()) == 2  # the grace period: old and new secret
    for secret in (created["signing_secret"], kept["signing_secret"]):
        assert unwrap(during, during_body, secret).type == "batch.failed"
    assert unwrap(after, after_body, rotated["signing_secret"]).type == "batch.cancelled"
    with pytest.raises(openai.InvalidWebhookSignatureError):
        unwrap(after, after_body, kept["signing_secret"])  # a rotation without grace: the old one stops at once
    assert api_store.get_webhook_endpoint(created["id"]) is None
