"""The result cache's index (the ``result_cache`` table): which answers an owner's cache holds.

The answers themselves are storage objects (``uri``); a row is written only after its object
is whole, and a lookup serves an answer only when both are there, so an entry is never half
there. Rows are removed before their objects: an object left behind is never served.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Protocol

from sqlalchemy import Row, delete, func, insert, select, tuple_, update
from sqlalchemy.exc import IntegrityError

from llm_batch.infra.jobstore.repository import Repository, require_aware, utcnow
from llm_batch.infra.jobstore.snapshots import CacheEntry
from llm_batch.infra.jobstore.tables import RESULT_CACHE

# Keys per lookup statement (an IN list well under every database's parameter limit).
_KEYS_PER_QUERY = 500


def _entry(row: Row) -> CacheEntry:
    return CacheEntry(**row._asdict())


class ResultCacheIndex(Protocol):
    """The result cache's rows, as the pipeline's cache use cases and housekeeping use them."""

    def cache_entries(self, owner: str, keys: Iterable[str], *, made_after: datetime) -> dict[str, CacheEntry]: ...
    def put_cache_entry(self, *, owner: str, key: str, job_id: str, uri: str, bytes: int, prompt_tokens: int,
                        completion_tokens: int) -> None: ...
    def touch_cache_entries(self, owner: str, keys: Iterable[str]) -> None: ...
    def forget_job_cache(self, job_id: str) -> list[CacheEntry]: ...
    def evict_cache(self, *, made_before: datetime, max_bytes: int) -> list[CacheEntry]: ...


class ResultCacheRepository(Repository):
    """The result cache's index (see the module docstring)."""

    def cache_entries(self, owner: str, keys: Iterable[str], *, made_after: datetime) -> dict[str, CacheEntry]:
        """`owner`'s entries among `keys` made after `made_after` (older ones have expired)."""
        require_aware(made_after=made_after)
        wanted = list(dict.fromkeys(keys))
        found: dict[str, CacheEntry] = {}
        for start in range(0, len(wanted), _KEYS_PER_QUERY):
            query = select(RESULT_CACHE).where(
                RESULT_CACHE.c.owner == owner, RESULT_CACHE.c.key.in_(wanted[start:start + _KEYS_PER_QUERY]),
                RESULT_CACHE.c.created_at > made_after)
            found.update((entry.key, entry) for entry in self._read_all(query, _entry))
        return found

    def put_cache_entry(self, *, owner: str, key: str, job_id: str, uri: str, bytes: int, prompt_tokens: int,
                        completion_tokens: int) -> None:
        """Record `owner`'s answer `key` (its object already whole at `uri`), computed by
        `job_id`; an entry of that key is replaced (a newer computation of the same answer)."""
        now = utcnow()
        values = dict(job_id=job_id, uri=uri, bytes=bytes, prompt_tokens=prompt_tokens,
                      completion_tokens=completion_tokens, created_at=now, used_at=now)
        try:
            with self._transaction(write=True) as connection:
                connection.execute(insert(RESULT_CACHE).values(owner=owner, key=key, **values))
        except IntegrityError:
            with self._transaction(write=True) as connection:
                connection.execute(update(RESULT_CACHE).where(
                    RESULT_CACHE.c.owner == owner, RESULT_CACHE.c.key == key).values(**values))

    def touch_cache_entries(self, owner: str, keys: Iterable[str]) -> None:
        """Mark `owner`'s entries `keys` used now (eviction removes the least recently used)."""
        wanted = list(dict.fromkeys(keys))
        now = utcnow()
        with self._transaction(write=True) as connection:
            for start in range(0, len(wanted), _KEYS_PER_QUERY):
                connection.execute(update(RESULT_CACHE).where(
                    RESULT_CACHE.c.owner == owner, RESULT_CACHE.c.key.in_(wanted[start:start + _KEYS_PER_QUERY]),
                ).values(used_at=now))

    def forget_job_cache(self, job_id: str) -> list[CacheEntry]:
        """Remove the entries `job_id` computed; returns them (their objects are the
        caller's to delete)."""
        with self._transaction(write=True) as connection:
            rows = connection.execute(
                delete(RESULT_CACHE).where(RESULT_CACHE.c.job_id == job_id).returning(*RESULT_CACHE.c)).all()
        return [_entry(row) for row in rows]

    def evict_cache(self, *, made_before: datetime, max_bytes: int) -> list[CacheEntry]:
        """Remove the entries made before `made_before`, then the least recently used until
        the rest hold at most `max_bytes`; returns what was removed (objects: the caller's)."""
        require_aware(made_before=made_before)
        with self._transaction(write=True) as connection:
            removed = [_entry(row) for row in connection.execute(
                delete(RESULT_CACHE).where(RESULT_CACHE.c.created_at < made_before).returning(*RESULT_CACHE.c))]
            total = connection.execute(select(func.coalesce(func.sum(RESULT_CACHE.c.bytes), 0))).scalar_one()
            excess, victims = total - max_bytes, []
            if excess > 0:
                for row in connection.execute(select(RESULT_CACHE.c.owner, RESULT_CACHE.c.key, RESULT_CACHE.c.bytes)
                                              .order_by(RESULT_CACHE.c.used_at, RESULT_CACHE.c.key)):
                    if excess <= 0:
                        break
                    victims.append((row.owner, row.key))
                    excess -= row.bytes
            for start in range(0, len(victims), _KEYS_PER_QUERY):
                removed += [_entry(row) for row in connection.execute(delete(RESULT_CACHE).where(
                    tuple_(RESULT_CACHE.c.owner, RESULT_CACHE.c.key).in_(victims[start:start + _KEYS_PER_QUERY]),
                ).returning(*RESULT_CACHE.c))]
        return removed
