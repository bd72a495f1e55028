"""Health: whether a new connection can read and write the store (``/health``, ``llm-batch
status``); nothing it writes is ever kept."""

from __future__ import annotations

import math
import sqlite3
import uuid
from pathlib import Path

from sqlalchemy import Engine, create_engine, insert, select
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError
from sqlalchemy.pool import NullPool

from llm_batch.infra.jobstore.database import VERSION_TABLE
from llm_batch.infra.jobstore.errors import JobStoreError, JobStoreUnhealthy
from llm_batch.infra.jobstore.models import API_KEYS, JOBS
from llm_batch.infra.jobstore.repository import Repository, utcnow

# How long check_health waits to connect, for the write lock and for each statement.
HEALTH_TIMEOUT_S = 5.0


class HealthRepository(Repository):
    def check_health(self, timeout: float = HEALTH_TIMEOUT_S, open_store: bool = True) -> None:
        """Read and write the store through a NEW connection; raise JobStoreUnhealthy if that fails.

        Not the pool: a pooled connection can keep working on a store no new connection can
        open (a SQLite ``-wal`` file replaced by garbage), and every process opens new ones.
        The write is a real table's row, rolled back, so a read-only server or a user without
        INSERT rights fails; the row is inert and its id unique, so concurrent checks never wait.
        ``open_store`` False (``llm-batch status``): the probe only, never creating or migrating a store.
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
                now = utcnow()
                connection.execute(insert(API_KEYS).values(
                    id=f"key_health_{uuid.uuid4().hex}", owner="llm-batch-health", name="health check (rolled back)",
                    prefix="health", sha256="0" * 64, is_admin=False, created_at=now, revoked_at=now))
                connection.rollback()
        except Exception as exc:  # noqa: BLE001 - any failure means unhealthy: say which
            store = make_url(self.url).render_as_string(hide_password=True)
            raise JobStoreUnhealthy(f"{store}: {step} failed: {_describe(exc)}") from exc
        finally:
            if probe is not None:
                probe.dispose()


def _probe_engine(url: str, timeout: float) -> Engine:
    """An engine without a pool (each connect is a new connection) and with short timeouts."""
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


def _describe(exc: BaseException) -> str:
    """The driver's error for a DBAPIError (without SQLAlchemy's SQL echo and link)."""
    if isinstance(exc, DBAPIError) and exc.orig is not None:
        exc = exc.orig
    first_line = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first_line}" if first_line else type(exc).__name__
