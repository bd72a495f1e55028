"""Health: whether a new connection can read and write the store (``check_health``, behind
``/health`` and ``llm-batch status``); raises ``JobStoreUnhealthy`` naming the step that
failed. Nothing it writes is ever kept.
"""

from __future__ import annotations

import math
import sqlite3
import uuid
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, insert, select
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError
from sqlalchemy.pool import NullPool

from llm_batch.infra.jobstore.database import VERSION_TABLE
from llm_batch.infra.jobstore.errors import JobStoreError, JobStoreUnhealthy
from llm_batch.infra.jobstore.repository import Repository, utcnow
from llm_batch.infra.jobstore.tables import API_KEYS, JOBS

# How long check_health waits to connect, for the write lock and for each statement.
HEALTH_TIMEOUT_S = 5.0


class HealthRepository(Repository):
    """The store's health check (see the module docstring)."""

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
