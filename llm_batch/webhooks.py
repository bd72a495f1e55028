"""Webhooks: where they may go, how they are signed, and the deliverer that sends them.

Events are OpenAI's (``batch.completed``, ``batch.failed``, ``batch.expired``,
``batch.cancelled``; body ``{"id": "evt_...", "object": "event", "created_at", "type",
"data": {"id": <job id>}}``) for every dialect's jobs, signed with the Standard Webhooks scheme
(``webhook-id``, ``webhook-timestamp``, ``webhook-signature``; the ``standardwebhooks``
package), so ``openai.OpenAI().webhooks.unwrap(body, headers, secret=...)`` verifies them.

Delivery is at least once from the job store's outbox (llm_batch/jobstore/webhooks.py): a
``Deliverer`` claims due rows with a lease, sends each (timeouts on every phase, no
redirects, no proxies, to the address it checked), records the attempt, and retries with
exponential backoff until the event's retry window (24 h) has passed. Every attempt of one
event carries the same ``webhook-id`` and body; the timestamp and signature are fresh. The
deliverer runs as a daemon thread in the api-server (``start_in_background``) or as
``llm-batch webhook deliver``; any number may run at once.

Destinations (``check_destination``): http(s) only; loopback, link-local (the metadata
address 169.254.169.254 among them), private and every other non-global address are refused
unless ``LLM_BATCH_WEBHOOK_ALLOWED_HOSTS`` lists the host name, the address or its network;
checked when an endpoint is created and again before each attempt, on the addresses the name
resolves to then (a name that resolves to a refused address is refused).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import random
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from urllib.parse import urlsplit, urlunsplit

import httpx
import orjson

from llm_batch.config import Settings
from llm_batch.jobstore.webhooks import EVENT_TYPES, ClaimedDelivery

log = logging.getLogger(__name__)

__all__ = ["EVENT_TYPES", "Deliverer", "DestinationRefused", "check_destination", "sign", "start_in_background"]

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolver = Callable[[str, int], list[str]]
USER_AGENT = "llm-batch-webhooks/0.1"


class DestinationRefused(ValueError):
    """A webhook URL that may not be called; the message names the URL and why."""


# -- destinations ---------------------------------------------------------------------


@dataclass(frozen=True)
class Allowed:
    """The parsed ``webhook_allowed_hosts``: host names, and networks (an address is a /32 or /128)."""

    names: frozenset[str]
    networks: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]

    @classmethod
    def of(cls, entries: Iterable[str]) -> Allowed:
        names, networks = set(), []
        for entry in entries:
            text = entry.strip().strip("[]").lower()
            if not text:
                continue
            try:
                networks.append(ipaddress.ip_network(text, strict=False))
            except ValueError:
                names.add(text.rstrip("."))
        return cls(frozenset(names), tuple(networks))

    def address(self, ip: IPAddress) -> bool:
        return any(ip.version == n.version and ip in n for n in self.networks)


def _plain(ip: IPAddress) -> IPAddress:
    """An IPv4-mapped IPv6 address (``::ffff:127.0.0.1``) as the IPv4 address it is."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def _kind(ip: IPAddress) -> str | None:
    """Why `ip` is refused by default (None: a public address)."""
    if ip == ipaddress.ip_address("169.254.169.254") or ip == ipaddress.ip_address("fd00:ec2::254"):
        return "the cloud metadata address"
    for name in ("loopback", "link_local", "private", "multicast", "unspecified", "reserved"):
        if getattr(ip, f"is_{name}"):
            return f"a {name.replace('_', '-')} address"
    return None if ip.is_global else "not a public address"


def system_resolver(host: str, port: int) -> list[str]:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(info[4][0] for info in infos))


