"""Webhooks: how they are signed (Standard Webhooks, as ``openai.OpenAI().webhooks.unwrap``
verifies), and the ``Deliverer`` that sends them, at least once, from the job store's outbox
(docs/api.md, "Webhooks"). Any number of deliverers may run."""
from __future__ import annotations

import logging
import os
import random
import socket
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import partial
from urllib.parse import urlsplit, urlunsplit

import anyio
import httpx
import orjson
from anyio import to_thread

from llm_batch.core.config import Settings
from llm_batch.infra.jobstore.webhooks import ClaimedDelivery, WebhookRepository
from llm_batch.infra.webhook_destinations import DestinationRefused, Resolver, check_destination, system_resolver

log = logging.getLogger(__name__)

USER_AGENT = "llm-batch-webhooks/0.1"
RETRY_MAX_DELAY_S = 3600.0  # the backoff doubles up to it


def sign(secrets: Sequence[str], webhook_id: str, body: bytes, when: datetime | None = None) -> dict[str, str]:
    """The Standard Webhooks headers of one attempt: one signature per secret, space separated."""
    from standardwebhooks import Webhook  # optional

    when = when or datetime.now(UTC)
    signature = " ".join(Webhook(secret).sign(webhook_id, when, body.decode()) for secret in secrets)
    return {"webhook-id": webhook_id, "webhook-timestamp": str(int(when.timestamp())), "webhook-signature": signature}


@dataclass(frozen=True)
class AttemptResult:
    status_code: int | None
    latency_ms: float
    error: str | None

    @property
    def delivered(self) -> bool:
        return self.status_code is not None and 200 <= self.status_code < 300


def _pinned(url: str, address: str) -> tuple[str, str, dict]:
    """The URL on the checked `address`, the Host header and the TLS server name: the
    connection goes where the check looked (no second DNS answer)."""
    parts = urlsplit(url)
    host_text = f"[{address}]" if ":" in address else address
    netloc = host_text + (f":{parts.port}" if parts.port else "")
    target = urlunsplit((parts.scheme, netloc, parts.path or "/", parts.query, ""))
    host_header = parts.netloc.rpartition("@")[2]
    extensions = {"sni_hostname": parts.hostname} if parts.scheme == "https" else {}
    return target, host_header, extensions


async def send_once(client: httpx.AsyncClient, settings: Settings, url: str, secrets: Sequence[str], webhook_id: str,
                    payload: dict, resolve: Resolver | None = system_resolver) -> AttemptResult:
    """One signed POST of `payload` to `url`, after checking where it resolves now, all
    within ``webhook_timeout_s`` (the answer's body is never read)."""
    started = time.monotonic()
    deadline = settings.webhook_timeout_s

    def result(status: int | None, error: str | None) -> AttemptResult:
        return AttemptResult(status, (time.monotonic() - started) * 1000, error)

    try:
        with anyio.fail_after(deadline):
            # getaddrinfo blocks: a thread, left behind if the deadline passes first.
            check = partial(check_destination, url, settings, resolve)
            addresses = await to_thread.run_sync(check, abandon_on_cancel=True)
            body = orjson.dumps(payload)
            headers = {**sign(secrets, webhook_id, body), "content-type": "application/json", "user-agent": USER_AGENT}
            if addresses:
                target, headers["host"], extensions = _pinned(url, addresses[0])
            else:
                target, extensions = url, {}
            async with client.stream("POST", target, content=body, headers=headers, extensions=extensions) as response:
                status = response.status_code
    except DestinationRefused as exc:
        return result(None, f"refused: {exc}")
    except TimeoutError:
        return result(None, f"Timeout: no answer within {deadline:g} s")
    except httpx.HTTPError as exc:
        return result(None, f"{type(exc).__name__}: {exc}"[:500])
    return result(status, None if 200 <= status < 300 else f"HTTP {status}")


def new_client(settings: Settings) -> httpx.AsyncClient:
    """No redirects (a redirect could point anywhere), no proxies from the environment."""
    return httpx.AsyncClient(timeout=httpx.Timeout(settings.webhook_timeout_s), follow_redirects=False,
                             trust_env=False)


