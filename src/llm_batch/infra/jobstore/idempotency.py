"""Idempotency keys: retry-safe creates (the ``idempotency_keys`` table, used by
``llm_batch.api.idempotency``). A reservation whose request never finished is taken over after its lease."""

from __future__ import annotations

import dataclasses
from datetime import datetime, timedelta

from sqlalchemy import ColumnElement, delete, select, update

from llm_batch.infra.jobstore.errors import ConcurrentUpdate
from llm_batch.infra.jobstore.models import IDEMPOTENCY_KEYS
from llm_batch.infra.jobstore.repository import CAS_ATTEMPTS, Repository, from_row, require_aware, upsert, utcnow


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


_record = from_row(IdempotencyRecord)


def _reservation(owner: str, key: str, locked_at: datetime | None = None) -> list[ColumnElement[bool]]:
    """WHERE clauses: the key of `owner`, and when `locked_at` is given its pending reservation taken then."""
    where = [IDEMPOTENCY_KEYS.c.owner == owner, IDEMPOTENCY_KEYS.c.key == key]
    if locked_at is not None:
        where += [IDEMPOTENCY_KEYS.c.locked_at == locked_at, IDEMPOTENCY_KEYS.c.status_code.is_(None)]
    return where


class IdempotencyRepository(Repository):
    def reserve_idempotency_key(
        self, owner: str, key: str, route: str, fingerprint: str, lease: timedelta, now: datetime | None = None
    ) -> tuple[bool, IdempotencyRecord]:
        """Take `key` of `owner` for a request (``(True, record)``), or hand back who holds it
        (``(False, record)``). Of concurrent callers one gets True (the others' INSERT hits the
        primary key); a pending reservation older than `lease` is taken over by a
        compare-and-set on ``locked_at``."""
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
                row = connection.execute(select(IDEMPOTENCY_KEYS).where(*_reservation(owner, key))).one_or_none()
                if row is None:
                    continue  # released in between: try the insert again
                if row.status_code is not None or row.locked_at > now - lease:
                    return False, _record(row)
                taken = connection.execute(
                    update(IDEMPOTENCY_KEYS).where(*_reservation(owner, key, row.locked_at))
                    .values(route=route, fingerprint=fingerprint, locked_at=now, created_at=now)
                    .returning(*IDEMPOTENCY_KEYS.c)
                ).one_or_none()
                if taken is not None:
                    return True, _record(taken)
        raise ConcurrentUpdate(f"idempotency key {key!r}: kept changing under {CAS_ATTEMPTS} attempts")

    def get_idempotency_key(self, owner: str, key: str) -> IdempotencyRecord | None:
        return self._read_one(select(IDEMPOTENCY_KEYS).where(*_reservation(owner, key)), _record)

    def complete_idempotency_key(
        self, owner: str, key: str, locked_at: datetime, status_code: int, content_type: str | None, body: str
    ) -> bool:
        """Store the response of the reservation taken at `locked_at` (False if it was lost:
        released, or taken over after its lease)."""
        with self._transaction(write=True) as connection:
            done = connection.execute(
                update(IDEMPOTENCY_KEYS).where(*_reservation(owner, key, locked_at))
                .values(status_code=status_code, content_type=content_type, response_body=body, completed_at=utcnow())
            )
            return done.rowcount == 1

    def release_idempotency_key(self, owner: str, key: str, locked_at: datetime) -> None:
        """Drop a pending reservation (its request failed with a 5xx): the key is free again."""
        with self._transaction(write=True) as connection:
            connection.execute(delete(IDEMPOTENCY_KEYS).where(*_reservation(owner, key, locked_at)))

    def delete_idempotency_keys(self, created_before: datetime) -> int:
        require_aware(created_before=created_before)
        with self._transaction(write=True) as connection:
            done = connection.execute(delete(IDEMPOTENCY_KEYS).where(IDEMPOTENCY_KEYS.c.created_at < created_before))
            return done.rowcount or 0
