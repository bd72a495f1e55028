"""Webhook endpoints, the delivery outbox and attempts.

A job's end writes its outbox rows (``enqueue_job_end``) in the very transaction that moves
the job into its terminal status, so no end is ever missed whichever path ended it; deliverers
claim due rows with a lease, so two never hold one row and a killed one's rows are claimed again."""

from __future__ import annotations

import dataclasses
import secrets
import uuid
from base64 import b64encode
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, Row, delete, insert, or_, select, update

from llm_batch.core.jobs import JobStatus
from llm_batch.infra.jobstore.models import ATTEMPTS, DELIVERIES, ENDPOINTS
from llm_batch.infra.jobstore.paging import matching, owned, page
from llm_batch.infra.jobstore.repository import Repository, from_row, utcnow

# OpenAI's batch event names, by the canonical terminal status they announce.
JOB_END_EVENTS: dict[JobStatus, str] = {
    JobStatus.SUCCEEDED: "batch.completed",
    JobStatus.FAILED: "batch.failed",
    JobStatus.TIMEOUT_EXCEEDED: "batch.expired",
    JobStatus.CANCELLED: "batch.cancelled",
}
EVENT_TYPES: tuple[str, ...] = tuple(JOB_END_EVENTS.values())
SECRET_PREFIX = "whsec_"
# How long a job-end event is retried unless the deliverer says (its settings' webhook_retry_window_s).
DEFAULT_RETRY_WINDOW = timedelta(hours=24)


class WebhookEndpointNotFound(LookupError):
    pass


def new_webhook_secret() -> str:
    """A Standard Webhooks secret: ``whsec_`` + base64 of 32 random bytes."""
    return SECRET_PREFIX + b64encode(secrets.token_bytes(32)).decode()


@dataclasses.dataclass(frozen=True, slots=True)
class WebhookEndpoint:
    """A webhook endpoint (its secrets are never part of the snapshot: only a hint)."""

    id: str
    owner: str
    url: str
    events: list[str]
    description: str
    created_at: datetime
    updated_at: datetime
    secret_hint: str  # whsec_...<the secret's last 4 characters>


@dataclasses.dataclass(frozen=True, slots=True)
class WebhookDelivery:
    """One event for one endpoint (an outbox row); ``id`` is the ``webhook-id`` header."""

    id: str
    endpoint_id: str
    owner: str
    event_id: str
    event_type: str
    job_id: str | None
    payload: dict[str, Any]
    status: str
    attempts: int
    next_attempt_at: datetime
    give_up_at: datetime
    lease_owner: str | None
    lease_expires_at: datetime | None
    created_at: datetime
    delivered_at: datetime | None
    last_error: str | None


@dataclasses.dataclass(frozen=True, slots=True)
class WebhookAttempt:
    """One HTTP attempt of a delivery, with the delivery's event (for listings)."""

    id: str
    delivery_id: str
    endpoint_id: str
    attempt: int
    started_at: datetime
    status_code: int | None
    latency_ms: float
    error: str | None
    deliverer: str
    event_id: str = ""
    event_type: str = ""
    job_id: str | None = None
    delivery_status: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class ClaimedDelivery:
    """A delivery a deliverer holds (until ``lease_expires_at``), with what sending needs."""

    delivery: WebhookDelivery
    url: str
    secrets: tuple[str, ...]  # to sign with: the current one, then a rotated-out one still in its grace period
    lease: str


_ENDPOINT_FIELDS = [f.name for f in dataclasses.fields(WebhookEndpoint) if f.name != "secret_hint"]
_delivery = from_row(WebhookDelivery)


def secret_hint(secret: str) -> str:
    """Enough of a secret to tell which one a receiver holds, never enough to sign with."""
    return f"{SECRET_PREFIX}...{secret[-4:]}"


def _endpoint(row: Row) -> WebhookEndpoint:
    values = row._mapping
    return WebhookEndpoint(**{name: values[name] for name in _ENDPOINT_FIELDS}, secret_hint=secret_hint(values["secret"]))


def _signing_secrets(row: Row, now: datetime) -> tuple[str, ...]:
    keeps_previous = row.previous_secret is not None and row.previous_secret_expires_at is not None \
        and row.previous_secret_expires_at > now
    return (row.secret, row.previous_secret) if keeps_previous else (row.secret,)


