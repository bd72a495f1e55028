"""The job store under several processes at once, on a real PostgreSQL (and on SQLite).

Processes start together on a database that has never been migrated, so they also race
through ``upgrade_to_head`` (advisory lock on PostgreSQL, write lock on SQLite); then they
submit jobs and report progress on one shared job concurrently. And the result cache's index
filled in bulk, whose PostgreSQL path is its own.
"""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from llm_batch.core.jobs import JobStatus
from llm_batch.infra.jobstore import JobStore

PROCESSES = 4
JOBS_PER_PROCESS = 50  # 200 submissions in all
SHARED_JOB = "job_shared_progress"


def _worker(url: str, process: int, barrier) -> None:
    """One process: first store use (migrations), 50 submissions, 50 shared increments."""
    barrier.wait(timeout=60)
    store = JobStore(url)
    for n in range(JOBS_PER_PROCESS):
        store.create_job(
            dialect="mistral",
            endpoint="/v1/chat/completions",
            model="tiny",
            owner=f"owner{process}",
            metadata={"process": str(process), "n": str(n)},
        )
        store.add_counts(SHARED_JOB, completed=1, succeeded=1)
        if n == JOBS_PER_PROCESS // 2:
            store.request_cancel(SHARED_JOB)  # every process asks; only the first one moves it
    store.close()


@pytest.fixture(params=[pytest.param("postgres", marks=pytest.mark.postgres), "sqlite"])
def fresh_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A database that exists but was never migrated."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'jobs.db'}"
    return request.getfixturevalue("postgres_db_url")


def _run_workers(url: str) -> None:
    context = multiprocessing.get_context("spawn")  # no inherited connections, like real workers
    barrier = context.Barrier(PROCESSES + 1)
    processes = [context.Process(target=_worker, args=(url, p, barrier)) for p in range(PROCESSES)]
    for process in processes:
        process.start()
    # The shared job must exist before workers report on it; creating it here also migrates
    # first, so the race below is between the workers' own migration checks.
    store = JobStore(url)
    store.create_job(id=SHARED_JOB, dialect="airflow", endpoint="/v1/chat/completions", model="tiny", owner="dag")
    store.transition(SHARED_JOB, "VALIDATING")  # under way: a cancel moves it to CANCELLING
    store.close()
    barrier.wait(timeout=60)
    for process in processes:
        process.join(timeout=120)
    assert [p.exitcode for p in processes] == [0] * PROCESSES


def test_concurrent_processes_lose_and_duplicate_nothing(fresh_url: str):
    _run_workers(fresh_url)
    store = JobStore(fresh_url)
    jobs, total = store.list_jobs(dialect="mistral", limit=1000)
    assert total == PROCESSES * JOBS_PER_PROCESS == len({j.id for j in jobs})
    submitted = sorted((j.metadata["process"], int(j.metadata["n"])) for j in jobs)
    assert submitted == sorted((str(p), n) for p in range(PROCESSES) for n in range(JOBS_PER_PROCESS))
    for process in range(PROCESSES):
        assert store.list_jobs(owner=f"owner{process}")[1] == JOBS_PER_PROCESS
    shared = store.get_job(SHARED_JOB)
    assert shared.completed == shared.succeeded == PROCESSES * JOBS_PER_PROCESS
    assert shared.status is JobStatus.CANCELLING and shared.cancel_requested_at == shared.cancelling_at
    store.close()


def _migrate(url: str, barrier) -> None:
    barrier.wait(timeout=60)
    JobStore(url).list_jobs()  # first use migrates


def test_processes_starting_together_migrate_once(fresh_url: str):
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(PROCESSES)
    processes = [context.Process(target=_migrate, args=(fresh_url, barrier)) for _ in range(PROCESSES)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=120)
    assert [p.exitcode for p in processes] == [0] * PROCESSES
    engine = create_engine(fresh_url)
    try:
        with engine.connect() as connection:
            # One row: the newest migration, applied once whoever won the race.
            assert connection.execute(text("SELECT version_num FROM llm_batch_alembic_version")).all() == [(_head(),)]
    finally:
        engine.dispose()


def _head() -> str:
    """The newest migration's revision, from the migrations folder itself."""
    from pathlib import Path

    from alembic.config import Config
    from alembic.script import ScriptDirectory

    import llm_batch.infra.jobstore as jobstore

    config = Config(str(Path(jobstore.__file__).with_name("alembic.ini")))
    config.set_main_option("script_location", str(Path(jobstore.__file__).with_name("migrations")))
    return ScriptDirectory.from_config(config).get_current_head()


def test_a_cache_fill_upserts_alike_on_both_databases(fresh_url: str):
    """The result cache's index in bulk (PostgreSQL's path is its own: COPY, then one upsert):
    more rows than one transaction holds, a key given twice in one fill (the last wins), a
    key filled again by a later job (replaced), another owner's key kept apart, and values
    COPY's text format must escape kept as they were."""
    from datetime import UTC, datetime, timedelta

    from llm_batch.infra.jobstore import result_cache as index
    from llm_batch.infra.result_cache import Packed

    store = JobStore(fresh_url)
    count = index._ROWS_PER_TRANSACTION + 7
    first = [Packed(f"k{i}", i * 10, 10, 3, 1) for i in range(count)] + [Packed("k0", 5, 99, 4, 2)]
    store.put_cache_entries(owner="alice", job_id="job_a", uri="pack-a", packed=first)
    store.put_cache_entries(owner="alice", job_id="job_b", uri="pack-b", packed=[Packed("k1", 0, 11, 3, 1)])
    store.put_cache_entries(owner="bob", job_id="job_c", uri="pack-c", packed=[Packed("k1", 0, 12, 3, 1)])
    since = datetime.now(UTC) - timedelta(hours=1)
    mine = store.cached_answers("alice", [f"k{i}" for i in range(count)], made_after=since)
    assert len(mine) == count
    assert (mine["k0"].uri, mine["k0"].at_byte, mine["k0"].bytes) == ("pack-a", 5, 99)
    assert (mine["k1"].uri, mine["k1"].bytes) == ("pack-b", 11)
    assert (mine[f"k{count - 1}"].uri, mine[f"k{count - 1}"].at_byte) == ("pack-a", (count - 1) * 10)
    assert store.cached_answers("bob", ["k1", "k2"], made_after=since)["k1"].bytes == 12
    assert set(store.cached_answers("bob", ["k1", "k2"], made_after=since)) == {"k1"}
    odd_uri = "s3://b/a\\b\tc\nd\\N.jsonl"
    store.put_cache_entries(owner="(every owner)", job_id="job_d", uri=odd_uri, packed=[Packed("k9", 0, 1, 0, 0)])
    assert store.cached_answers("(every owner)", ["k9"], made_after=since)["k9"].uri == odd_uri
    assert store.cached_answers("(every owner)", ["k9"], made_after=since)["k9"].at_byte == 0
    store.close()
