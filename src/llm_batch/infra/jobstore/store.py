"""JobStore: the repository of jobs, file objects and API keys.

Every public method is one transaction and returns snapshots (``snapshots.Job`` etc.),
never live ORM objects. Getters return None for an unknown (or not-owned) id; mutators
raise ``JobNotFound`` / ``FileNotFound`` / ``ApiKeyNotFound``. ``owner=None`` means "any
owner" (admins, the DAG); a given owner restricts the call to that owner's rows, so
someone else's id looks exactly like a missing one.

Statements are SQLAlchemy Core on the models' tables: a snapshot's fields are exactly its
table's column names, so a result row becomes a snapshot directly, and every update is a
single ``UPDATE ... RETURNING``.

Concurrency: status moves are compare-and-set (``UPDATE ... WHERE id=? AND status=?``,
re-read and retried when another writer won), counters are SQL increments, so many shard
workers and API callers can update one job at once without losing anything.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import math
import os
import secrets
import sqlite3
import threading
import uuid
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from functools import lru_cache
from pathlib import Path
from typing import Any

from sqlalchemy import (
    Column,
    Connection,
    Engine,
    Row,
    Table,
    and_,
    case,
    create_engine,
    delete,
    func,
    insert,
    select,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.pool import NullPool
from sqlalchemy.sql.elements import ColumnElement

from llm_batch.core import owners
from llm_batch.core.endpoints import parse_endpoint
from llm_batch.core.jobs import JobStatus, check_transition
from llm_batch.infra.jobstore.database import VERSION_TABLE, WRITE, make_engine, upgrade_to_head
from llm_batch.infra.jobstore.errors import (
    ApiKeyNotFound,
    ConcurrentUpdate,
    DuplicateId,
    FileNotFound,
    JobNotFound,
    JobStoreError,
    JobStoreUnhealthy,
)
from llm_batch.infra.jobstore.models import (
    ApiKeyRow,
    FileRow,
    IdempotencyKeyRow,  # idempotency keys
    JobRow,
    ProgressHistoryRow,
    ShardProgressRow,
)
from llm_batch.infra.jobstore.paging import owned, page
from llm_batch.infra.jobstore.snapshots import DIALECTS, FILE_KINDS, ApiKey, FileObject, Job, ShardRecord
from llm_batch.infra.jobstore.webhooks import ENDPOINTS, WebhookStoreMixin  # webhooks (outbox, endpoints, attempts)

MAX_PAGE_SIZE = 1000
# Compare-and-set attempts before giving up; each lost race means another writer moved the
# job, so a handful is plenty.
_CAS_ATTEMPTS = 20
API_KEY_PREFIX = "lbk_"
_API_KEY_LOOKUP_CHARS = 12  # stored in clear: finds the row, reveals nothing useful

# The timestamps a status sets when it is entered (each only if still unset, so a
# repeated or resumed step never moves them).
_STATUS_TIMESTAMPS: dict[JobStatus, tuple[str, ...]] = {
    JobStatus.QUEUED: (),
    JobStatus.VALIDATING: ("started_at",),
    JobStatus.RUNNING: ("started_at", "in_progress_at"),
    JobStatus.FINALIZING: ("finalizing_at",),
    JobStatus.CANCELLING: ("cancel_requested_at", "cancelling_at"),
    JobStatus.SUCCEEDED: ("completed_at",),
    JobStatus.FAILED: ("failed_at", "completed_at"),
    JobStatus.TIMEOUT_EXCEEDED: ("expired_at", "completed_at"),
    JobStatus.CANCELLED: ("cancelled_at", "completed_at"),
}
_JOB_ORDER_COLUMNS = {"created_at", "updated_at", "priority"}
_FILE_ORDER_COLUMNS = {"created_at"}
_COUNTERS = ("total", "completed", "succeeded", "failed")
# A shard row's counters: each only moves up (a stale report cannot lower it).
_SHARD_COUNTERS = ("total", "done", "succeeded", "failed", "prompt_tokens", "completion_tokens",
                   "cached_prompt_tokens", "engine_seconds")
_LIVE_SHARD_STATES = ("starting", "running")


# How long check_health waits to connect, for the write lock and for each statement.
HEALTH_TIMEOUT_S = 5.0


def utcnow() -> datetime:
    return datetime.now(UTC)


def new_job_id() -> str:
    return f"job_{uuid.uuid4().hex}"


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex}"


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


JOBS: Table = JobRow.__table__
FILES: Table = FileRow.__table__
API_KEYS: Table = ApiKeyRow.__table__
SHARDS: Table = ShardProgressRow.__table__
HISTORY: Table = ProgressHistoryRow.__table__

# Progress history (the UI's plots): a point per job at most every HISTORY_INTERVAL_S,
# thinned (every second point of the older half dropped) above MAX_HISTORY_POINTS.
HISTORY_INTERVAL_S = 5.0
MAX_HISTORY_POINTS = 500


@dataclasses.dataclass(frozen=True, slots=True)
class ProgressPoint:
    """A job's live counts and tokens/s at one instant (a progress_history row)."""

    job_id: str
    at: datetime
    total: int
    completed: int
    succeeded: int
    failed: int
    completion_tokens: int
    tokens_per_s: float
# The columns a snapshot is made of (an API key's sha256 never leaves the store).
_API_KEY_COLUMNS = [API_KEYS.c[f.name] for f in dataclasses.fields(ApiKey)]


def _job(row: Row) -> Job:
    values = row._asdict()
    values["status"] = JobStatus(values["status"])
    return Job(**values)


def _file(row: Row) -> FileObject:
    return FileObject(**row._asdict())


def _api_key(row: Row) -> ApiKey:
    return ApiKey(**row._asdict())


def _upsert(connection: Connection, table: Table):
    """INSERT ... ON CONFLICT for this connection's dialect (SQLite and PostgreSQL spell it alike)."""
    return (postgresql.insert if connection.dialect.name == "postgresql" else sqlite.insert)(table)