def _event(event_type: str, at: datetime, object_id: str) -> dict[str, Any]:
    """A new event's body, as OpenAI's."""
    return {"id": f"evt_{uuid.uuid4().hex}", "object": "event", "created_at": int(at.timestamp()), "type": event_type,
            "data": {"id": object_id}}


def _pending_delivery(endpoint_id: str, owner: str, payload: dict[str, Any], job_id: str | None, now: datetime,
                     give_up_at: datetime) -> dict[str, Any]:
    """An outbox row of `payload` for the endpoint, due now, never attempted (no lease, no error)."""
    return dict(id=f"msg_{uuid.uuid4().hex}", endpoint_id=endpoint_id, owner=owner, event_id=payload["id"],
                event_type=payload["type"], job_id=job_id, payload=payload, status="pending", attempts=0,
                next_attempt_at=now, give_up_at=give_up_at, created_at=now)


def enqueue_job_end(connection: Connection, before: Row, after: Row) -> None:
    """In the transaction that moved a job from `before` to `after`: if that move ended it,
    one outbox row per endpoint of its owner that wants the event (nothing else)."""
    if JobStatus(before.status).terminal or not JobStatus(after.status).terminal:
        return
    event_type = JOB_END_EVENTS[JobStatus(after.status)]
    endpoints = connection.execute(
        select(ENDPOINTS.c.id, ENDPOINTS.c.events).where(ENDPOINTS.c.owner == after.owner)
    ).all()
    wanted = [e.id for e in endpoints if event_type in (e.events or [])]
    if not wanted:
        return
    now = utcnow()
    ended_at = after.completed_at or after.updated_at or now
    payload = _event(event_type, ended_at, after.id)
    connection.execute(insert(DELIVERIES), [
        _pending_delivery(endpoint_id, after.owner, payload, after.id, now, now + DEFAULT_RETRY_WINDOW)
        for endpoint_id in wanted
    ])


