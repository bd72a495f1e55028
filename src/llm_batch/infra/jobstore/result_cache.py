"""The result cache's index (the ``result_cache`` table): which answers an owner's cache holds.

The answers are in storage, in packs (``uri``, from ``at_byte``); rows are written only after
their pack is whole and removed before it (a pack goes once no row names it), so an entry is
never half there and a pack left behind is never served.
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Iterator
from contextlib import closing
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from sqlalchemy import Connection, delete, func, select, tuple_, update

from llm_batch.core.snapshots import CachedAnswer, CacheEntry
from llm_batch.infra.jobstore.models import RESULT_CACHE
from llm_batch.infra.jobstore.repository import Repository, from_row, require_aware, upsert, utcnow

if TYPE_CHECKING:
    from llm_batch.infra.result_cache import Packed

# Keys per lookup statement (an IN list well under every database's parameter limit).
_KEYS_PER_QUERY = 2000
KEY_LENGTH = 64  # hex digits of a key (llm_batch.infra.result_cache.CacheKeys)
# Entries a fill commits at once (a kill between two leaves whole entries only, either way).
_ROWS_PER_TRANSACTION = 10_000
_COLUMNS = ("owner", "key", "job_id", "uri", "at_byte", "bytes", "prompt_tokens", "completion_tokens",
            "created_at", "used_at")
# How exactly eviction knows when an entry was last used.
TOUCH_RESOLUTION = timedelta(hours=1)
_REPLACED = _COLUMNS[2:]  # a newer computation of a key replaces all but the key itself
_entry = from_row(CacheEntry)
T = TypeVar("T")


def _chunks(items: Iterable[T], size: int = _KEYS_PER_QUERY) -> Iterator[list[T]]:
    items = list(items)
    return (items[start:start + size] for start in range(0, len(items), size))


class ResultCacheRepository(Repository):
    def cached_answers(self, owner: str, keys: Iterable[str], *, made_after: datetime) -> dict[str, CachedAnswer]:
        """Where `owner`'s answers among `keys` made after `made_after` are (older ones have expired)."""
        require_aware(made_after=made_after)
        found: dict[str, CachedAnswer] = {}
        columns = (RESULT_CACHE.c.key, RESULT_CACHE.c.uri, RESULT_CACHE.c.bytes, RESULT_CACHE.c.at_byte)
        with self._transaction(write=False) as connection:
            for chunk in _chunks(dict.fromkeys(keys)):
                query = select(*columns).where(RESULT_CACHE.c.owner == owner, RESULT_CACHE.c.key.in_(chunk),
                                               RESULT_CACHE.c.created_at > made_after)
                found.update((row[0], CachedAnswer(*row)) for row in connection.execute(query))
        return found

    def holds_cache_prefix(self, owner: str, prefix: str, *, made_after: datetime) -> bool:
        """Whether `owner` has an entry made after `made_after` whose key starts with the hex `prefix`
        (a range of the primary key's index: hex digits sort alike in every collation)."""
        require_aware(made_after=made_after)
        last = prefix + "f" * (KEY_LENGTH - len(prefix))
        query = select(RESULT_CACHE.c.key).where(
            RESULT_CACHE.c.owner == owner,
            RESULT_CACHE.c.key.between(prefix, last),
            RESULT_CACHE.c.created_at > made_after,
        ).limit(1)
        with self._transaction(write=False) as connection:
            return connection.execute(query).first() is not None

    def put_cache_entries(self, *, owner: str, job_id: str, uri: str, packed: Iterable[Packed]) -> None:
        """Record `owner`'s answers `packed` (their pack already whole at `uri`), computed by
        `job_id`; an entry of a key already there is replaced (the last of a key in `packed` wins)."""
        now = utcnow()
        rows = {p.key: dict(owner=owner, key=p.key, job_id=job_id, uri=uri, at_byte=p.at_byte, bytes=p.bytes,
                            prompt_tokens=p.prompt_tokens, completion_tokens=p.completion_tokens,
                            created_at=now, used_at=now) for p in packed}
        for chunk in _chunks(rows.values(), _ROWS_PER_TRANSACTION):
            with self._transaction(write=True) as connection:
                if connection.dialect.name == "postgresql":
                    _upsert_postgres(connection, chunk)
                    continue
                statement = upsert(connection, RESULT_CACHE)
                connection.execute(statement.on_conflict_do_update(
                    index_elements=[RESULT_CACHE.c.owner, RESULT_CACHE.c.key],
                    set_={name: statement.excluded[name] for name in _REPLACED}), chunk)

    def cache_uris_in_use(self, uris: Iterable[str]) -> set[str]:
        """Those of `uris` some entry still names (a pack of none may be deleted)."""
        used: set[str] = set()
        for chunk in _chunks(dict.fromkeys(uris)):
            query = select(RESULT_CACHE.c.uri).distinct().where(RESULT_CACHE.c.uri.in_(chunk))
            with self._transaction(write=False) as connection:
                used.update(connection.execute(query).scalars())
        return used

    def touch_cache_entries(self, owner: str, keys: Iterable[str], *, now: datetime | None = None) -> None:
        """Mark `owner`'s entries `keys` used `now` (eviction removes the least recently used),
        those not marked in the `TOUCH_RESOLUTION` before it: a big job's rerun rewrites no
        row, nor the index of use, that its fill has just written."""
        now = now or utcnow()
        with self._transaction(write=True) as connection:
            for chunk in _chunks(dict.fromkeys(keys)):
                connection.execute(update(RESULT_CACHE).where(
                    RESULT_CACHE.c.owner == owner, RESULT_CACHE.c.key.in_(chunk),
                    RESULT_CACHE.c.used_at < now - TOUCH_RESOLUTION).values(used_at=now))

    def forget_job_cache(self, job_id: str) -> list[CacheEntry]:
        """Remove the entries `job_id` computed; returns them (their objects are the caller's to delete)."""
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
            for chunk in _chunks(victims):
                removed += [_entry(row) for row in connection.execute(delete(RESULT_CACHE).where(
                    tuple_(RESULT_CACHE.c.owner, RESULT_CACHE.c.key).in_(chunk)).returning(*RESULT_CACHE.c))]
        return removed


