"""Webhooks without Airflow: the outbox written with the job's end, the deliverer against a
real local receiver (signatures checked by the openai SDK's ``webhooks.unwrap``), retries,
refused destinations, and a deliverer killed with SIGKILL mid-retry losing nothing."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from sqlalchemy import text

from llm_batch.core.config import Settings
from llm_batch.core.jobs import JobStatus
from llm_batch.infra.jobstore import JobStore
from llm_batch.infra.jobstore.webhooks import JOB_END_EVENTS
from llm_batch.infra.webhook_destinations import DestinationRefused, check_destination
from llm_batch.infra.webhooks import Deliverer
from tests.fixtures.jobstore import store_url_of

CHAT = "/v1/chat/completions"
REPO = Path(__file__).resolve().parents[2]


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # many deliveries connect at once (the API's concurrency test)


class Receiver:
    """A tiny HTTP server in a thread: records each request; answers from `script`
    (a list of (status, delay_s), the last one repeated)."""

    def __init__(self, script: list[tuple[int, float]] | None = None):
        self.script = list(script or [(200, 0.0)])
        self.requests: list[tuple[dict[str, str], bytes]] = []
        self.got_one = threading.Event()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                receiver.requests.append(({k.lower(): v for k, v in self.headers.items()}, body))
                status, delay = receiver.script[min(len(receiver.requests), len(receiver.script)) - 1]
                receiver.got_one.set()
                time.sleep(delay)
                self.send_response(status)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = _Server(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/hooks"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def store(request: pytest.FixtureRequest) -> Iterator[JobStore]:
    s = JobStore(store_url_of(request, request.param))
    yield s
    s.close()


def destinations(**values) -> Settings:
    """Settings whose allowed webhook destinations are the defaults but for ``values``: these
    tests say which are allowed, and the e2e stack's session-wide allow-list
    (tests/e2e/conftest.py) must not reach them."""
    return Settings(**{"webhook_allowed_hosts": [], "webhook_allow_public": True, **values})


def settings(tmp_path: Path, **extra) -> Settings:
    values = dict(home=tmp_path, webhook_allowed_hosts=["127.0.0.1"], webhook_retry_base_s=0.05,
                  webhook_timeout_s=2.0, webhook_poll_interval_s=0.05)
    return destinations(**{**values, **extra})


def make_job(store: JobStore, owner: str = "alice", dialect: str = "openai"):
    return store.create_job(dialect=dialect, endpoint=CHAT, model="tiny", owner=owner)


def unwrap(headers: dict[str, str], body: bytes, secret: str):
    import openai

    return openai.OpenAI(api_key="unused").webhooks.unwrap(body, headers, secret=secret)


def deliver_until(deliverer: Deliverer, done, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "not delivered in time"
        if not deliverer.run_once():
            time.sleep(0.05)


# -- the outbox --------------------------------------------------------------------------


@pytest.mark.parametrize("status", list(JOB_END_EVENTS))
def test_every_terminal_status_writes_exactly_one_event_per_subscribed_endpoint(store, status):
    wants_all, _ = store.create_webhook_endpoint("alice", "http://127.0.0.1:9/a")
    wants_completed, _ = store.create_webhook_endpoint("alice", "http://127.0.0.1:9/b", events=["batch.completed"])
    store.create_webhook_endpoint("bob", "http://127.0.0.1:9/c")  # another owner's
    for dialect in ("openai", "mistral", "scale"):
        job = make_job(store, dialect=dialect)
        store.transition(job.id, JobStatus.VALIDATING)
        ended = store.end_job(job.id, status, "ended")
        store.end_job(job.id, JobStatus.FAILED, "again")  # an ended job stays as it ended: no second event
        store.transition(job.id, status)  # a repeated status is a no-op: no second event
        rows = store.list_webhook_deliveries(job_id=job.id)
        expected = {wants_all.id} | ({wants_completed.id} if status == JobStatus.SUCCEEDED else set())
        assert sorted(r.endpoint_id for r in rows) == sorted(expected)
        for row in rows:
            assert row.payload == {"id": row.event_id, "object": "event", "created_at": int(ended.completed_at.timestamp()),
                                   "type": JOB_END_EVENTS[status], "data": {"id": job.id}}
        assert len({r.event_id for r in rows}) == 1  # one logical event, one row per endpoint


def test_the_event_is_written_in_the_transaction_that_ends_the_job(store):
    """If the outbox row cannot be written, the job does not end either (and vice versa)."""
    store.create_webhook_endpoint("alice", "http://127.0.0.1:9/a")
    job = make_job(store)
    with store.engine.begin() as connection:
        connection.execute(text("ALTER TABLE webhook_deliveries RENAME TO webhook_deliveries_away"))
    with pytest.raises(Exception):
        store.end_job(job.id, JobStatus.SUCCEEDED)
    assert store.get_job(job.id).status == JobStatus.QUEUED
    with store.engine.begin() as connection:
        connection.execute(text("ALTER TABLE webhook_deliveries_away RENAME TO webhook_deliveries"))
    store.end_job(job.id, JobStatus.SUCCEEDED)
    assert len(store.list_webhook_deliveries(job_id=job.id)) == 1


def test_cancel_path_and_racing_enders_still_yield_one_event(store):
    from concurrent.futures import ThreadPoolExecutor

    store.create_webhook_endpoint("alice", "http://127.0.0.1:9/a")
    job = make_job(store)
    store.request_cancel(job.id)
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda s: store.end_job(job.id, s), [JobStatus.CANCELLED, JobStatus.FAILED] * 8))
    rows = store.list_webhook_deliveries(job_id=job.id)
    assert len(rows) == 1 and rows[0].event_type == JOB_END_EVENTS[store.get_job(job.id).status]


def test_two_deliverers_never_hold_one_row(store):
    store.create_webhook_endpoint("alice", "http://127.0.0.1:9/a")
    for _ in range(5):
        store.end_job(make_job(store).id, JobStatus.SUCCEEDED)
    first = store.claim_webhook_deliveries("one", timedelta(seconds=30))
    second = store.claim_webhook_deliveries("two", timedelta(seconds=30))
    assert len(first) == 5 and second == []
    # An expired lease (a dead deliverer's) is taken over.
    later = first[0].delivery.created_at + timedelta(seconds=31)
    assert len(store.claim_webhook_deliveries("two", timedelta(seconds=30), now=later)) == 5


# -- delivery against a real receiver ------------------------------------------------------


def test_events_verify_with_the_openai_sdk(store, receiver, tmp_path):
    endpoint, secret = store.create_webhook_endpoint("alice", receiver.url)
    job = make_job(store)
    store.end_job(job.id, JobStatus.SUCCEEDED)
    deliverer = Deliverer(store, settings(tmp_path))
    deliver_until(deliverer, lambda: receiver.requests)
    headers, body = receiver.requests[0]
    event = unwrap(headers, body, secret)
    assert (event.type, event.data.id, event.object) == ("batch.completed", job.id, "event")
    assert event.id.startswith("evt_") and headers["webhook-id"].startswith("msg_")
    import openai

    with pytest.raises(openai.InvalidWebhookSignatureError):
        unwrap(headers, body.replace(job.id.encode(), b"job_forged"), secret)
    [delivery] = store.list_webhook_deliveries(job_id=job.id)
    assert delivery.status == "delivered"


def test_a_receiver_answering_500_then_200_is_retried_with_the_same_webhook_id(store, tmp_path):
    receiver = Receiver([(500, 0.0), (500, 0.0), (200, 0.0)])
    try:
        endpoint, secret = store.create_webhook_endpoint("alice", receiver.url)
        job = make_job(store)
        store.end_job(job.id, JobStatus.FAILED, "boom")
        deliverer = Deliverer(store, settings(tmp_path))
        deliver_until(deliverer, lambda: store.list_webhook_deliveries(job_id=job.id)[0].status == "delivered")
        assert len(receiver.requests) == 3
        assert len({h["webhook-id"] for h, _ in receiver.requests}) == 1  # one logical event
        assert len({b for _, b in receiver.requests}) == 1  # the very same body
        for headers, body in receiver.requests:
            assert unwrap(headers, body, secret).type == "batch.failed"
        attempts = store.list_webhook_attempts(endpoint.id)
        assert [(a.attempt, a.status_code) for a in reversed(attempts)] == [(1, 500), (2, 500), (3, 200)]
        assert attempts[-1].error == "HTTP 500" and attempts[0].error is None
        assert all(a.latency_ms >= 0 and a.delivery_status == "delivered" for a in attempts)
    finally:
        receiver.close()


def test_retries_stop_after_the_retry_window(store, tmp_path):
    receiver = Receiver([(503, 0.0)])
    try:
        endpoint, _ = store.create_webhook_endpoint("alice", receiver.url)
        job = make_job(store)
        store.end_job(job.id, JobStatus.SUCCEEDED)
        deliverer = Deliverer(store, settings(tmp_path, webhook_retry_window_s=1, webhook_retry_base_s=0.3))
        deliver_until(deliverer, lambda: store.list_webhook_deliveries(job_id=job.id)[0].status == "failed")
        assert 1 <= len(store.list_webhook_attempts(endpoint.id)) < 10
    finally:
        receiver.close()


def test_a_dead_receiver_never_delays_the_job_end(store, tmp_path):
    """The job's end only writes a row; sending happens later, with timeouts."""
    receiver = Receiver([(200, 5.0)])
    try:
        endpoint, _ = store.create_webhook_endpoint("alice", receiver.url)
        job = make_job(store)
        started = time.monotonic()
        store.end_job(job.id, JobStatus.SUCCEEDED)
        assert time.monotonic() - started < 1.0
        deliverer = Deliverer(store, settings(tmp_path, webhook_timeout_s=0.5))
        deliverer.run_once()
        [attempt] = store.list_webhook_attempts(endpoint.id)
        assert attempt.status_code is None and "Timeout" in attempt.error
    finally:
        receiver.close()