def _live_from_rows(job: Row, sums: Row) -> dict[str, Any]:
    """The job's live counts and usage from the sum of its shard rows (`sums`) on top of
    its invalid lines, never lower than what it shows (`job`). The three counts move
    together, and only when the new sum is at least the old in each (so succeeded + failed
    == completed holds at every moment); the other figures move up one by one."""
    counts = {"completed": job.invalid + sums.done, "succeeded": sums.succeeded, "failed": job.invalid + sums.failed}
    values: dict[str, Any] = counts if all(counts[k] >= job._mapping[k] for k in counts) else {}
    for name in ("prompt_tokens", "completion_tokens", "cached_prompt_tokens", "engine_seconds"):
        values[name] = max(job._mapping[name] or 0, sums._mapping[name])
    values["tokens_per_s"] = round(float(sums.tokens_per_s), 1)
    return values


def _thinned_out(instants: list[datetime], keep: int) -> list[datetime]:
    """The instants to drop so that about `keep` remain, evenly spaced over the whole span:
    the first and last are kept, and each other one only if at least span/keep after the
    last one kept (older points, already sparse, stay; dense recent ones go)."""
    if len(instants) <= 2 or keep < 2:
        return []
    step = (instants[-1] - instants[0]) / keep
    kept = instants[0]
    dropped = []
    for instant in instants[1:-1]:
        if instant - kept >= step and instants[-1] - instant >= step / 2:
            kept = instant
        else:
            dropped.append(instant)
    return dropped


def _require_non_negative(values: Mapping[str, float]) -> None:
    """Counters are never negative: ValueError naming the first that is."""
    for name, value in values.items():
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")


def _require_aware(**values: datetime | None) -> None:
    """Refuse naive datetimes up front, naming the argument (they would be misread)."""
    for name, value in values.items():
        if value is not None and value.tzinfo is None:
            raise ValueError(f"{name}={value!r} is a naive datetime; pass a timezone-aware one")


def _check_page(limit: int, offset: int) -> None:
    if not 1 <= limit <= MAX_PAGE_SIZE:
        raise ValueError(f"limit must be between 1 and {MAX_PAGE_SIZE}, got {limit}")
    if offset < 0:
        raise ValueError(f"offset must be >= 0, got {offset}")


def _order(table: Table, order_by: str, allowed: set[str]) -> tuple[Column[Any], bool]:
    """The column and direction (descending?) named by ``[-]column``."""
    descending = order_by.startswith("-")
    name = order_by.lstrip("-+")
    if name not in allowed:
        raise ValueError(f"cannot order by {order_by!r}; use one of {sorted(allowed)} (prefix - for descending)")
    return table.c[name], descending


def _entering(row: Row, status: JobStatus, reason: str | None) -> dict[str, Any]:
    """The column values of moving `row` into `status`: the status, its still-unset
    timestamps, and the reason if one is given."""
    now = utcnow()
    values: dict[str, Any] = {"status": status.value}
    values.update({ts: now for ts in _STATUS_TIMESTAMPS[status] if getattr(row, ts) is None})
    if reason is not None:
        values["status_reason"] = reason
    return values


# JobStore.usage: what it groups by, and the groups that are not a value of the column.
USAGE_GROUPINGS = ("owner", "model", "label")
USAGE_ALL_GROUP = "(all)"  # by=None: one row over every job
USAGE_NO_LABELS_GROUP = "(none)"  # by="label": the jobs without labels


@dataclasses.dataclass(frozen=True)
class UsageRow:
    """JobStore.usage: the sums over one group's jobs (any status; live jobs with their live
    counts). ``gpu_seconds``: each job's engine seconds x its GPUs (see JobStore.usage)."""

    group: str
    jobs: int = 0
    requests_total: int = 0
    requests_succeeded: int = 0
    requests_failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0  # jobs whose count is unknown (None) add 0
    reasoning_tokens: int = 0
    engine_seconds: float = 0.0
    gpu_seconds: float = 0.0