def check_destination(
    url: str, settings: Settings, resolve: Resolver | None = system_resolver, *, unresolved_ok: bool = False
) -> list[str]:
    """The addresses `url` may be sent to (resolved now); DestinationRefused naming the URL
    otherwise. ``resolve=None`` checks only what the URL itself says (an address literal).
    ``unresolved_ok``: a name that does not resolve now passes (create time: each delivery
    checks again)."""
    shown = url if len(url) <= 200 else url[:200] + "..."
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise DestinationRefused(f"webhook URL {shown!r} is not a valid URL: {exc}") from None
    if parts.scheme not in ("http", "https"):
        raise DestinationRefused(f"webhook URL {shown!r}: only http:// and https:// URLs are allowed")
    if not parts.hostname:
        raise DestinationRefused(f"webhook URL {shown!r} names no host")
    if parts.username is not None or parts.password is not None:
        raise DestinationRefused(f"webhook URL {shown!r}: credentials in the URL are not allowed (the events are signed)")
    host = parts.hostname.rstrip(".").lower()
    allowed = Allowed.of(settings.webhook_allowed_hosts)
    try:
        literal: IPAddress | None = ipaddress.ip_address(host)
    except ValueError:
        literal = None
    if literal is not None:
        addresses = [host]
    elif host in allowed.names:
        # The admin allowed this name: whatever it resolves to.
        if resolve is None:
            return []
        try:
            return resolve(host, port or (443 if parts.scheme == "https" else 80))
        except OSError as exc:
            if unresolved_ok:
                return []
            raise DestinationRefused(f"webhook URL {shown!r}: host {host!r} does not resolve ({exc})") from None
    elif resolve is None:
        return []
    else:
        try:
            addresses = resolve(host, port or (443 if parts.scheme == "https" else 80))
        except OSError as exc:
            if unresolved_ok:
                return []
            raise DestinationRefused(f"webhook URL {shown!r}: host {host!r} does not resolve ({exc})") from None
        if not addresses:
            raise DestinationRefused(f"webhook URL {shown!r}: host {host!r} resolves to no address")
    for address in addresses:
        ip = _plain(ipaddress.ip_address(address.split("%", 1)[0]))
        if allowed.address(ip):
            continue
        reason = _kind(ip)
        if reason is not None:
            via = "" if literal is not None else f" ({host!r} resolves to {ip})"
            raise DestinationRefused(
                f"webhook URL {shown!r} is refused: {ip} is {reason}{via}; an admin may allow it in "
                "LLM_BATCH_WEBHOOK_ALLOWED_HOSTS"
            )
        if not settings.webhook_allow_public:
            raise DestinationRefused(
                f"webhook URL {shown!r} is refused: {host!r} is not in LLM_BATCH_WEBHOOK_ALLOWED_HOSTS "
                "(LLM_BATCH_WEBHOOK_ALLOW_PUBLIC is off)"
            )
    return addresses


# -- signing --------------------------------------------------------------------------


def body_of(payload: dict) -> bytes:
    """The exact bytes sent (and signed) for an event's payload."""
    return orjson.dumps(payload)


def sign(secret: str, webhook_id: str, body: bytes, when: datetime | None = None) -> dict[str, str]:
    """The Standard Webhooks headers of one attempt (``standardwebhooks`` computes the
    signature: HMAC-SHA256 over ``{id}.{timestamp}.{body}`` with the base64 secret)."""
    from standardwebhooks import Webhook

    when = when or datetime.now(UTC)
    signature = Webhook(secret).sign(webhook_id, when, body.decode())
    return {"webhook-id": webhook_id, "webhook-timestamp": str(int(when.timestamp())), "webhook-signature": signature}


# -- sending --------------------------------------------------------------------------


@dataclass(frozen=True)
class AttemptResult:
    status_code: int | None
    latency_ms: float
    error: str | None

    @property
    def delivered(self) -> bool:
        return self.status_code is not None and 200 <= self.status_code < 300


def _pinned(url: str, address: str) -> tuple[str, str, dict]:
    """The URL with its host replaced by the checked `address`, the Host header, and the
    TLS server name: the connection goes where the check looked (no second DNS answer)."""
    parts = urlsplit(url)
    host_text = f"[{address}]" if ":" in address else address
    netloc = host_text + (f":{parts.port}" if parts.port else "")
    target = urlunsplit((parts.scheme, netloc, parts.path or "/", parts.query, ""))
    host_header = parts.netloc.rpartition("@")[2]
    extensions = {"sni_hostname": parts.hostname} if parts.scheme == "https" else {}
    return target, host_header, extensions


def send_once(
    client: httpx.Client, settings: Settings, url: str, secret: str, webhook_id: str, payload: dict,
    resolve: Resolver | None = system_resolver,
) -> AttemptResult:
    """One signed POST of `payload` to `url`, after checking where it resolves now."""
    started = time.monotonic()

    def elapsed() -> float:
        return (time.monotonic() - started) * 1000

    try:
        addresses = check_destination(url, settings, resolve)
    except DestinationRefused as exc:
        return AttemptResult(None, elapsed(), f"refused: {exc}")
    body = body_of(payload)
    headers = {**sign(secret, webhook_id, body), "content-type": "application/json", "user-agent": USER_AGENT}
    if addresses:
        target, host_header, extensions = _pinned(url, addresses[0])
        headers["host"] = host_header
    else:
        target, extensions = url, {}
    try:
        with client.stream("POST", target, content=body, headers=headers, extensions=extensions) as response:
            status = response.status_code
        return AttemptResult(status, elapsed(), None if 200 <= status < 300 else f"HTTP {status}")
    except httpx.HTTPError as exc:
        return AttemptResult(None, elapsed(), f"{type(exc).__name__}: {exc}"[:500])