class DripReceiver:
    """Answers one byte of its status line at a time, each well within any per-read
    timeout: only a deadline on the whole attempt ends it."""

    def __init__(self, every_s: float = 0.2):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, args=(every_s,), daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.listener.getsockname()[1]}/hooks"

    def _serve(self, every_s: float) -> None:
        connection, _ = self.listener.accept()
        with connection:
            for byte in b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n" * 100:
                if self.stop.wait(every_s):
                    return
                connection.sendall(bytes([byte]))

    def close(self) -> None:
        self.stop.set()
        self.listener.close()


def test_one_deadline_bounds_the_whole_attempt(store, tmp_path):
    """A receiver that drips its answer never trips a per-read timeout: the attempt still
    ends at webhook_timeout_s."""
    receiver = DripReceiver()
    try:
        endpoint, _ = store.create_webhook_endpoint("alice", receiver.url)
        store.end_job(make_job(store).id, JobStatus.SUCCEEDED)
        started = time.monotonic()
        Deliverer(store, settings(tmp_path, webhook_timeout_s=1.0)).run_once()
        assert time.monotonic() - started < 3.0
        [attempt] = store.list_webhook_attempts(endpoint.id)
        assert attempt.status_code is None and attempt.error == "Timeout: no answer within 1 s"
        assert 900 <= attempt.latency_ms < 1500
    finally:
        receiver.close()


