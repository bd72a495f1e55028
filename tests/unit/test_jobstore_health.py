"""JobStore.check_health: a NEW connection (never the pool) must read and write the store,
within a short timeout, else JobStoreUnhealthy names the store and the step. Also what
``llm-batch status`` shows of it. The route and the garbage ``-wal`` case:
tests/api/test_health.py.
"""

from __future__ import annotations

import sqlite3
import time

import pytest

from llm_batch.core.config import Settings
from llm_batch.devstack.stack import Stack, free_port
from llm_batch.infra.jobstore import JobStore
from llm_batch.infra.jobstore.errors import JobStoreUnhealthy
from tests.unit.test_jobstore import make_job


def test_a_missing_store_is_opened_as_any_call_would_unless_told_not_to(tmp_path):
    path = tmp_path / "new" / "jobs.db"
    with pytest.raises(JobStoreUnhealthy, match=r"connect failed: OperationalError: unable to open database file"):
        JobStore(f"sqlite:///{path}").check_health(open_store=False)
    assert not path.exists() and not path.parent.exists()
    JobStore(f"sqlite:///{path}").check_health()  # a server's first request: creates and migrates
    assert path.exists()


def test_a_store_without_the_schema_is_unhealthy(tmp_path):
    sqlite3.connect(tmp_path / "empty.db").close()
    with pytest.raises(JobStoreUnhealthy, match="read failed: OperationalError: no such table"):
        JobStore(f"sqlite:///{tmp_path / 'empty.db'}").check_health(open_store=False)


def test_a_sqlite_write_lock_held_too_long_is_unhealthy_within_the_timeout(tmp_path):
    store = JobStore(f"sqlite:///{tmp_path / 'jobs.db'}")
    make_job(store)
    holder = sqlite3.connect(tmp_path / "jobs.db", isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    try:
        started = time.monotonic()
        with pytest.raises(JobStoreUnhealthy, match="write lock .* failed: OperationalError: database is locked"):
            store.check_health(timeout=0.5)
        assert time.monotonic() - started < 5
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    store.check_health()
    store.close()


@pytest.mark.postgres
def test_postgres_read_only_is_unhealthy_and_the_password_is_hidden(postgres_db_url):
    from sqlalchemy import create_engine, text

    # Trust authentication ignores the password: the URL carries one only to be hidden.
    url = postgres_db_url.replace("postgres@", "postgres:s3cret-pw@", 1)
    store = JobStore(url)
    try:
        make_job(store)
        store.check_health()
        admin = create_engine(postgres_db_url, isolation_level="AUTOCOMMIT")
        database = postgres_db_url.rsplit("/", 1)[1]
        with admin.connect() as connection:  # new sessions only: the app's pool is not told
            connection.execute(text(f'ALTER DATABASE "{database}" SET default_transaction_read_only = on'))
        admin.dispose()
        make_job(store)  # the pool's old session still writes: the pooled check would pass
        with pytest.raises(JobStoreUnhealthy) as raised:
            store.check_health()
        message = str(raised.value)
        assert "write (rolled back) failed" in message and "read-only transaction" in message
        assert "s3cret-pw" not in message and "postgres:***@" in message
    finally:
        store.close()


def test_an_unreachable_postgres_is_unhealthy_naming_it():
    url = f"postgresql+psycopg2://user:pw@127.0.0.1:{free_port()}/jobs"
    named = r"^postgresql\+psycopg2://user:\*\*\*@127\.0\.0\.1:\d+/jobs: "
    with pytest.raises(JobStoreUnhealthy, match=named + "connect failed: OperationalError: .*refused"):
        JobStore(url).check_health(timeout=1, open_store=False)
    with pytest.raises(JobStoreUnhealthy, match=named + "open failed: OperationalError: .*refused"):
        JobStore(url).check_health(timeout=1)


def test_status_shows_the_job_store(tmp_path, monkeypatch, capsys):
    from llm_batch.cli.main import main

    stack = Stack(Settings(home=tmp_path), free_port())
    monkeypatch.setattr("llm_batch.devstack.home.home_stack", lambda settings=None: stack)
    assert main(["status"]) == 3  # nothing runs, and there is no store yet
    out = capsys.readouterr().out
    assert "api-server     stopped" in out
    assert f"job store      FAILED: sqlite:///{tmp_path}/jobs.db: connect failed: " in out
    assert not (tmp_path / "jobs.db").exists()  # status never creates the store

    JobStore(f"sqlite:///{tmp_path}/jobs.db").list_jobs()  # migrated
    assert main(["status"]) == 3  # still no component running
    assert "job store      ok" in capsys.readouterr().out
