"""What every repository of the job store shares: the engine of the store at a URL (opened
and migrated on the first call), one transaction per call, an INSERT that reports a taken id
as DuplicateId, and the checks of arguments they all make.

Each repository (``jobs``, ``progress``, ``files``, ``api_keys``, ``idempotency``,
``usage``, ``health``, ``webhooks``) is a ``Repository`` and works on its own; ``JobStore``
(``store.py``) is all of them over one engine.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any, TypeVar

from sqlalchemy import Column, Connection, Engine, Executable, Row, Table, insert
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import make_url
from sqlalchemy.exc import IntegrityError

from llm_batch.infra.jobstore.database import WRITE, make_engine, upgrade_to_head
from llm_batch.infra.jobstore.errors import DuplicateId

# Compare-and-set attempts before giving up; each lost race means another writer moved the
# row, so a handful is plenty.
CAS_ATTEMPTS = 20
T = TypeVar("T")


def utcnow() -> datetime:
    return datetime.now(UTC)


def require_aware(**values: datetime | None) -> None:
    """Refuse naive datetimes up front, naming the argument (they would be misread)."""
    for name, value in values.items():
        if value is not None and value.tzinfo is None:
            raise ValueError(f"{name}={value!r} is a naive datetime; pass a timezone-aware one")


def require_non_negative(values: Mapping[str, float]) -> None:
    """Counters are never negative: ValueError naming the first that is."""
    for name, value in values.items():
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")


def upsert(connection: Connection, table: Table):
    """INSERT ... ON CONFLICT for this connection's dialect (SQLite and PostgreSQL spell it alike)."""
    return (postgresql.insert if connection.dialect.name == "postgresql" else sqlite.insert)(table)


class Repository:
    """The store at `url` (SQLAlchemy URL: ``sqlite:///path`` or ``postgresql://...``).

    Construction is cheap and touches nothing; the first call opens the engine and runs
    the migrations to head. One instance is safe to share between threads.
    """

    def __init__(self, url: str):
        self.url = url
        self._engine: Engine | None = None
        self._writer: Engine | None = None
        self._lock = threading.Lock()
        _live_repositories.add(self)

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            with self._lock:
                if self._engine is None:
                    engine = make_engine(self.url)
                    upgrade_to_head(engine)
                    self._writer = engine.execution_options(**{WRITE: True})
                    self._engine = engine
        return self._engine

    def close(self) -> None:
        """Close pooled connections (the store reopens them if used again)."""
        if self._engine is not None:
            self._engine.dispose()

    @property
    def display_url(self) -> str:
        """The store's URL with the password masked (for messages)."""
        return make_url(self.url).render_as_string(hide_password=True)

    @contextmanager
    def _transaction(self, write: bool) -> Iterator[Connection]:
        engine = self.engine
        with (self._writer if write else engine).begin() as connection:
            yield connection

    def _read_one(self, query: Executable, snapshot: Callable[[Row], T]) -> T | None:
        """The snapshot of the one row `query` reads, None if it reads none."""
        with self._transaction(write=False) as connection:
            row = connection.execute(query).one_or_none()
        return snapshot(row) if row is not None else None

    def _read_all(self, query: Executable, snapshot: Callable[[Row], T]) -> list[T]:
        with self._transaction(write=False) as connection:
            return [snapshot(row) for row in connection.execute(query)]

    def _insert(self, table: Table, values: dict[str, Any], columns: Iterable[Column[Any]]) -> Row:
        try:
            with self._transaction(write=True) as connection:
                return connection.execute(insert(table).values(**values).returning(*columns)).one()
        except IntegrityError as exc:
            raise DuplicateId(f"{table.name}: id {values['id']!r} exists already") from exc

    def _job_moved(self, connection: Connection, before: Row, after: Row) -> None:
        """Called in the transaction of each job status move (a hook: the composition root
        adds what else a move does, so repositories need not import each other)."""


# A forked child (Airflow's LocalExecutor forks task processes) must not reuse its
# parent's pooled connections: drop them, without closing the parent's sockets.
_live_repositories: weakref.WeakSet[Repository] = weakref.WeakSet()


def _forget_connections_after_fork() -> None:
    for repository in list(_live_repositories):
        if repository._engine is not None:
            repository._engine.dispose(close=False)


os.register_at_fork(after_in_child=_forget_connections_after_fork)