def test_a_rotation_that_keeps_the_old_secret_signs_with_both_until_it_expires(store, receiver, tmp_path):
    """Standard Webhooks allows several signatures: during the grace period a receiver
    holding either secret verifies every event; after it, or after a plain rotation, only
    the new secret does."""
    import openai

    endpoint, first = store.create_webhook_endpoint("alice", receiver.url)
    rotated, second = store.rotate_webhook_secret(endpoint.id, "alice", keep_previous_for=timedelta(hours=24))
    assert second != first and rotated.secret_hint == f"whsec_...{second[-4:]}"
    assert rotated.updated_at > endpoint.updated_at
    deliverer = Deliverer(store, settings(tmp_path))
    store.end_job(make_job(store).id, JobStatus.SUCCEEDED)
    deliver_until(deliverer, lambda: len(receiver.requests) == 1)
    headers, body = receiver.requests[0]
    assert len(headers["webhook-signature"].split()) == 2
    assert unwrap(headers, body, first).type == unwrap(headers, body, second).type == "batch.completed"

    [claim] = store.claim_webhook_deliveries("x", timedelta(seconds=5), delivery_id=store.enqueue_webhook_test(endpoint.id).id,
                                             now=datetime.now(UTC) + timedelta(hours=25))
    assert claim.secrets == (second,)  # the grace period is over

    _, third = store.rotate_webhook_secret(endpoint.id, "alice")
    store.end_job(make_job(store).id, JobStatus.FAILED)
    deliver_until(deliverer, lambda: len(receiver.requests) == 2)
    headers, body = receiver.requests[1]
    assert len(headers["webhook-signature"].split()) == 1 and unwrap(headers, body, third).type == "batch.failed"
    with pytest.raises(openai.InvalidWebhookSignatureError):
        unwrap(headers, body, second)
    with pytest.raises(LookupError):
        store.rotate_webhook_secret(endpoint.id, "bob")