class WebhookRepository(Repository):
    def create_webhook_endpoint(
        self, owner: str, url: str, events: list[str] | None = None, description: str = ""
    ) -> tuple[WebhookEndpoint, str]:
        """A new endpoint of `owner` and its secret (``whsec_...``; the API shows it once).
        ``events`` defaults to every job-end event; unknown names raise ValueError."""
        secret, now = new_webhook_secret(), utcnow()
        values = dict(id=f"we_{uuid.uuid4().hex}", owner=owner, url=url, events=_event_types(events),
                      description=description, secret=secret, created_at=now, updated_at=now)
        return _endpoint(self._insert(ENDPOINTS, values, ENDPOINTS.c)), secret

    def get_webhook_endpoint(self, endpoint_id: str, owner: str | None = None) -> WebhookEndpoint | None:
        return self._read_one(select(ENDPOINTS).where(*owned(ENDPOINTS, endpoint_id, owner)), _endpoint)

    def list_webhook_endpoints(self, owner: str | None = None) -> list[WebhookEndpoint]:
        """Every endpoint of `owner` (None: everyone's), oldest first."""
        query = select(ENDPOINTS).where(*matching(ENDPOINTS, owner=owner))
        return self._read_all(query.order_by(ENDPOINTS.c.created_at, ENDPOINTS.c.id), _endpoint)

    def page_webhook_endpoints(
        self, owner: str | None = None, limit: int = 20, after: str | None = None
    ) -> tuple[list[WebhookEndpoint], bool]:
        """Up to `limit` endpoints newest first, those after the endpoint `after` (keyset, as
        list_jobs; an unknown one raises InvalidCursor), and whether more follow."""
        filters = matching(ENDPOINTS, owner=owner)
        with self._transaction(write=False) as connection:
            rows, _ = page(connection, ENDPOINTS, filters, (ENDPOINTS.c.created_at, True), limit + 1, 0, after,
                           owner=owner)
        return [_endpoint(r) for r in rows[:limit]], len(rows) > limit

    def update_webhook_endpoint(
        self, endpoint_id: str, owner: str | None = None, *, url: str | None = None, events: list[str] | None = None,
        description: str | None = None,
    ) -> WebhookEndpoint:
        """Change what is given (None: keep); ``updated_at`` moves only if something changed."""
        with self._transaction(write=True) as connection:
            row = _owned_endpoint(connection, endpoint_id, owner)
            given = {"url": url, "events": None if events is None else _event_types(events), "description": description}
            changes = {name: value for name, value in given.items() if value is not None and value != row._mapping[name]}
            if changes:
                row = connection.execute(
                    update(ENDPOINTS).where(ENDPOINTS.c.id == endpoint_id).values(**changes, updated_at=utcnow())
                    .returning(*ENDPOINTS.c)
                ).one()
            return _endpoint(row)

    def rotate_webhook_secret(
        self, endpoint_id: str, owner: str | None = None, keep_previous_for: timedelta | None = None
    ) -> tuple[WebhookEndpoint, str]:
        """A new secret for the endpoint (returned once, like at create). ``keep_previous_for``:
        the secret it replaces signs every attempt too for that long (receivers switch
        without missing an event); None: it stops at once."""
        secret, now = new_webhook_secret(), utcnow()
        with self._transaction(write=True) as connection:
            row = _owned_endpoint(connection, endpoint_id, owner)
            kept = keep_previous_for is not None
            row = connection.execute(
                update(ENDPOINTS).where(ENDPOINTS.c.id == endpoint_id).values(
                    secret=secret, updated_at=now, previous_secret=row.secret if kept else None,
                    previous_secret_expires_at=now + keep_previous_for if kept else None,
                ).returning(*ENDPOINTS.c)
            ).one()
        return _endpoint(row), secret

    def delete_webhook_endpoint(self, endpoint_id: str, owner: str | None = None) -> None:
        """Remove the endpoint with its deliveries (pending ones are never sent) and attempts."""
        with self._transaction(write=True) as connection:
            if connection.execute(delete(ENDPOINTS).where(*owned(ENDPOINTS, endpoint_id, owner))).rowcount != 1:
                raise WebhookEndpointNotFound(f"no webhook endpoint {endpoint_id!r}")
            connection.execute(delete(ATTEMPTS).where(ATTEMPTS.c.endpoint_id == endpoint_id))
            connection.execute(delete(DELIVERIES).where(DELIVERIES.c.endpoint_id == endpoint_id))

    def enqueue_webhook_test(self, endpoint_id: str, owner: str | None = None,
                             event_type: str = "batch.completed") -> WebhookDelivery:
        """A test event (data.id ``batch_test``) for the endpoint: one attempt, no retries."""
        if event_type not in EVENT_TYPES:
            raise ValueError(f"unknown event type {event_type!r}: choose from {', '.join(EVENT_TYPES)}")
        now = utcnow()
        with self._transaction(write=True) as connection:
            endpoint_owner = _owned_endpoint(connection, endpoint_id, owner).owner
            payload = _event(event_type, now, "batch_test")
            row = connection.execute(
                insert(DELIVERIES).values(**_pending_delivery(endpoint_id, endpoint_owner, payload, None, now, now))
                .returning(*DELIVERIES.c)
            ).one()
            return _delivery(row)

    def list_webhook_deliveries(
        self, endpoint_id: str | None = None, owner: str | None = None, job_id: str | None = None
    ) -> list[WebhookDelivery]:
        filters = matching(DELIVERIES, endpoint_id=endpoint_id, owner=owner, job_id=job_id)
        return self._read_all(select(DELIVERIES).where(*filters).order_by(DELIVERIES.c.created_at), _delivery)

    def claim_webhook_deliveries(
        self, deliverer: str, lease: timedelta, limit: int = 10, delivery_id: str | None = None,
        now: datetime | None = None,
    ) -> list[ClaimedDelivery]:
        """Take up to `limit` due pending rows (next attempt reached, no live lease) for
        `lease`. Each row is taken by a compare-and-set on its lease: of two deliverers
        racing for a row, one gets it. ``delivery_id``: only that row (if due)."""
        now = now or utcnow()
        c = DELIVERIES.c
        free = or_(c.lease_expires_at.is_(None), c.lease_expires_at <= now)
        due = [c.status == "pending", c.next_attempt_at <= now, free]
        if delivery_id is not None:
            due.append(c.id == delivery_id)
        with self._transaction(write=False) as connection:
            candidates = connection.execute(
                select(c.id).where(*due).order_by(c.next_attempt_at).limit(limit)
            ).scalars().all()
        claimed = []
        for candidate in candidates:
            token = f"{deliverer}:{uuid.uuid4().hex[:12]}"
            with self._transaction(write=True) as connection:
                row = connection.execute(
                    update(DELIVERIES).where(c.id == candidate, *due)
                    .values(lease_owner=token, lease_expires_at=now + lease).returning(*DELIVERIES.c)
                ).one_or_none()
                if row is None:
                    continue  # another deliverer took it first
                endpoint = connection.execute(select(ENDPOINTS).where(ENDPOINTS.c.id == row.endpoint_id)).one_or_none()
                if endpoint is None:  # endpoint deleted in between
                    connection.execute(delete(DELIVERIES).where(c.id == candidate))
                    continue
            claimed.append(ClaimedDelivery(_delivery(row), endpoint.url, _signing_secrets(endpoint, now), token))
        return claimed

    def record_webhook_attempt(
        self, claim: ClaimedDelivery, *, started_at: datetime, status_code: int | None, latency_ms: float,
        error: str | None, delivered: bool, retry_in: timedelta, deliverer: str,
        retry_window: timedelta | None = None,
    ) -> WebhookDelivery | None:
        """Record one attempt of a claimed delivery and release its lease: delivered, or
        pending again in `retry_in` (failed once that passes its give-up time). The row moves
        only while the lease is still `claim`'s (else only the attempt is recorded); None if
        the delivery is gone (its endpoint deleted)."""
        c = DELIVERIES.c
        now = utcnow()
        with self._transaction(write=True) as connection:
            row = connection.execute(select(DELIVERIES).where(c.id == claim.delivery.id)).one_or_none()
            if row is None:
                return None
            connection.execute(insert(ATTEMPTS).values(
                id=f"wa_{uuid.uuid4().hex}", delivery_id=row.id, endpoint_id=row.endpoint_id, attempt=row.attempts + 1,
                started_at=started_at, status_code=status_code, latency_ms=round(latency_ms, 1),
                error=error[:2000] if error else None, deliverer=deliverer,
            ))
            if row.lease_owner != claim.lease or row.status != "pending":
                return _delivery(row)
            values: dict[str, Any] = dict(attempts=c.attempts + 1, lease_owner=None, lease_expires_at=None,
                                          last_error=None if delivered else error)
            # Retried until the deliverer's window from the event's creation (its settings), else
            # until the row's own give-up time (test events: right away).
            own_window = retry_window is None or row.job_id is None
            if delivered:
                values.update(status="delivered", delivered_at=now)
            elif now + retry_in > (row.give_up_at if own_window else row.created_at + retry_window):
                values.update(status="failed")
            else:
                values.update(next_attempt_at=now + retry_in)
            updated = connection.execute(
                update(DELIVERIES).where(c.id == row.id, c.lease_owner == claim.lease).values(**values)
                .returning(*DELIVERIES.c)
            ).one()
            return _delivery(updated)

    def list_webhook_attempts(
        self, endpoint_id: str, owner: str | None = None, limit: int = 100, delivery_id: str | None = None,
        job_id: str | None = None,
    ) -> list[WebhookAttempt]:
        """The endpoint's attempts, newest first, each with its delivery's event and status
        (empty for an unknown or not-owned endpoint)."""
        a, d = ATTEMPTS.c, DELIVERIES.c
        filters = [*matching(ATTEMPTS, endpoint_id=endpoint_id, delivery_id=delivery_id),
                   *matching(DELIVERIES, owner=owner, job_id=job_id)]
        query = (
            select(*ATTEMPTS.c, d.event_id, d.event_type, d.job_id, d.status.label("delivery_status"))
            .join(DELIVERIES, d.id == a.delivery_id)
            .where(*filters).order_by(a.started_at.desc(), a.id.desc()).limit(limit)
        )
        return self._read_all(query, from_row(WebhookAttempt))


def _owned_endpoint(connection: Connection, endpoint_id: str, owner: str | None) -> Row:
    """The endpoint's row (of `owner` if given), else WebhookEndpointNotFound."""
    row = connection.execute(select(ENDPOINTS).where(*owned(ENDPOINTS, endpoint_id, owner))).one_or_none()
    if row is None:
        raise WebhookEndpointNotFound(f"no webhook endpoint {endpoint_id!r}")
    return row


def _event_types(events: list[str] | None) -> list[str]:
    """The event types an endpoint gets: `events` without repeats, or all; ValueError naming unknown ones."""
    chosen = list(dict.fromkeys(events if events is not None else EVENT_TYPES))
    unknown = [e for e in chosen if e not in EVENT_TYPES]
    if unknown or not chosen:
        raise ValueError(f"unknown or no event types {unknown}: choose from {', '.join(EVENT_TYPES)}")
    return chosen
