"""Engines for the job store (SQLite or PostgreSQL) and its migrations. SQLite's write transactions
start with ``BEGIN IMMEDIATE`` (they wait for the write lock up to the busy timeout instead of
failing on a lock upgrade); WAL lets readers run beside the writer."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.engine import Connection, make_url

# Execution option that marks a connection as a writer (see _sqlite_begin).
WRITE = "llm_batch_write"
SQLITE_BUSY_TIMEOUT_S = 60
# Any fixed 64-bit key: the advisory lock serialising migrations on PostgreSQL.
_MIGRATION_LOCK_KEY = 0x11B_BA7C4
_ALEMBIC_INI = Path(__file__).with_name("alembic.ini")
# Never Airflow's alembic_version, should both ever share one database.
VERSION_TABLE = "llm_batch_alembic_version"


def make_engine(url: str) -> Engine:
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        if parsed.database in (None, "", ":memory:"):
            raise ValueError("the job store needs a SQLite file, not an in-memory database")
        Path(parsed.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(
            parsed,
            connect_args={"timeout": SQLITE_BUSY_TIMEOUT_S, "check_same_thread": False},
        )
        event.listen(engine, "connect", _sqlite_connect)
        event.listen(engine, "begin", _sqlite_begin)
        return engine
    return create_engine(parsed, pool_pre_ping=True)


def _sqlite_connect(dbapi_connection, _record) -> None:
    dbapi_connection.isolation_level = None  # we emit BEGIN ourselves
    cursor = dbapi_connection.cursor()
    _set_wal(cursor)
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def _set_wal(cursor) -> None:
    """WAL mode, tried again up to the busy timeout: SQLite answers "database is locked" at once
    (no busy wait) while another process holds the write lock, e.g. migrating a new file."""
    deadline = time.monotonic() + SQLITE_BUSY_TIMEOUT_S
    while True:
        try:
            cursor.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _sqlite_begin(connection: Connection) -> None:
    write = connection.get_execution_options().get(WRITE, False)
    connection.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")


def upgrade_to_head(url_or_engine: str | Engine) -> None:
    """Bring the database to the newest migration. Safe when several processes start together:
    one transaction that first takes a lock (an advisory lock on PostgreSQL, SQLite's write
    lock), so the second waits and then finds the schema current."""
    owned = isinstance(url_or_engine, str)
    engine = make_engine(url_or_engine) if owned else url_or_engine
    try:
        with engine.execution_options(**{WRITE: True}).begin() as connection:
            if connection.dialect.name == "postgresql":
                connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _MIGRATION_LOCK_KEY})
            config = Config(str(_ALEMBIC_INI))
            config.attributes["connection"] = connection
            command.upgrade(config, "head")
    finally:
        if owned:
            engine.dispose()