def test_updates_move_updated_at_only_when_something_changes(store):
    endpoint, _ = store.create_webhook_endpoint("alice", "http://127.0.0.1:9/a", description="one")
    assert endpoint.updated_at == endpoint.created_at
    same = store.update_webhook_endpoint(endpoint.id, "alice", url=endpoint.url, events=list(endpoint.events),
                                         description="one")
    assert same == endpoint
    changed = store.update_webhook_endpoint(endpoint.id, "alice", events=["batch.failed", "batch.failed"])
    assert changed.events == ["batch.failed"] and changed.description == "one" and changed.updated_at > endpoint.updated_at
    with pytest.raises(ValueError):
        store.update_webhook_endpoint(endpoint.id, "alice", events=["response.completed"])
    with pytest.raises(LookupError):
        store.update_webhook_endpoint(endpoint.id, "bob", description="mine now")


def test_endpoint_pages_are_newest_first_and_follow_the_cursor(store):
    from llm_batch.infra.jobstore import InvalidCursor

    ids = [store.create_webhook_endpoint("alice", f"http://127.0.0.1:9/{i}")[0].id for i in range(5)]
    store.create_webhook_endpoint("bob", "http://127.0.0.1:9/b")
    first, more = store.page_webhook_endpoints("alice", limit=2)
    second, more_again = store.page_webhook_endpoints("alice", limit=2, after=first[-1].id)
    last, no_more = store.page_webhook_endpoints("alice", limit=2, after=second[-1].id)
    assert [e.id for e in first + second + last] == ids[::-1] and (more, more_again, no_more) == (True, True, False)
    assert len(store.page_webhook_endpoints(None, limit=100)[0]) == 6
    with pytest.raises(InvalidCursor):
        store.page_webhook_endpoints("alice", after="we_nothing")


# -- destinations ---------------------------------------------------------------------------


def resolver(table: dict[str, list[str]]):
    def resolve(host: str, port: int) -> list[str]:
        if host not in table:
            raise OSError("Name or service not known")
        return table[host]

    return resolve


@pytest.mark.parametrize("url", [
    "http://127.0.0.1/x", "http://localhost:8080/x", "http://169.254.169.254/latest/meta-data",
    "http://10.1.2.3/x", "http://192.168.0.1/x", "http://172.16.0.1/x", "http://[::1]/x",
    "http://[::ffff:127.0.0.1]/x", "http://0.0.0.0/x", "http://100.64.0.1/x", "http://[fe80::1]/x",
    "http://metadata.internal/x", "http://rebind.example.com/x", "ftp://hooks.example.com/x", "file:///etc/passwd",
    "http://user:pw@hooks.example.com/x",
])
def test_refused_destinations_name_the_url(url):
    resolve = resolver({"localhost": ["127.0.0.1"], "metadata.internal": ["169.254.169.254"],
                        "rebind.example.com": ["93.184.215.14", "10.0.0.7"], "hooks.example.com": ["93.184.215.14"]})
    with pytest.raises(DestinationRefused) as refused:
        check_destination(url, destinations(), resolve)
    assert url[:60] in str(refused.value)


def test_allowed_destinations(tmp_path):
    resolve = resolver({"hooks.example.com": ["93.184.215.14"], "hooks.internal": ["10.9.9.9"]})
    default = destinations()
    assert check_destination("https://hooks.example.com/x", default, resolve) == ["93.184.215.14"]
    allowing = destinations(webhook_allowed_hosts=["127.0.0.1", "hooks.internal", "10.20.0.0/16"])
    assert check_destination("http://127.0.0.1:9000/x", allowing, resolve) == ["127.0.0.1"]
    assert check_destination("http://hooks.internal/x", allowing, resolve) == ["10.9.9.9"]
    assert check_destination("http://10.20.3.4/x", allowing, resolve) == ["10.20.3.4"]
    with pytest.raises(DestinationRefused):
        check_destination("http://10.21.3.4/x", allowing, resolve)
    only_listed = destinations(webhook_allowed_hosts=["hooks.internal"], webhook_allow_public=False)
    with pytest.raises(DestinationRefused, match="not in LLM_BATCH_WEBHOOK_ALLOWED_HOSTS"):
        check_destination("https://hooks.example.com/x", only_listed, resolve)
    # Create time: a name that does not resolve now passes (each delivery checks again).
    assert check_destination("https://nowhere.example.com/x", default, resolve, unresolved_ok=True) == []
    with pytest.raises(DestinationRefused, match="does not resolve"):
        check_destination("https://nowhere.example.com/x", default, resolve)