class JobStore(WebhookStoreMixin):  # webhooks: src/llm_batch/infra/jobstore/webhooks.py
    """The job store at `url` (SQLAlchemy URL: ``sqlite:///path`` or ``postgresql://...``).

    Construction is cheap and touches nothing; the first call opens the engine and runs
    the migrations to head. One instance is safe to share between threads.
    """

    def __init__(self, url: str):
        self.url = url
        self._engine: Engine | None = None
        self._writer: Engine | None = None
        self._lock = threading.Lock()
        self.history_interval_s = HISTORY_INTERVAL_S
        self.max_history_points = MAX_HISTORY_POINTS
        _live_stores.add(self)

    # -- plumbing ---------------------------------------------------------------------

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

    def check_health(self, timeout: float = HEALTH_TIMEOUT_S, open_store: bool = True) -> None:
        """Read and write the store through a NEW connection; raise JobStoreUnhealthy if
        that fails (returns None when healthy).

        A new connection, not the pool: a pooled connection can keep working on a store
        that no new connection can open (a SQLite ``-wal`` file replaced by garbage: every
        new connection fails while the old ones answer from what they hold), and every
        worker and API process opens new connections. The probe:

        - SQLite: opened with ``mode=rw`` (a missing file is an error, never a new empty
          store) and a busy timeout of `timeout`; ``BEGIN IMMEDIATE`` takes the write lock,
          which needs the database, its ``-wal`` and ``-shm`` files writable.
        - PostgreSQL: ``connect_timeout``, then ``statement_timeout`` and ``lock_timeout``
          of `timeout` (a server that hangs or a table locked too long is unhealthy).
        - Both: read the schema's version and one job id (the tables are there and
          readable), then write: INSERT an API key row and roll the transaction back. A
          real table, so a read-only server (hot standby, ``default_transaction_read_only``)
          or a user without INSERT rights fails here, which a temp table would not show;
          rolled back, so nothing is ever kept (no heartbeat table, no migration). The row
          is inert even if it were kept: already revoked, a hash no key has. A new unique id
          each time, so concurrent checks never wait on each other's uncommitted row.
          (On SQLite a rolled-back write stays in the page cache: a full disk is not seen
          until a real commit; the write lock above is the part that touches the files.)

        ``open_store``: first open the store as any other call does (``engine``: creates and
        migrates it on the first call, nothing after; not bound by `timeout`), so a server's
        first request may be a health check. False (``llm-batch status``): the probe only,
        which never creates or migrates a store (a missing or unmigrated one is unhealthy).
        """
        step, probe = "open", None
        try:
            if open_store:
                self.engine  # noqa: B018 - opens and migrates once
            step = "connect"
            probe = _probe_engine(self.url, timeout)
            with probe.connect() as connection:
                if connection.dialect.name == "sqlite":
                    step = "take the write lock (BEGIN IMMEDIATE)"
                    connection.exec_driver_sql("BEGIN IMMEDIATE")
                else:
                    millis = max(1, int(timeout * 1000))
                    connection.exec_driver_sql(f"SET LOCAL statement_timeout = {millis}")
                    connection.exec_driver_sql(f"SET LOCAL lock_timeout = {millis}")
                step = "read"
                if connection.exec_driver_sql(f"SELECT version_num FROM {VERSION_TABLE}").first() is None:
                    raise JobStoreError(f"{VERSION_TABLE} is empty: the store was never migrated")
                connection.execute(select(JOBS.c.id).limit(1)).all()
                step = "write (rolled back)"
                connection.execute(insert(API_KEYS).values(**_health_probe_key()))
                connection.rollback()
        except Exception as exc:  # noqa: BLE001 - any failure means unhealthy: say which
            raise JobStoreUnhealthy(f"{self.display_url}: {step} failed: {_describe(exc)}") from exc
        finally:
            if probe is not None:
                probe.dispose()

    @contextmanager
    def _transaction(self, write: bool) -> Iterator[Connection]:
        engine = self.engine
        with (self._writer if write else engine).begin() as connection:
            yield connection

    def _compare_and_set(
        self, job_id: str, changes: Callable[[Row], dict[str, Any] | None], owner: str | None = None
    ) -> Job:
        """Apply ``changes(row)`` (None = nothing to do) only if the status is still the one
        it was computed from; re-read and recompute when another writer moved it first."""
        for _ in range(_CAS_ATTEMPTS):
            with self._transaction(write=True) as connection:
                row = connection.execute(select(JOBS).where(*owned(JOBS, job_id, owner))).one_or_none()
                if row is None:
                    raise JobNotFound(f"no job {job_id!r}")
                values = changes(row)
                if values is None:
                    return _job(row)
                updated = connection.execute(
                    update(JOBS)
                    .where(JOBS.c.id == job_id, JOBS.c.status == row.status)
                    .values(**values, updated_at=utcnow())
                    .returning(*JOBS.c)
                ).one_or_none()
                if updated is not None:
                    # Webhooks: a job's end writes its outbox rows in this same transaction.
                    self._enqueue_job_end(connection, row, updated)
                    return _job(updated)
        raise ConcurrentUpdate(f"job {job_id!r}: status kept changing under {_CAS_ATTEMPTS} attempts")

    def _update_job(self, job_id: str, owner: str | None = None, **values: Any) -> Job:
        with self._transaction(write=True) as connection:
            updated = connection.execute(
                update(JOBS).where(*owned(JOBS, job_id, owner)).values(**values, updated_at=utcnow()).returning(*JOBS.c)
            ).one_or_none()
            if updated is None:
                raise JobNotFound(f"no job {job_id!r}")
            return _job(updated)

    def _insert(self, table: Table, values: dict[str, Any], columns: Iterable[Column[Any]]) -> Row:
        try:
            with self._transaction(write=True) as connection:
                return connection.execute(insert(table).values(**values).returning(*columns)).one()
        except IntegrityError as exc:
            raise DuplicateId(f"{table.name}: id {values['id']!r} exists already") from exc

    # -- jobs -------------------------------------------------------------------------

    def create_job(
        self,
        *,
        dialect: str,
        endpoint: str,
        model: str,
        owner: str,
        input: dict[str, Any] | None = None,
        input_format: str | None = None,
        model_config: dict[str, Any] | None = None,
        output_uri: str | None = None,
        array_output_uri: str | None = None,
        metadata: dict[str, Any] | None = None,
        labels: dict[str, Any] | None = None,
        priority: int = 0,
        data_parallelism: int = 1,
        resources: dict[str, Any] | None = None,
        max_runtime_sec: int | None = None,
        expires_at: datetime | None = None,
        dag_run_id: str | None = None,
        id: str | None = None,
        created_at: datetime | None = None,
    ) -> Job:
        """Insert a QUEUED job and return it.

        ``id`` defaults to ``job_<uuid4 hex>``; an id already taken raises DuplicateId.
        ``expires_at`` defaults to created_at + max_runtime_sec when that is given.
        ``endpoint`` must be a supported endpoint, ``dialect`` one of DIALECTS.
        """
        if dialect not in DIALECTS:
            raise ValueError(f"dialect {dialect!r} is unknown; use one of {', '.join(DIALECTS)}")
        endpoint = parse_endpoint(endpoint).value
        if data_parallelism < 1:
            raise ValueError(f"data_parallelism must be >= 1, got {data_parallelism}")
        if max_runtime_sec is not None and max_runtime_sec < 1:
            raise ValueError(f"max_runtime_sec must be >= 1, got {max_runtime_sec}")
        _require_aware(created_at=created_at, expires_at=expires_at)
        created_at = created_at or utcnow()
        if expires_at is None and max_runtime_sec is not None:
            expires_at = created_at + timedelta(seconds=max_runtime_sec)
        values = dict(
            id=id or new_job_id(),
            dialect=dialect,
            endpoint=endpoint,
            model=model,
            owner=owner,
            input=input or {},
            input_format=input_format,
            model_config=model_config or {},
            output_uri=output_uri,
            array_output_uri=array_output_uri,
            metadata=metadata or {},
            labels=labels or {},
            priority=priority,
            data_parallelism=data_parallelism,
            resources=resources or {},
            max_runtime_sec=max_runtime_sec,
            expires_at=expires_at,
            dag_run_id=dag_run_id,
            status=JobStatus.QUEUED.value,
            created_at=created_at,
            updated_at=created_at,
            errors=[],
            total=0,
            completed=0,
            succeeded=0,
            failed=0,
        )
        return _job(self._insert(JOBS, values, JOBS.c))

    def get_job(self, job_id: str, owner: str | None = None) -> Job | None:
        """The job, or None if it does not exist or belongs to another owner."""
        with self._transaction(write=False) as connection:
            row = connection.execute(select(JOBS).where(*owned(JOBS, job_id, owner))).one_or_none()
            return _job(row) if row is not None else None

    def list_jobs(
        self,
        owner: str | None = None,
        statuses: Iterable[JobStatus | str] | None = None,
        model: str | None = None,
        metadata: Mapping[str, str] | None = None,
        created_after: datetime | None = None,
        dialect: str | None = None,
        expires_before: datetime | None = None,
        order_by: str = "-created_at",
        limit: int = 100,
        offset: int = 0,
        after: str | None = None,
    ) -> tuple[list[Job], int]:
        """One page of jobs matching every given filter, and how many match in all.

        ``metadata`` matches jobs whose metadata has each key with that (string) value.
        ``order_by`` is ``[-]created_at|updated_at|priority`` (ties broken by id).
        Paginate with ``offset`` or with ``after`` = the last job id of the previous page
        (keyset: stable while new jobs arrive); an unknown ``after`` raises InvalidCursor.
        ``total`` ignores limit, offset and after.
        """
        _check_page(limit, offset)
        _require_aware(created_after=created_after, expires_before=expires_before)
        order = _order(JOBS, order_by, _JOB_ORDER_COLUMNS)
        c = JOBS.c
        filters: list[ColumnElement[bool]] = []
        if owner is not None:
            filters.append(c.owner == owner)
        if statuses is not None:
            filters.append(c.status.in_([JobStatus(s).value for s in statuses]))
        if model is not None:
            filters.append(c.model == model)
        if dialect is not None:
            filters.append(c.dialect == dialect)
        if created_after is not None:
            filters.append(c.created_at > created_after)
        if expires_before is not None:
            filters.append(c.expires_at < expires_before)
        for key, value in (metadata or {}).items():
            filters.append(c.metadata[key].as_string() == str(value))
        with self._transaction(write=False) as connection:
            rows, total = page(connection, JOBS, filters, order, limit, offset, after, owner=owner)
            return [_job(r) for r in rows], total

    def transition(self, job_id: str, new_status: JobStatus | str, reason: str | None = None) -> Job:
        """Move the job to `new_status` (atomically; see check_transition for legal moves).

        Sets the status's timestamps if unset (see _STATUS_TIMESTAMPS) and the reason if
        given. Moving to the status it has already is a no-op returning the job (so a
        retried step is harmless); a terminal status is never left (InvalidTransition).
        """
        new = JobStatus(new_status)

        def changes(row: Row) -> dict[str, Any] | None:
            current = JobStatus(row.status)
            check_transition(current, new)
            if current == new:
                return None
            return _entering(row, new, reason)

        return self._compare_and_set(job_id, changes)

    def end_job(self, job_id: str, status: JobStatus | str, reason: str | None = None) -> Job:
        """End a live job in the terminal `status` (with its timestamps and `reason`); a job
        that has ended already is returned as it ended. Race-free, unlike reading the job
        and then calling transition: meant for failure callbacks, expiry and reconciling."""
        final = JobStatus(status)
        if not final.terminal:
            raise ValueError(f"end_job needs a terminal status, got {final}")

        def changes(row: Row) -> dict[str, Any] | None:
            if JobStatus(row.status).terminal:
                return None
            return _entering(row, final, reason)

        return self._compare_and_set(job_id, changes)

    def request_cancel(self, job_id: str, owner: str | None = None, reason: str | None = None) -> Job:
        """Ask a live job to stop: sets cancel_requested_at and moves it to CANCELLING.

        A job already CANCELLING or terminal is returned unchanged (cancel is idempotent
        and never rewrites how a job ended). Workers notice through the cancel marker
        their runner mirrors from this flag (llm_batch.pipeline.shard_task).
        """

        def changes(row: Row) -> dict[str, Any] | None:
            current = JobStatus(row.status)
            if current.terminal or current == JobStatus.CANCELLING:
                return None
            return _entering(row, JobStatus.CANCELLING, reason or "cancel requested")

        return self._compare_and_set(job_id, changes, owner)

    def set_counts(
        self,
        job_id: str,
        *,
        total: int | None = None,
        completed: int | None = None,
        succeeded: int | None = None,
        failed: int | None = None,
        invalid: int | None = None,
    ) -> Job:
        """Overwrite the given counters (None leaves one as it is). ``invalid``: the lines
        that failed validation, the base of the live counts (see report_shard)."""
        given = (total, completed, succeeded, failed, invalid)
        values = {k: v for k, v in zip((*_COUNTERS, "invalid"), given) if v is not None}
        _require_non_negative(values)
        return self._update_job(job_id, **values)

    def report_shard(
        self,
        job_id: str,
        shard: int,
        *,
        state: str,
        total: int = 0,
        done: int = 0,
        succeeded: int = 0,
        failed: int = 0,
        prompt_tokens: int = 0,
        completion_tokens: int = 0,
        cached_prompt_tokens: int = 0,
        engine_seconds: float = 0.0,
        reason: str | None = None,
    ) -> Job:
        """Record one shard's progress (and, with `reason`, its task's outcome) in its row,
        then set the job's live counts and usage from the sum of its rows: one transaction,
        O(1) in the number of shards for the caller.

        Each counter of the row only moves up (a stale report cannot lower it); ``state``
        and ``reason`` are the latest report's. The job row is locked first (``FOR UPDATE``
        on PostgreSQL; SQLite's write lock), so reports of one job are serialized and every
        sum sees the rows the others committed: no watcher's report is lost, and the job's
        counts never go down (see _live_from_rows). A job that has ended is returned as it
        ended, its row left alone (its counts are the merge's, final).
        """
        given = dict(total=total, done=done, succeeded=succeeded, failed=failed, prompt_tokens=prompt_tokens,
                     completion_tokens=completion_tokens, cached_prompt_tokens=cached_prompt_tokens,
                     engine_seconds=engine_seconds)
        _require_non_negative(given)
        with self._transaction(write=True) as connection:
            job = connection.execute(select(JOBS).where(JOBS.c.id == job_id).with_for_update()).one_or_none()
            if job is None:
                raise JobNotFound(f"no job {job_id!r}")
            if JobStatus(job.status).terminal:
                return _job(job)
            now = utcnow()
            upsert = _upsert(connection, SHARDS).values(job_id=job_id, shard=shard, state=state, reason=reason,
                                                         updated_at=now, **given)
            new = upsert.excluded
            connection.execute(upsert.on_conflict_do_update(
                index_elements=[SHARDS.c.job_id, SHARDS.c.shard],
                set_={**{name: case((SHARDS.c[name] < new[name], new[name]), else_=SHARDS.c[name])
                         for name in _SHARD_COUNTERS},
                      "state": new.state, "reason": new.reason, "updated_at": new.updated_at},
            ))
            c = SHARDS.c
            # Output tokens per engine second of each shard still running, summed.
            rate = case((and_(c.state.in_(_LIVE_SHARD_STATES), c.engine_seconds > 0),
                         c.completion_tokens / c.engine_seconds), else_=0.0)
            sums = connection.execute(
                select(*(func.coalesce(func.sum(c[name]), 0).label(name) for name in _SHARD_COUNTERS),
                       func.coalesce(func.sum(rate), 0).label("tokens_per_s"))
                .where(c.job_id == job_id)
            ).one()
            updated = connection.execute(
                update(JOBS).where(JOBS.c.id == job_id).values(**_live_from_rows(job, sums), updated_at=now)
                .returning(*JOBS.c)
            ).one()
            self._append_history(connection, updated, now)
            return _job(updated)

    def _append_history(self, connection: Connection, job: Row, now: datetime) -> None:
        """A history point of `job` (inside report_shard's transaction, which holds the job's
        lock: appends of one job are serialized) unless its last point is younger than
        ``history_interval_s``; above ``max_history_points`` the series is thinned to about half
        that, evenly over the whole run (``_thinned_out``), so a long job keeps an even picture
        of its whole run, not a sharp recent end and a blurred start."""
        h = HISTORY.c
        last = connection.execute(select(h.at).where(h.job_id == job.id).order_by(h.at.desc()).limit(1)).scalar()
        if last is not None and (last >= now or now - last < timedelta(seconds=self.history_interval_s)):
            return
        connection.execute(insert(HISTORY).values(
            job_id=job.id, at=now, total=job.total, completed=job.completed, succeeded=job.succeeded,
            failed=job.failed, completion_tokens=job.completion_tokens, tokens_per_s=job.tokens_per_s))
        count = connection.execute(select(func.count()).where(h.job_id == job.id)).scalar_one()
        if count > self.max_history_points:
            instants = connection.execute(select(h.at).where(h.job_id == job.id).order_by(h.at)).scalars().all()
            dropped = _thinned_out(instants, self.max_history_points // 2)
            connection.execute(delete(HISTORY).where(h.job_id == job.id, h.at.in_(dropped)))

    def progress_history(self, job_id: str, owner: str | None = None) -> list[ProgressPoint]:
        """The job's progress history, oldest first (empty for an unknown or not-owned job,
        or one no shard reported on yet)."""
        with self._transaction(write=False) as connection:
            if connection.execute(select(JOBS.c.id).where(*owned(JOBS, job_id, owner))).one_or_none() is None:
                return []
            rows = connection.execute(select(HISTORY).where(HISTORY.c.job_id == job_id).order_by(HISTORY.c.at))
            return [ProgressPoint(**r._asdict()) for r in rows]

    def shard_records(self, job_id: str) -> list[ShardRecord]:
        """The job's shard rows, by shard index (empty before any shard reported)."""
        with self._transaction(write=False) as connection:
            rows = connection.execute(select(SHARDS).where(SHARDS.c.job_id == job_id).order_by(SHARDS.c.shard))
            return [ShardRecord(**r._asdict()) for r in rows]

    def set_usage(
        self,
        job_id: str,
        *,
        prompt_tokens: int,
        completion_tokens: int,
        cached_prompt_tokens: int | None,
        reasoning_tokens: int,
    ) -> Job:
        """Overwrite the job's token counts (the merge's exact sums over the output lines;
        cached None = unknown)."""
        return self._update_job(job_id, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                                cached_prompt_tokens=cached_prompt_tokens, reasoning_tokens=reasoning_tokens)

    def add_counts(
        self, job_id: str, *, total: int = 0, completed: int = 0, succeeded: int = 0, failed: int = 0
    ) -> Job:
        """Add to the counters atomically in SQL (``completed = completed + n``): safe when
        many workers report at once."""
        deltas = dict(zip(_COUNTERS, (total, completed, succeeded, failed)))
        return self._update_job(job_id, **{name: JOBS.c[name] + delta for name, delta in deltas.items() if delta})

    def set_outputs(
        self,
        job_id: str,
        *,
        output_uri: str | None = None,
        array_output_uri: str | None = None,
        output_file_id: str | None = None,
        error_file_id: str | None = None,
        errors: list[dict[str, Any]] | None = None,
    ) -> Job:
        """Record where the results went and the error summary ([{code, message, count}]).
        Arguments left None are left unchanged."""
        given = {
            "output_uri": output_uri,
            "array_output_uri": array_output_uri,
            "output_file_id": output_file_id,
            "error_file_id": error_file_id,
            "errors": errors,
        }
        return self._update_job(job_id, **{k: v for k, v in given.items() if v is not None})

    def set_priority(self, job_id: str, priority: int, owner: str | None = None) -> Job:
        return self._update_job(job_id, owner, priority=priority)

    def set_dag_run(self, job_id: str, dag_run_id: str) -> Job:
        return self._update_job(job_id, dag_run_id=dag_run_id)

    def delete_job(self, job_id: str, owner: str | None = None) -> None:
        """Remove an ended job's record (JobNotFound if unknown, someone else's, or live:
        a live job is cancelled first, never deleted under its run)."""
        terminal = [s.value for s in JobStatus if s.terminal]
        with self._transaction(write=True) as connection:
            deleted = connection.execute(delete(JOBS).where(*owned(JOBS, job_id, owner), JOBS.c.status.in_(terminal)))
            if deleted.rowcount != 1:
                raise JobNotFound(f"no ended job {job_id!r}")
            connection.execute(delete(SHARDS).where(SHARDS.c.job_id == job_id))
            connection.execute(delete(HISTORY).where(HISTORY.c.job_id == job_id))

    def jobs_writing(self, array_output_uri: str) -> list[Job]:
        """Every job (any owner, any status) whose results go to this user path."""
        with self._transaction(write=False) as connection:
            rows = connection.execute(select(JOBS).where(JOBS.c.array_output_uri == array_output_uri))
            return [_job(r) for r in rows]

    def owner_usage(self, owner: str) -> dict[str, int]:
        """What `owner` holds now: live jobs, their requests (known totals) and the bytes of
        their stored files that are not deleted (the per-owner limits' measures)."""
        live = [s.value for s in JobStatus if not s.terminal]
        with self._transaction(write=False) as connection:
            jobs, requests = connection.execute(
                select(func.count(), func.coalesce(func.sum(JOBS.c.total), 0))
                .where(JOBS.c.owner == owner, JOBS.c.status.in_(live))
            ).one()
            stored = connection.execute(
                select(func.coalesce(func.sum(FILES.c.bytes), 0))
                .where(FILES.c.owner == owner, FILES.c.deleted_at.is_(None))
            ).scalar_one()
        return {"live_jobs": int(jobs), "requests_in_flight": int(requests), "file_bytes": int(stored)}

    def usage(
        self, by: str | None = None, since: datetime | None = None, owner: str | None = None
    ) -> list[UsageRow]:
        """Usage summed over jobs created at or after `since` (every job when None), of
        `owner` when given, whatever their status: jobs, requests (total, succeeded,
        failed), tokens, engine seconds and GPU seconds.

        ``by``: None -> one row, group ``(all)`` (zeros when no job matches); ``owner`` or
        ``model`` -> one row per value (summed in SQL); ``label`` -> one row per label
        ``key=value`` a job has: a job with two labels counts in both rows, a job without
        labels in the row ``(none)`` (labels are JSON: summed in Python over the streamed
        rows, keeping only the per-group sums). Rows are ordered by group.

        GPU seconds of a job: its engine seconds x the ``gpus`` in its resources, 1 when it
        names none (what every shard is planned with). A job recorded with ``gpus: 0`` (a CPU
        run) adds 0; the store does not record the device a shard ran on, so a CPU run
        planned with the default counts as 1 GPU.
        """
        if by is not None and by not in USAGE_GROUPINGS:
            raise ValueError(f"cannot group usage by {by!r}; use one of {', '.join(USAGE_GROUPINGS)} (or none)")
        _require_aware(since=since)
        c = JOBS.c
        filters: list[ColumnElement[bool]] = []
        if since is not None:
            filters.append(c.created_at >= since)
        if owner is not None:
            filters.append(c.owner == owner)
        gpus = func.coalesce(c.resources["gpus"].as_integer(), 1)
        measures = (c.total, c.succeeded, c.failed, c.prompt_tokens, c.completion_tokens, c.cached_prompt_tokens,
                    c.reasoning_tokens, c.engine_seconds, c.engine_seconds * gpus)
        integers = len(measures) - 2  # the last two are seconds

        def row_of(group: str, jobs: int, sums: list[Any]) -> UsageRow:
            counts, seconds = sums[:integers], sums[integers:]
            return UsageRow(str(group), int(jobs), *(int(v or 0) for v in counts), *(float(v or 0) for v in seconds))

        with self._transaction(write=False) as connection:
            if by == "label":
                totals: dict[str, list[float]] = {}
                rows = connection.execution_options(yield_per=1000).execute(select(c.labels, *measures).where(*filters))
                for labels, *values in rows:
                    pairs = labels.items() if isinstance(labels, dict) else ()
                    for group in [f"{key}={value}" for key, value in pairs] or [USAGE_NO_LABELS_GROUP]:
                        sums = totals.setdefault(group, [0] * (len(measures) + 1))
                        sums[0] += 1
                        for i, value in enumerate(values, start=1):
                            sums[i] += value or 0
                return [row_of(group, sums[0], sums[1:]) for group, sums in sorted(totals.items())]
            query = select(func.count(), *(func.coalesce(func.sum(m), 0) for m in measures)).where(*filters)
            if by is None:
                jobs, *sums = connection.execute(query).one()
                return [row_of(USAGE_ALL_GROUP, jobs, sums)]
            key = c[by]
            rows = connection.execute(query.add_columns(key).group_by(key).order_by(key))
            return [row_of(group, jobs, sums) for jobs, *sums, group in rows]

    # -- files ------------------------------------------------------------------------

    def create_file(
        self,
        *,
        owner: str,
        purpose: str,
        filename: str,
        bytes: int,
        uri: str,
        kind: str = "input",
        job_id: str | None = None,
        expires_at: datetime | None = None,
        id: str | None = None,
        expires_after: timedelta | None = None,
    ) -> FileObject:
        """Record a file object (its content lives in storage at `uri`); `expires_after`
        sets expires_at to created_at + expires_after (housekeeping deletes it then)."""
        if kind not in FILE_KINDS:
            raise ValueError(f"file kind {kind!r} is unknown; use one of {', '.join(FILE_KINDS)}")
        if bytes < 0:
            raise ValueError(f"bytes must be >= 0, got {bytes}")
        _require_aware(expires_at=expires_at)
        created_at = utcnow()
        if expires_after is not None:
            expires_at = created_at + expires_after
        values = dict(
            id=id or new_file_id(),
            owner=owner,
            purpose=purpose,
            filename=filename,
            bytes=bytes,
            uri=uri,
            kind=kind,
            job_id=job_id,
            created_at=created_at,
            expires_at=expires_at,
            deleted_at=None,
        )
        return _file(self._insert(FILES, values, FILES.c))

    def get_file(self, file_id: str, owner: str | None = None, include_deleted: bool = False) -> FileObject | None:
        """The file object, or None if unknown, someone else's, or deleted (unless asked)."""
        filters = owned(FILES, file_id, owner)
        if not include_deleted:
            filters.append(FILES.c.deleted_at.is_(None))
        with self._transaction(write=False) as connection:
            row = connection.execute(select(FILES).where(*filters)).one_or_none()
            return _file(row) if row is not None else None

    def list_files(
        self,
        owner: str | None = None,
        purpose: str | None = None,
        kind: str | None = None,
        job_id: str | None = None,
        created_before: datetime | None = None,
        include_deleted: bool = False,
        order_by: str = "-created_at",
        limit: int = 100,
        offset: int = 0,
        after: str | None = None,
    ) -> tuple[list[FileObject], int]:
        """One page of file objects and the total matching (same paging rules as list_jobs)."""
        _check_page(limit, offset)
        _require_aware(created_before=created_before)
        order = _order(FILES, order_by, _FILE_ORDER_COLUMNS)
        given = {"owner": owner, "purpose": purpose, "kind": kind, "job_id": job_id}
        filters = [FILES.c[name] == value for name, value in given.items() if value is not None]
        if created_before is not None:
            filters.append(FILES.c.created_at < created_before)
        if not include_deleted:
            filters.append(FILES.c.deleted_at.is_(None))
        with self._transaction(write=False) as connection:
            rows, total = page(connection, FILES, filters, order, limit, offset, after, owner=owner)
            return [_file(r) for r in rows], total

    def mark_file_deleted(self, file_id: str, owner: str | None = None) -> FileObject:
        """Set deleted_at (once; repeating is harmless). The content is the caller's to delete."""
        with self._transaction(write=True) as connection:
            connection.execute(
                update(FILES).where(*owned(FILES, file_id, owner), FILES.c.deleted_at.is_(None)).values(deleted_at=utcnow())
            )
            row = connection.execute(select(FILES).where(*owned(FILES, file_id, owner))).one_or_none()
            if row is None:
                raise FileNotFound(f"no file {file_id!r}")
            return _file(row)

    # -- API keys ---------------------------------------------------------------------

    def create_api_key(self, owner: str, name: str, is_admin: bool = False) -> tuple[ApiKey, str]:
        """A new key for `owner`: its record and the plaintext, which is not kept anywhere
        (only its sha256): show it once. `owner` must be an owner name (llm_batch.core.owners)
        that folds to no other owner already recorded (OwnerNameRefused)."""
        owners.check(owner)
        if (other := owners.twin(owner, self.owner_names())) is not None:
            raise owners.OwnerNameRefused(
                f"owner {owner!r} would be read as the existing owner {other!r} (names that differ only in case "
                "or trailing dots are one owner): use a name of its own"
            )
        plaintext = API_KEY_PREFIX + secrets.token_urlsafe(32)
        values = dict(
            id=f"key_{uuid.uuid4().hex}",
            owner=owner,
            name=name,
            prefix=plaintext[:_API_KEY_LOOKUP_CHARS],
            sha256=_sha256(plaintext),
            is_admin=is_admin,
            created_at=utcnow(),
            revoked_at=None,
        )
        return _api_key(self._insert(API_KEYS, values, _API_KEY_COLUMNS)), plaintext

    def owner_names(self) -> list[str]:
        """Every owner the store records (of keys, jobs, files, webhook endpoints)."""
        tables = (API_KEYS, JOBS, FILES, ENDPOINTS)
        with self._transaction(write=False) as connection:
            return sorted({name for table in tables for name in connection.scalars(select(table.c.owner).distinct())})

    def identify_api_key(self, plaintext: str) -> ApiKey | None:
        """The live (not revoked) key whose secret is `plaintext`, else None.
        Hashes are compared in constant time."""
        digest = _sha256(plaintext)
        query = select(*_API_KEY_COLUMNS, API_KEYS.c.sha256).where(
            API_KEYS.c.prefix == plaintext[:_API_KEY_LOOKUP_CHARS], API_KEYS.c.revoked_at.is_(None)
        )
        with self._transaction(write=False) as connection:
            for row in connection.execute(query).all():
                if hmac.compare_digest(row.sha256, digest):
                    return ApiKey(**{name: value for name, value in row._asdict().items() if name != "sha256"})
            return None

    def authenticate_api_key(self, plaintext: str) -> str | None:
        """The owner of the live key `plaintext`, or None (see identify_api_key for is_admin)."""
        key = self.identify_api_key(plaintext)
        return key.owner if key else None

    def revoke_api_key(self, key_id: str, owner: str | None = None) -> ApiKey:
        """Revoke the key (once; repeating is harmless); it no longer authenticates."""
        with self._transaction(write=True) as connection:
            connection.execute(
                update(API_KEYS)
                .where(*owned(API_KEYS, key_id, owner), API_KEYS.c.revoked_at.is_(None))
                .values(revoked_at=utcnow())
            )
            row = connection.execute(select(*_API_KEY_COLUMNS).where(*owned(API_KEYS, key_id, owner))).one_or_none()
            if row is None:
                raise ApiKeyNotFound(f"no API key {key_id!r}")
            return _api_key(row)

    def list_api_keys(self, owner: str | None = None, include_revoked: bool = False) -> list[ApiKey]:
        filters = [API_KEYS.c.owner == owner] if owner is not None else []
        if not include_revoked:
            filters.append(API_KEYS.c.revoked_at.is_(None))
        with self._transaction(write=False) as connection:
            rows = connection.execute(select(*_API_KEY_COLUMNS).where(*filters).order_by(API_KEYS.c.created_at))
            return [_api_key(r) for r in rows]

    # -- idempotency keys (retry-safe creates; see IdempotencyRecord below) -------------

    def reserve_idempotency_key(
        self, owner: str, key: str, route: str, fingerprint: str, lease: timedelta, now: datetime | None = None
    ) -> tuple[bool, IdempotencyRecord]:
        """Take `key` of `owner` for a request (``(True, record)``), or hand back who holds it
        (``(False, record)``: pending while its ``status_code`` is None, else completed).

        Exactly one of many concurrent callers gets True: the INSERT hits the primary key
        (owner, key). A pending reservation older than `lease` (its request never finished)
        is taken over by a compare-and-set on ``locked_at``; the route and fingerprint become
        the new request's."""
        now = now or utcnow()
        _require_aware(now=now)
        values = dict(owner=owner, key=key, route=route, fingerprint=fingerprint, created_at=now, locked_at=now,
                      status_code=None, content_type=None, response_body=None, completed_at=None)
        for _ in range(_CAS_ATTEMPTS):
            try:
                with self._transaction(write=True) as connection:
                    row = connection.execute(insert(IDEMPOTENCY_KEYS).values(**values).returning(*IDEMPOTENCY_KEYS.c)).one()
                return True, IdempotencyRecord(**row._asdict())
            except IntegrityError:
                pass
            with self._transaction(write=True) as connection:
                c = IDEMPOTENCY_KEYS.c
                row = connection.execute(select(IDEMPOTENCY_KEYS).where(c.owner == owner, c.key == key)).one_or_none()
                if row is None:
                    continue  # released in between: try the insert again
                if row.status_code is not None or row.locked_at > now - lease:
                    return False, IdempotencyRecord(**row._asdict())
                taken = connection.execute(
                    update(IDEMPOTENCY_KEYS)
                    .where(c.owner == owner, c.key == key, c.status_code.is_(None), c.locked_at == row.locked_at)
                    .values(route=route, fingerprint=fingerprint, locked_at=now, created_at=now)
                    .returning(*IDEMPOTENCY_KEYS.c)
                ).one_or_none()
                if taken is not None:
                    return True, IdempotencyRecord(**taken._asdict())
        raise ConcurrentUpdate(f"idempotency key {key!r}: kept changing under {_CAS_ATTEMPTS} attempts")

    def get_idempotency_key(self, owner: str, key: str) -> IdempotencyRecord | None:
        c = IDEMPOTENCY_KEYS.c
        with self._transaction(write=False) as connection:
            row = connection.execute(select(IDEMPOTENCY_KEYS).where(c.owner == owner, c.key == key)).one_or_none()
            return IdempotencyRecord(**row._asdict()) if row is not None else None

    def complete_idempotency_key(
        self, owner: str, key: str, locked_at: datetime, status_code: int, content_type: str | None, body: str
    ) -> bool:
        """Store the response of the reservation taken at `locked_at` (False if it was lost:
        released, or taken over after its lease)."""
        c = IDEMPOTENCY_KEYS.c
        with self._transaction(write=True) as connection:
            done = connection.execute(
                update(IDEMPOTENCY_KEYS)
                .where(c.owner == owner, c.key == key, c.locked_at == locked_at, c.status_code.is_(None))
                .values(status_code=status_code, content_type=content_type, response_body=body, completed_at=utcnow())
            )
            return done.rowcount == 1

    def release_idempotency_key(self, owner: str, key: str, locked_at: datetime) -> None:
        """Drop a pending reservation (its request failed with a 5xx): the key is free again."""
        c = IDEMPOTENCY_KEYS.c
        with self._transaction(write=True) as connection:
            connection.execute(
                delete(IDEMPOTENCY_KEYS).where(
                    c.owner == owner, c.key == key, c.locked_at == locked_at, c.status_code.is_(None)
                )
            )

    def delete_idempotency_keys(self, created_before: datetime) -> int:
        """Delete keys created before `created_before` (housekeeping); returns how many."""
        _require_aware(created_before=created_before)
        with self._transaction(write=True) as connection:
            done = connection.execute(delete(IDEMPOTENCY_KEYS).where(IDEMPOTENCY_KEYS.c.created_at < created_before))
            return done.rowcount or 0

    # -- end of idempotency keys ------------------------------------------------------

    # -- file expiry (files' own expires_at: expires_after / output_expires_after) ------

    def list_expiring_files(self, expires_before: datetime, limit: int = 500) -> list[FileObject]:
        """Files not yet deleted whose expires_at is before `expires_before`, oldest first."""
        _check_page(limit, 0)
        _require_aware(expires_before=expires_before)
        query = (
            select(FILES)
            .where(FILES.c.deleted_at.is_(None), FILES.c.expires_at.is_not(None), FILES.c.expires_at < expires_before)
            .order_by(FILES.c.expires_at, FILES.c.id)
            .limit(limit)
        )
        with self._transaction(write=False) as connection:
            return [_file(r) for r in connection.execute(query)]

    # -- end of file expiry -----------------------------------------------------------


# -- idempotency keys: the table and its snapshot (JobStore.reserve_idempotency_key) ------

IDEMPOTENCY_KEYS: Table = IdempotencyKeyRow.__table__


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


# -- end of idempotency keys ------------------------------------------------------------


def _probe_engine(url: str, timeout: float) -> Engine:
    """An engine without a pool (each connect is a new connection) and with short timeouts,
    for check_health."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        uri = Path(parsed.database or "").expanduser().resolve().as_uri() + "?mode=rw"

        def connect() -> sqlite3.Connection:
            # isolation_level=None: the driver emits no BEGIN of its own (as make_engine).
            return sqlite3.connect(uri, uri=True, timeout=timeout, isolation_level=None, check_same_thread=False)

        return create_engine("sqlite://", creator=connect, poolclass=NullPool)
    # libpq's connect_timeout (whole seconds); the statement and lock timeouts are SET LOCAL.
    libpq = parsed.get_driver_name() in ("psycopg2", "psycopg")
    connect_args = {"connect_timeout": max(1, math.ceil(timeout))} if libpq else {}
    return create_engine(parsed, poolclass=NullPool, connect_args=connect_args)


def _health_probe_key() -> dict[str, Any]:
    now = utcnow()
    return dict(
        id=f"key_health_{uuid.uuid4().hex}", owner="llm-batch-health", name="health check (rolled back)",
        prefix="health", sha256="0" * 64, is_admin=False, created_at=now, revoked_at=now,
    )


def _describe(exc: BaseException) -> str:
    """The driver's error for a DBAPIError (without SQLAlchemy's SQL echo and link)."""
    if isinstance(exc, DBAPIError) and exc.orig is not None:
        exc = exc.orig
    first_line = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first_line}" if first_line else type(exc).__name__


# A forked child (Airflow's LocalExecutor forks task processes) must not reuse its
# parent's pooled connections: drop them, without closing the parent's sockets.
_live_stores: weakref.WeakSet[JobStore] = weakref.WeakSet()


def _forget_connections_after_fork() -> None:
    for store in list(_live_stores):
        if store._engine is not None:
            store._engine.dispose(close=False)


os.register_at_fork(after_in_child=_forget_connections_after_fork)


@lru_cache(maxsize=None)
def _store_for(url: str) -> JobStore:
    return JobStore(url)


def get_job_store(url: str | None = None) -> JobStore:
    """The process-wide store for `url` (default: Settings.database_url)."""
    if url is None:
        from llm_batch.core.config import get_settings

        url = get_settings().database_url
    return _store_for(url)