class Deliverer:
    """The store's calls block, so they run in threads; the sending does not."""

    def __init__(self, store: WebhookRepository, settings: Settings, name: str | None = None,
                 resolve: Resolver | None = system_resolver, batch: int = 16, concurrency: int = 4):
        self.store = store
        self.settings = settings
        self.name = name or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self.resolve = resolve
        self.batch = batch
        self.concurrency = concurrency

    @property
    def lease(self) -> timedelta:
        # Longer than any attempt: a live deliverer never loses its row mid-attempt.
        return timedelta(seconds=max(self.settings.webhook_lease_s, self.settings.webhook_timeout_s + 10))

    def backoff(self, attempts_made: int) -> timedelta:
        base = self.settings.webhook_retry_base_s * 2 ** max(0, attempts_made - 1)
        delay = min(base, RETRY_MAX_DELAY_S)
        return timedelta(seconds=delay * random.uniform(0.9, 1.1))

    async def deliver(self, client: httpx.AsyncClient, claim: ClaimedDelivery):
        """One attempt, recorded; the delivery as it is now."""
        started_at = datetime.now(UTC)
        result = await send_once(client, self.settings, claim.url, claim.secrets, claim.delivery.id,
                                 claim.delivery.payload, self.resolve)
        record = partial(
            self.store.record_webhook_attempt, claim, started_at=started_at, status_code=result.status_code,
            latency_ms=result.latency_ms, error=result.error, delivered=result.delivered,
            retry_in=self.backoff(claim.delivery.attempts + 1), deliverer=self.name,
            retry_window=timedelta(seconds=self.settings.webhook_retry_window_s),
        )
        return await to_thread.run_sync(record)

    async def deliver_now(self, client: httpx.AsyncClient, delivery_id: str):
        """Claim and attempt this one delivery at once (the API's test); None if not due."""
        claims = await self._claim(limit=1, delivery_id=delivery_id)
        return await self.deliver(client, claims[0]) if claims else None

    async def round(self, client: httpx.AsyncClient) -> int:
        """Claim a batch of due rows and attempt them; how many were tried."""
        claims = await self._claim(limit=self.batch)
        limiter = anyio.CapacityLimiter(self.concurrency)

        async def one(claim: ClaimedDelivery) -> None:
            async with limiter:
                await self.deliver(client, claim)

        async with anyio.create_task_group() as group:
            for claim in claims:
                group.start_soon(one, claim)
        return len(claims)

    async def _claim(self, **which) -> list[ClaimedDelivery]:
        return await to_thread.run_sync(partial(self.store.claim_webhook_deliveries, self.name, self.lease, **which))

    def run_once(self) -> int:
        """One round on an event loop of its own (scripts and tests)."""

        async def once() -> int:
            async with new_client(self.settings) as client:
                return await self.round(client)

        return anyio.run(once)

    def run(self, stop: threading.Event | None = None) -> None:
        """Deliver until `stop` is set; a failing store is logged and retried."""
        anyio.run(self._serve, stop or threading.Event())

    async def _serve(self, stop: threading.Event) -> None:
        async with new_client(self.settings) as client:
            while not stop.is_set():
                try:
                    tried = await self.round(client)
                except Exception:  # noqa: BLE001 - keep delivering whatever one round hit
                    log.exception("webhook delivery round failed")
                    tried = 0
                if not tried:
                    await to_thread.run_sync(stop.wait, self.settings.webhook_poll_interval_s)


_started: dict[int, threading.Thread] = {}
_start_lock = threading.Lock()


def start_in_background(store: WebhookRepository, settings: Settings) -> threading.Thread | None:
    """The deliverer as a daemon thread, once per process (None when ``webhook_deliverer`` is off)."""
    if not settings.webhook_deliverer:
        return None
    with _start_lock:
        thread = _started.get(os.getpid())
        if thread is None or not thread.is_alive():
            thread = threading.Thread(target=Deliverer(store, settings).run, name="llm-batch-webhooks", daemon=True)
            thread.start()
            _started[os.getpid()] = thread
        return thread