def test_a_name_that_resolves_to_a_refused_address_at_delivery_is_not_called(store, receiver, tmp_path):
    """Checked again after DNS resolution at each attempt: nothing reaches the receiver."""
    port = receiver.server.server_address[1]
    endpoint, _ = store.create_webhook_endpoint("alice", f"http://sneaky.example.com:{port}/hooks")
    store.end_job(make_job(store).id, JobStatus.SUCCEEDED)
    deliverer = Deliverer(store, destinations(home=tmp_path), resolve=resolver({"sneaky.example.com": ["127.0.0.1"]}))
    deliverer.run_once()
    [attempt] = store.list_webhook_attempts(endpoint.id)
    assert attempt.status_code is None and "refused" in attempt.error and "127.0.0.1" in attempt.error
    assert receiver.requests == []


def test_the_connection_goes_to_the_checked_address(store, receiver, tmp_path):
    """An allowed name is sent to the address it resolved to, with its own Host header."""
    port = receiver.server.server_address[1]
    endpoint, secret = store.create_webhook_endpoint("alice", f"http://hooks.test:{port}/hooks")
    store.end_job(make_job(store).id, JobStatus.SUCCEEDED)
    deliverer = Deliverer(store, settings(tmp_path, webhook_allowed_hosts=["hooks.test"]),
                          resolve=resolver({"hooks.test": ["127.0.0.1"]}))
    deliver_until(deliverer, lambda: receiver.requests)
    headers, body = receiver.requests[0]
    assert headers["host"] == f"hooks.test:{port}"
    assert unwrap(headers, body, secret).type == "batch.completed"


# -- kill -9 of the deliverer ---------------------------------------------------------------


def _deliverer_process(tmp_path: Path, url: str) -> subprocess.Popen:
    env = {**os.environ, "LLM_BATCH_HOME": str(tmp_path), "LLM_BATCH_DATABASE_URL": url,
           "LLM_BATCH_WEBHOOK_ALLOWED_HOSTS": "127.0.0.1", "LLM_BATCH_WEBHOOK_TIMEOUT_S": "1",
           "LLM_BATCH_WEBHOOK_LEASE_S": "1", "LLM_BATCH_WEBHOOK_RETRY_BASE_S": "0.1",
           "LLM_BATCH_WEBHOOK_POLL_INTERVAL_S": "0.1"}
    return subprocess.Popen([sys.executable, "-m", "llm_batch.cli.main", "webhook", "deliver"], env=env, cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def test_kill_9_of_the_deliverer_mid_retry_loses_nothing(store, tmp_path):
    # 1st attempt: 500; 2nd: hangs (the deliverer is killed while it waits); then 200.
    receiver = Receiver([(500, 0.0), (200, 30.0), (200, 0.0)])
    first = second = None
    try:
        endpoint, secret = store.create_webhook_endpoint("alice", receiver.url)
        job = make_job(store)
        store.end_job(job.id, JobStatus.CANCELLED)
        first = _deliverer_process(tmp_path, store.url)
        deadline = time.monotonic() + 30
        while len(receiver.requests) < 2:
            assert time.monotonic() < deadline and first.poll() is None, first.stderr.read() if first.poll() else ""
            time.sleep(0.02)
        first.send_signal(signal.SIGKILL)  # mid-retry: its second attempt in flight
        first.wait(10)
        [delivery] = store.list_webhook_deliveries(job_id=job.id)
        assert delivery.status == "pending" and delivery.lease_owner is not None  # the dead one's lease
        second = _deliverer_process(tmp_path, store.url)
        deadline = time.monotonic() + 30
        while store.list_webhook_deliveries(job_id=job.id)[0].status != "delivered":
            assert time.monotonic() < deadline and second.poll() is None
            time.sleep(0.05)
        assert len(receiver.requests) == 3
        assert len({h["webhook-id"] for h, _ in receiver.requests}) == 1
        headers, body = receiver.requests[-1]
        event = unwrap(headers, body, secret)
        assert (event.type, event.data.id) == ("batch.cancelled", job.id)
        attempts = store.list_webhook_attempts(endpoint.id)
        assert [a.status_code for a in reversed(attempts)] == [500, 200]  # the killed attempt left no record
        assert json.loads(body)["id"] == delivery.event_id
    finally:
        for process in (first, second):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait(10)
        receiver.close()
