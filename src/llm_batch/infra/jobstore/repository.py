"""What every repository of the job store shares: the engine (opened and migrated on the
first call), one transaction per call, and the checks of arguments they all make."""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any, TypeVar

from sqlalchemy import Column, Connection, Engine, Executable, Row, Table, insert, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import IntegrityError

from llm_batch.core.jobs import JobStatus
from llm_batch.core.snapshots import Job
from llm_batch.infra.jobstore.database import WRITE, make_engine, upgrade_to_head
from llm_batch.infra.jobstore.errors import DuplicateId, JobNotFound
from llm_batch.infra.jobstore.models import JOBS
from llm_batch.infra.jobstore.paging import owned

# Each lost compare-and-set race means another writer moved the row: a handful is plenty.
CAS_ATTEMPTS = 20
T = TypeVar("T")
LIVE_STATUSES = [s.value for s in JobStatus if not s.terminal]
ENDED_STATUSES = [s.value for s in JobStatus if s.terminal]


def job_snapshot(row: Row) -> Job:
    values = row._asdict()
    values["status"] = JobStatus(values["status"])
    return Job(**values)


def utcnow() -> datetime:
    return datetime.now(UTC)


def require_aware(**values: datetime | None) -> None:
    """Refuse naive datetimes up front, naming the argument (they would be misread)."""
    for name, value in values.items():
        if value is not None and value.tzinfo is None:
            raise ValueError(f"{name}={value!r} is a naive datetime; pass a timezone-aware one")


def require_non_negative(values: Mapping[str, float]) -> None:
    for name, value in values.items():
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")


def from_row(cls: Callable[..., T]) -> Callable[[Row], T]:
    """The converter of a result row to `cls`, whose fields are the row's column names."""
    return lambda row: cls(**row._asdict())


def upsert(connection: Connection, table: Table):
    """INSERT ... ON CONFLICT for this connection's dialect (both spell it alike)."""
    return (postgresql.insert if connection.dialect.name == "postgresql" else sqlite.insert)(table)


class Repository:
    """The store at `url` (``sqlite:///path`` or ``postgresql://...``): construction touches
    nothing, the first call opens the engine and migrates; safe to share between threads."""

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
        """Close pooled connections (reopened if used again)."""
        if self._engine is not None:
            self._engine.dispose()

    @contextmanager
    def _transaction(self, write: bool) -> Iterator[Connection]:
        engine = self.engine
        with (self._writer if write else engine).begin() as connection:
            yield connection

    def _read_one(self, query: Executable, snapshot: Callable[[Row], T]) -> T | None:
        with self._transaction(write=False) as connection:
            row = connection.execute(query).one_or_none()
        return snapshot(row) if row is not None else None

    def _read_all(self, query: Executable, snapshot: Callable[[Row], T]) -> list[T]:
        with self._transaction(write=False) as connection:
            return [snapshot(row) for row in connection.execute(query)]

    def _insert(
        self, table: Table, values: dict[str, Any], columns: Iterable[Column[Any]], taken: DuplicateId | None = None
    ) -> Row:
        """The row inserted; `taken` (default: a DuplicateId naming the id) if its key is taken."""
        try:
            with self._transaction(write=True) as connection:
                return connection.execute(insert(table).values(**values).returning(*columns)).one()
        except IntegrityError as exc:
            raise taken or DuplicateId(f"{table.name}: id {values['id']!r} exists already") from exc

    def _stamp_once(
        self, table: Table, column: str, row_id: str, owner: str | None, columns: Iterable[Column[Any]],
        missing: LookupError,
    ) -> Row:
        """Set `column` of the row to now unless it is set (repeating is harmless); `missing` if no such row."""
        with self._transaction(write=True) as connection:
            connection.execute(
                update(table).where(*owned(table, row_id, owner), table.c[column].is_(None)).values({column: utcnow()})
            )
            row = connection.execute(select(*columns).where(*owned(table, row_id, owner))).one_or_none()
        if row is None:
            raise missing
        return row

    def _update_job(self, job_id: str, owner: str | None = None, **values: Any) -> Job:
        """Set `values` (and updated_at) on the job (of `owner` if given); JobNotFound if none."""
        with self._transaction(write=True) as connection:
            updated = connection.execute(
                update(JOBS).where(*owned(JOBS, job_id, owner)).values(**values, updated_at=utcnow()).returning(*JOBS.c)
            ).one_or_none()
        if updated is None:
            raise JobNotFound(f"no job {job_id!r}")
        return job_snapshot(updated)

    def _job_moved(self, connection: Connection, before: Row, after: Row) -> None:
        """A hook in each job status move's transaction: the composition root adds what else a
        move does, so repositories need not import each other."""


# A forked child (Airflow's LocalExecutor forks task processes) must not reuse its
# parent's pooled connections: drop them, without closing the parent's sockets.
_live_repositories: weakref.WeakSet[Repository] = weakref.WeakSet()


def _forget_connections_after_fork() -> None:
    for repository in list(_live_repositories):
        if repository._engine is not None:
            repository._engine.dispose(close=False)


os.register_at_fork(after_in_child=_forget_connections_after_fork)