def _upsert_postgres(connection: Connection, rows: list[dict[str, Any]]) -> None:
    """The rows COPYed into a temporary table, then upserted from it in one statement: an
    executemany of an upsert costs psycopg2 a round trip per row (~15 s for 100,000 answers),
    and multi-row VALUES are built row by row in Python (``execute_values``: ~3 s)."""
    columns = ", ".join(_COLUMNS)
    replaced = ", ".join(f"{name} = EXCLUDED.{name}" for name in _REPLACED)
    text = "".join("\t".join(_copy_field(row[name]) for name in _COLUMNS) + "\n" for row in rows)
    with closing(connection.connection.cursor()) as cursor:
        cursor.execute(f"CREATE TEMPORARY TABLE _cache_fill ON COMMIT DROP AS "
                       f"SELECT {columns} FROM {RESULT_CACHE.name} WITH NO DATA")
        cursor.copy_expert(f"COPY _cache_fill ({columns}) FROM STDIN", io.StringIO(text))
        cursor.execute(f"INSERT INTO {RESULT_CACHE.name} ({columns}) SELECT {columns} FROM _cache_fill "
                       f"ON CONFLICT (owner, key) DO UPDATE SET {replaced}")


_COPY_ESCAPES = str.maketrans({"\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r"})


def _copy_field(value: Any) -> str:
    """``value`` in COPY's text format (``\\N`` for NULL)."""
    if value is None:
        return "\\N"
    if isinstance(value, datetime):
        return value.isoformat()  # aware (utcnow): timestamptz reads the offset
    return str(value).translate(_COPY_ESCAPES)