def new_client(settings: Settings) -> httpx.Client:
    """No redirects (a redirect could point anywhere), no proxies from the environment."""
    return httpx.Client(timeout=httpx.Timeout(settings.webhook_timeout_s), follow_redirects=False, trust_env=False)


class Deliverer:
    """Claims due outbox rows of `store` and sends them (see the module docstring)."""

    def __init__(self, store, settings: Settings, name: str | None = None, resolve: Resolver | None = system_resolver,
                 batch: int = 16, concurrency: int = 4):
        self.store = store
        self.settings = settings
        self.name = name or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self.resolve = resolve
        self.batch = batch
        self.concurrency = concurrency
        self._client = new_client(settings)

    @property
    def lease(self) -> timedelta:
        # Longer than any attempt can take (connect + write + read + pool timeouts), so a
        # live deliverer never loses its row mid-attempt.
        return timedelta(seconds=max(self.settings.webhook_lease_s, 4 * self.settings.webhook_timeout_s + 5))

    def backoff(self, attempts_made: int) -> timedelta:
        """Before attempt n+1: base x 2^(n-1), capped, +-10 % jitter."""
        base = self.settings.webhook_retry_base_s * 2 ** max(0, attempts_made - 1)
        delay = min(base, self.settings.webhook_retry_max_delay_s)
        return timedelta(seconds=delay * random.uniform(0.9, 1.1))

    def deliver(self, claim: ClaimedDelivery):
        """One attempt of a claimed delivery, recorded; the delivery as it is now."""
        started_at = datetime.now(UTC)
        result = send_once(self._client, self.settings, claim.url, claim.secret, claim.delivery.id,
                           claim.delivery.payload, self.resolve)
        return self.store.record_webhook_attempt(
            claim, started_at=started_at, status_code=result.status_code, latency_ms=result.latency_ms,
            error=result.error, delivered=result.delivered, retry_in=self.backoff(claim.delivery.attempts + 1),
            deliverer=self.name, retry_window=timedelta(seconds=self.settings.webhook_retry_window_s),
        )

    def deliver_now(self, delivery_id: str):
        """Claim and attempt this one delivery at once (the API's test); None if not due."""
        claims = self.store.claim_webhook_deliveries(self.name, self.lease, limit=1, delivery_id=delivery_id)
        return self.deliver(claims[0]) if claims else None

    def run_once(self) -> int:
        """Claim a batch of due rows and attempt each (a few at once); how many were tried."""
        claims = self.store.claim_webhook_deliveries(self.name, self.lease, limit=self.batch)
        if len(claims) <= 1:
            for claim in claims:
                self.deliver(claim)
        else:
            with ThreadPoolExecutor(max_workers=min(self.concurrency, len(claims))) as pool:
                list(pool.map(self.deliver, claims))
        return len(claims)

    def run(self, stop: threading.Event | None = None) -> None:
        """Deliver until `stop` is set; a failing store is logged and retried."""
        stop = stop or threading.Event()
        while not stop.is_set():
            try:
                tried = self.run_once()
            except Exception:  # noqa: BLE001 - keep delivering whatever one round hit
                log.exception("webhook delivery round failed")
                tried = 0
            if not tried:
                stop.wait(self.settings.webhook_poll_interval_s)

    def close(self) -> None:
        self._client.close()


_started: dict[int, threading.Thread] = {}
_start_lock = threading.Lock()


def start_in_background(store, settings: Settings) -> threading.Thread | None:
    """The deliverer as a daemon thread of this process (once per process; None when
    ``webhook_deliverer`` is off). A slow receiver only slows this thread, never a job."""
    if not settings.webhook_deliverer:
        return None
    with _start_lock:
        thread = _started.get(os.getpid())
        if thread is None or not thread.is_alive():
            thread = threading.Thread(target=Deliverer(store, settings).run, name="llm-batch-webhooks", daemon=True)
            thread.start()
            _started[os.getpid()] = thread
        return thread
