"""Idempotency keys: retry-safe creates (the ``idempotency_keys`` table, used by
``llm_batch.api.idempotency``).

A request with an ``Idempotency-Key`` reserves it (owner, key); the first of many concurrent
callers wins, the others see it pending or, once completed, get its stored response. A
reservation whose request never finished is taken over after its lease; housekeeping
deletes old keys.
"""

from __future__ import annotations

import dataclasses
from datetime import datetime, timedelta

from sqlalchemy import ColumnElement, Row, delete, select, update

from llm_batch.infra.jobstore.errors import ConcurrentUpdate
from llm_batch.infra.jobstore.repository import CAS_ATTEMPTS, Repository, require_aware, upsert, utcnow
from llm_batch.infra.jobstore.tables import IDEMPOTENCY_KEYS


@dataclasses.dataclass(frozen=True, slots=True)
class IdempotencyRecord:
    """An idempotency key: pending while ``status_code`` is None, else the stored response."""

    owner: str
    key: str
    route: str
    fingerprint: str
    created_at: datetime
    locked_at: datetime
    status_code: int | None
    content_type: str | None
    response_body: str | None
    completed_at: datetime | None


def _record(row: Row) -> IdempotencyRecord:
    return IdempotencyRecord(**row._asdict())


def _key(owner: str, key: str) -> list[ColumnElement[bool]]:
    return [IDEMPOTENCY_KEYS.c.owner == owner, IDEMPOTENCY_KEYS.c.key == key]


class IdempotencyRepository(Repository):
    """The idempotency keys (see the module docstring)."""

    def reserve_idempotency_key(
        self, owner: str, key: str, route: str, fingerprint: str, lease: timedelta, now: datetime | None = None
    ) -> tuple[bool, IdempotencyRecord]:
        """Take `key` of `owner` for a request (``(True, record)``), or hand back who holds it
        (``(False, record)``: pending while its ``status_code`` is None, else completed).

        Exactly one of many concurrent callers gets True: the INSERT hits the primary key
        (owner, key) and does nothing. A pending reservation older than `lease` (its request
        never finished) is taken over by a compare-and-set on ``locked_at``; the route and
        fingerprint become the new request's."""
        now = now or utcnow()
        require_aware(now=now)
        values = dict(owner=owner, key=key, route=route, fingerprint=fingerprint, created_at=now, locked_at=now)
        for _ in range(CAS_ATTEMPTS):
            with self._transaction(write=True) as connection:
                inserted = connection.execute(
                    upsert(connection, IDEMPOTENCY_KEYS).values(**values).on_conflict_do_nothing()
                    .returning(*IDEMPOTENCY_KEYS.c)
                ).one_or_none()
                if inserted is not None:
                    return True, _record(inserted)
                row = connection.execute(select(IDEMPOTENCY_KEYS).where(*_key(owner, key))).one_or_none()
                if row is None:
                    continue  # released in between: try the insert again
                if row.status_code is not None or row.locked_at > now - lease:
                    return False, _record(row)
                c = IDEMPOTENCY_KEYS.c
                taken = connection.execute(
                    update(IDEMPOTENCY_KEYS)
                    .where(*_key(owner, key), c.status_code.is_(None), c.locked_at == row.locked_at)
                    .values(route=route, fingerprint=fingerprint, locked_at=now, created_at=now)
                    .returning(*IDEMPOTENCY_KEYS.c)
                ).one_or_none()
                if taken is not None:
                    return True, _record(taken)
        raise ConcurrentUpdate(f"idempotency key {key!r}: kept changing under {CAS_ATTEMPTS} attempts")

    def get_idempotency_key(self, owner: str, key: str) -> IdempotencyRecord | None:
        return self._read_one(select(IDEMPOTENCY_KEYS).where(*_key(owner, key)), _record)

    def complete_idempotency_key(
        self, owner: str, key: str, locked_at: datetime, status_code: int, content_type: str | None, body: str
    ) -> bool:
        """Store the response of the reservation taken at `locked_at` (False if it was lost:
        released, or taken over after its lease)."""
        c = IDEMPOTENCY_KEYS.c
        with self._transaction(write=True) as connection:
            done = connection.execute(
                update(IDEMPOTENCY_KEYS)
                .where(*_key(owner, key), c.locked_at == locked_at, c.status_code.is_(None))
                .values(status_code=status_code, content_type=content_type, response_body=body, completed_at=utcnow())
            )
            return done.rowcount == 1

    def release_idempotency_key(self, owner: str, key: str, locked_at: datetime) -> None:
        """Drop a pending reservation (its request failed with a 5xx): the key is free again."""
        c = IDEMPOTENCY_KEYS.c
        with self._transaction(write=True) as connection:
            connection.execute(
                delete(IDEMPOTENCY_KEYS).where(*_key(owner, key), c.locked_at == locked_at, c.status_code.is_(None))
            )

    def delete_idempotency_keys(self, created_before: datetime) -> int:
        """Delete keys created before `created_before` (housekeeping); returns how many."""
        require_aware(created_before=created_before)
        with self._transaction(write=True) as connection:
            done = connection.execute(delete(IDEMPOTENCY_KEYS).where(IDEMPOTENCY_KEYS.c.created_at < created_before))
            return done.rowcount or 0
