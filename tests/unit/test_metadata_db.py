"""The embedded stack's Airflow metadata DB (SQLite, WAL) makes a writer wait for the lock
instead of failing after sqlite3's default 5 s (src/llm_batch/devstack/metadata_db.py); the production
shape (PostgreSQL) does not get SQLite's arguments."""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path

import pytest
from airflow.sdk.module_loading import import_string
from sqlalchemy import create_engine, text
from sqlalchemy.exc import OperationalError

from llm_batch.core.config import Settings
from llm_batch.devstack.stack import Stack

HOLD_S = 5.5  # longer than sqlite3's default busy timeout (5 s)


def _write_while_locked(db: Path, connect_args: dict) -> float:
    """Insert a row while another connection holds the write lock for HOLD_S; the seconds
    the insert took (raises what SQLite raised)."""
    setup = sqlite3.connect(db)
    setup.execute("PRAGMA journal_mode=WAL")
    setup.execute("CREATE TABLE IF NOT EXISTS t (x INTEGER)")
    setup.commit()
    setup.close()
    holder = sqlite3.connect(db, check_same_thread=False)
    holder.execute("BEGIN IMMEDIATE")  # the write lock, as a long scheduler transaction holds it
    release = threading.Timer(HOLD_S, holder.commit)
    release.start()
    engine = create_engine(f"sqlite:///{db}", connect_args=dict(connect_args))
    try:
        started = time.monotonic()
        with engine.begin() as connection:
            connection.execute(text("INSERT INTO t VALUES (1)"))
        return time.monotonic() - started
    finally:
        release.join()
        holder.close()
        engine.dispose()


def test_the_embedded_stack_waits_for_the_lock(tmp_path):
    env = Stack(Settings(home=tmp_path / "home"), 18080).env()
    # Resolved as Airflow resolves it ([database] sql_alchemy_connect_args: conf.getimport).
    connect_args = import_string(env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONNECT_ARGS"])
    assert connect_args["timeout"] >= 30
    took = _write_while_locked(tmp_path / "airflow.db", connect_args)
    assert HOLD_S - 0.5 < took < HOLD_S + 5  # it waited for the lock, then wrote


def test_without_it_the_writer_fails_after_five_seconds(tmp_path):
    """The control: what the REST API answered 500 for."""
    with pytest.raises(OperationalError, match="database is locked"):
        _write_while_locked(tmp_path / "airflow.db", {})


def test_the_production_shape_on_postgresql_does_not_get_sqlite_arguments(tmp_path):
    from llm_batch.devstack.celery_stack import CeleryStack

    shape = CeleryStack.create(Settings(home=tmp_path / "home"), 18081, workers=1)
    env = shape.env()
    assert env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"].startswith("postgresql")
    assert "AIRFLOW__DATABASE__SQL_ALCHEMY_CONNECT_ARGS" not in env
    assert "AIRFLOW__DATABASE__SQL_ALCHEMY_CONNECT_ARGS" not in shape.worker_env(1)
