"""``GET /batch/health``: 200 when a new connection reads and writes the job store, 503
naming the store and what failed otherwise (JobStore.check_health).

The case that made this: a SQLite store whose ``-wal`` file was overwritten with garbage.
The app's pooled connection keeps answering from what it holds while every new connection
fails; the old health check (a query on the pool) said healthy. The health router alone,
on an app holding the store as create_app wires it: no Airflow needed.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from llm_batch.api.routers import health
from llm_batch.api.state import ApiState
from llm_batch.core.config import Settings
from llm_batch.infra.jobstore import JobStore
from llm_batch.infra.jobstore.errors import JobStoreUnhealthy
from tests.unit.test_jobstore import make_job, store, store_url  # noqa: F401 (fixtures)


def health_client(store: JobStore, tmp_path: Path) -> TestClient:
    """The health router on an app holding `store`, as create_app wires it."""
    app = FastAPI()
    app.state.llm_batch = ApiState(settings=Settings(home=tmp_path), store=store)
    app.include_router(health.router)
    return TestClient(app)


def test_a_healthy_store_answers_200_and_keeps_nothing(store, tmp_path):  # noqa: F811
    make_job(store)
    assert store.check_health() is None
    response = health_client(store, tmp_path).get("/health")
    assert (response.status_code, response.json()) == (200, {"status": "healthy", "job_store": "ok"})
    # The probe's write was rolled back: no row stays behind.
    assert store.list_api_keys(include_revoked=True) == []


@pytest.mark.parametrize("how", ["overwritten", "replaced"])
def test_garbage_wal_is_unhealthy_while_the_apps_own_connection_still_answers(tmp_path, how):
    url = f"sqlite:///{tmp_path / 'jobs.db'}"
    store = JobStore(url)
    try:
        for _ in range(3):
            make_job(store)
        assert store.list_jobs(limit=1)[1] == 3  # the app's pooled connection is open now
        wal = tmp_path / "jobs.db-wal"
        size = wal.stat().st_size
        assert size > 0
        garbage = b"\xde\xad\xbe\xef" * (size // 4 + 1)
        if how == "overwritten":  # in place: the open connection's file descriptor sees it too
            with open(wal, "r+b") as out:
                out.write(garbage)
        else:  # a new file under the name: the open connection keeps the old one
            (tmp_path / "garbage").write_bytes(garbage)
            (tmp_path / "garbage").replace(wal)
        # The bug: the old connection still reads, so the old health check said healthy...
        assert store.list_jobs(limit=1)[1] == 3
        # ...while a new connection (any worker, a restarted API process) fails.
        with pytest.raises(sqlite3.DatabaseError):
            sqlite3.connect(tmp_path / "jobs.db").execute("SELECT count(*) FROM jobs").fetchall()

        response = health_client(store, tmp_path).get("/health")
        assert response.status_code == 503
        body = response.json()
        assert body["status"] == "unhealthy"
        assert body["job_store"].startswith(f"{url}: ") and " failed: " in body["job_store"]
        with pytest.raises(JobStoreUnhealthy, match="DatabaseError|disk I/O error"):
            store.check_health()
    finally:
        store.close()
