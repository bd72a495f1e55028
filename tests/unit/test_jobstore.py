"""The job store's behaviour, the same test bodies on SQLite and on a real PostgreSQL.

The ``store`` fixture is parametrised: ``sqlite`` (a file in tmp_path) and ``postgres``
(a fresh database in the private cluster of tests/fixtures/postgres.py; marked
``postgres``, deselect with ``-m "not postgres"``).
"""

from __future__ import annotations

import dataclasses
import re
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, inspect, text

from llm_batch.core.endpoints import UnsupportedEndpointError
from llm_batch.core.jobs import TERMINAL_STATUSES, InvalidTransition, JobStatus
from llm_batch.infra.jobstore import (
    AdapterExists,
    AdapterNotFound,
    ApiKeyNotFound,
    DuplicateId,
    FileNotFound,
    InvalidCursor,
    JobNotFound,
    JobStore,
    upgrade_to_head,
)
from llm_batch.infra.jobstore.models import Base
from tests.fixtures.jobstore import store_url_of

CHAT = "/v1/chat/completions"
T0 = datetime(2026, 1, 1, tzinfo=UTC)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'jobs.db'}"
    return request.getfixturevalue("postgres_db_url")


@pytest.fixture
def store(request: pytest.FixtureRequest, store_url: str):  # store_url: its kind (migrations start empty)
    store = JobStore(store_url_of(request, "sqlite" if store_url.startswith("sqlite") else "postgres"))
    yield store
    store.close()


def make_job(store: JobStore, **fields):
    defaults = dict(dialect="openai", endpoint=CHAT, model="tiny", owner="alice")
    return store.create_job(**{**defaults, **fields})


# -- migrations ---------------------------------------------------------------------------


def test_migrations_create_tables_indexes_and_are_idempotent(store_url: str):
    upgrade_to_head(store_url)
    upgrade_to_head(store_url)  # second run: nothing to do, no error
    engine = create_engine(store_url)
    try:
        inspector = inspect(engine)
        assert {"jobs", "files", "api_keys", "llm_batch_alembic_version"} <= set(inspector.get_table_names())
        assert "alembic_version" not in inspector.get_table_names()  # never Airflow's table
        indexed = {tuple(ix["column_names"]) for ix in inspector.get_indexes("jobs")}
        assert {("owner", "created_at"), ("owner", "status"), ("dialect", "created_at"), ("model",)} <= indexed
        with engine.connect() as connection:
            versions = connection.execute(text("SELECT version_num FROM llm_batch_alembic_version")).all()
            # The migrations build exactly what the models declare (a model change without
            # a migration fails here).
            context = MigrationContext.configure(connection, opts={"compare_type": True})
            drift = [d for d in compare_metadata(context, Base.metadata) if d[0] != "remove_table"
                     or d[1].name != "llm_batch_alembic_version"]
        assert versions == [("0015",)]
        assert drift == []
    finally:
        engine.dispose()


def test_snapshots_mirror_their_tables():
    """The store builds snapshots straight from rows: their fields must be the columns."""
    from llm_batch.infra.jobstore import ApiKey, FileObject, Job, OwnerAdapter
    from llm_batch.infra.jobstore.models import AdapterRow, ApiKeyRow, FileRow, JobRow

    def fields(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    assert fields(Job) == set(JobRow.__table__.c.keys())
    assert fields(FileObject) == set(FileRow.__table__.c.keys())
    assert fields(ApiKey) == set(ApiKeyRow.__table__.c.keys()) - {"sha256"}
    assert fields(OwnerAdapter) == set(AdapterRow.__table__.c.keys())


def test_migration_0003_keeps_the_array_output_path_under_its_new_name(store_url: str):
    from alembic import command
    from alembic.config import Config

    from llm_batch.infra.jobstore import database

    engine = create_engine(store_url)
    try:
        with engine.begin() as connection:
            config = Config(str(database._ALEMBIC_INI))
            config.attributes["connection"] = connection
            command.upgrade(config, "0002")
            connection.execute(text(
                "INSERT INTO jobs (id, dialect, endpoint, model, model_config, input, metadata, labels, priority,"
                " data_parallelism, resources, status, created_at, updated_at, total, completed, succeeded,"
                " failed, errors, owner, scale_output_uri) VALUES ('job_old', 'scale', '/v1/completions', 'm',"
                " '{}', '{}', '{}', '{}', 0, 1, '{}', 'QUEUED', CURRENT_TIMESTAMP, CURRENT_TIMESTAMP, 0, 0, 0,"
                " 0, '[]', 'alice', '/out.json')"))
        upgrade_to_head(engine)
        with engine.connect() as connection:
            row = connection.execute(text("SELECT array_output_uri FROM jobs WHERE id = 'job_old'")).one()
        assert row.array_output_uri == "/out.json"
    finally:
        engine.dispose()


def test_postgres_fixture_names_the_install_line_when_postgres_is_missing(tmp_path: Path):
    from tests.fixtures.postgres import INSTALL_HINT, find_postgres_bin

    with pytest.raises(pytest.fail.Exception, match=re.escape(INSTALL_HINT)):
        find_postgres_bin(tmp_path)
    (tmp_path / "pginstall" / "bin").mkdir(parents=True)
    for name in ("initdb", "pg_ctl"):
        (tmp_path / "pginstall" / "bin" / name).touch()
    assert find_postgres_bin(tmp_path) == tmp_path / "pginstall" / "bin"


# -- create / get -------------------------------------------------------------------------


def test_create_and_get_round_trip_every_field(store: JobStore):
    created = make_job(
        store,
        dialect="scale",
        input={"uri": "s3://bucket/in.jsonl"},
        input_format="jsonl",
        model_config={"max_tokens": 16},
        output_uri="s3://bucket/work/out.jsonl",
        array_output_uri="s3://bucket/out.json",
        metadata={"team": "search"},
        labels={"env": "test"},
        priority=7,
        data_parallelism=4,
        resources={"gpus": 1, "gpu_type": "nvidia-ampere-a10"},
        max_runtime_sec=600,
        dag_run_id="manual__1",
    )
    assert created.id.startswith("job_") and len(created.id) == 4 + 32
    assert created.status is JobStatus.QUEUED
    assert (created.total, created.completed, created.succeeded, created.failed) == (0, 0, 0, 0)
    assert created.created_at.tzinfo is not None and created.created_at.utcoffset() == timedelta(0)
    assert created.expires_at == created.created_at + timedelta(seconds=600)
    fetched = store.get_job(created.id)
    assert fetched == created
    assert fetched.metadata == {"team": "search"} and fetched.resources["gpu_type"] == "nvidia-ampere-a10"
    assert dataclasses.asdict(fetched)["model_config"] == {"max_tokens": 16}


def test_create_refuses_bad_fields_precisely(store: JobStore):
    with pytest.raises(ValueError, match="dialect 'klingon'"):
        make_job(store, dialect="klingon")
    with pytest.raises(UnsupportedEndpointError, match="/v1/conversations"):
        make_job(store, endpoint="/v1/conversations")
    with pytest.raises(ValueError, match="data_parallelism"):
        make_job(store, data_parallelism=0)
    with pytest.raises(ValueError, match="created_at=.* naive datetime"):
        make_job(store, created_at=datetime(2026, 1, 1))
    job = make_job(store, id="job_fixed")
    with pytest.raises(DuplicateId, match="job_fixed"):
        make_job(store, id="job_fixed")
    assert store.list_jobs()[1] == 1 and store.get_job(job.id) == job


def test_datetimes_come_back_as_aware_utc_whatever_zone_went_in(store: JobStore):
    plus_two = datetime(2026, 3, 1, 14, 0, tzinfo=UTC).astimezone(timezone(timedelta(hours=2)))
    job = make_job(store, created_at=plus_two)
    got = store.get_job(job.id).created_at
    assert got == plus_two and got.tzinfo == UTC and got.hour == 14


def test_ownership_other_owner_sees_nothing(store: JobStore):
    job = make_job(store, owner="alice")
    assert store.get_job(job.id, owner="alice") == job
    assert store.get_job(job.id, owner="bob") is None
    assert store.get_job("job_nope") is None
    with pytest.raises(JobNotFound):
        store.request_cancel(job.id, owner="bob")
    with pytest.raises(JobNotFound):
        store.set_priority(job.id, 5, owner="bob")
    assert store.get_job(job.id) == job  # untouched by the refused calls
    assert store.list_jobs(owner="bob") == ([], 0)


# -- transitions --------------------------------------------------------------------------


def test_happy_path_sets_each_timestamp_once_in_order(store: JobStore):
    job = make_job(store)
    validating = store.transition(job.id, JobStatus.VALIDATING)
    running = store.transition(job.id, "RUNNING")
    finalizing = store.transition(job.id, JobStatus.FINALIZING)
    done = store.transition(job.id, JobStatus.SUCCEEDED, reason="all good")
    assert done.status is JobStatus.SUCCEEDED and done.status_reason == "all good"
    assert done.started_at == validating.started_at  # RUNNING did not move it
    assert job.created_at <= done.started_at <= done.in_progress_at <= done.finalizing_at <= done.completed_at
    assert running.in_progress_at is not None and finalizing.finalizing_at is not None
    assert (done.failed_at, done.cancelled_at, done.expired_at, done.cancelling_at) == (None,) * 4
    assert done.updated_at >= done.completed_at


@pytest.mark.parametrize(
    "status, stamps",
    [
        (JobStatus.FAILED, ("failed_at", "completed_at")),
        (JobStatus.TIMEOUT_EXCEEDED, ("expired_at", "completed_at")),
        (JobStatus.CANCELLED, ("cancelled_at", "completed_at")),
    ],
)
def test_terminal_statuses_set_their_timestamps(store: JobStore, status: JobStatus, stamps: tuple[str, ...]):
    job = make_job(store)
    store.transition(job.id, JobStatus.VALIDATING)
    ended = store.transition(job.id, status, reason="why")
    assert all(getattr(ended, name) is not None for name in stamps)
    assert ended.terminal and ended.status_reason == "why"


def test_invalid_transitions_are_refused_and_change_nothing(store: JobStore):
    job = make_job(store)
    with pytest.raises(InvalidTransition, match="QUEUED to FINALIZING"):
        store.transition(job.id, JobStatus.FINALIZING)
    assert store.get_job(job.id) == job
    with pytest.raises(ValueError):
        store.transition(job.id, "DANCING")
    with pytest.raises(JobNotFound):
        store.transition("job_missing", JobStatus.VALIDATING)


def test_terminal_is_never_left_and_repeating_a_status_is_a_no_op(store: JobStore):
    job = make_job(store)
    store.transition(job.id, JobStatus.VALIDATING)
    again = store.transition(job.id, JobStatus.VALIDATING)  # a retried step
    failed = store.transition(job.id, JobStatus.FAILED, reason="no valid line")
    assert again.started_at == failed.started_at
    for status in JobStatus:
        if status is JobStatus.FAILED:
            assert store.transition(job.id, status) == failed
        else:
            with pytest.raises(InvalidTransition):
                store.transition(job.id, status)
    assert store.get_job(job.id) == failed


def test_end_job_ends_live_jobs_and_leaves_ended_ones(store: JobStore):
    live, ended = make_job(store), make_job(store)
    store.transition(ended.id, JobStatus.VALIDATING)
    succeeded = store.transition(ended.id, JobStatus.SUCCEEDED)
    failed = store.end_job(live.id, JobStatus.FAILED, reason="run crashed")
    assert failed.status is JobStatus.FAILED and failed.status_reason == "run crashed" and failed.failed_at
    assert store.end_job(live.id, JobStatus.CANCELLED) == failed
    assert store.end_job(ended.id, "TIMEOUT_EXCEEDED", reason="late") == succeeded
    with pytest.raises(ValueError, match="terminal status"):
        store.end_job(live.id, JobStatus.RUNNING)
    with pytest.raises(JobNotFound):
        store.end_job("job_missing", JobStatus.FAILED)


# -- cancel -------------------------------------------------------------------------------


def test_cancel_live_job_then_dag_finishes_it(store: JobStore):
    job = make_job(store)
    store.transition(job.id, JobStatus.VALIDATING)
    store.transition(job.id, JobStatus.RUNNING)
    assert not store.get_job(job.id).cancel_requested
    cancelling = store.request_cancel(job.id)
    assert cancelling.status is JobStatus.CANCELLING and cancelling.cancel_requested
    assert cancelling.cancel_requested_at == cancelling.cancelling_at
    assert store.get_job(job.id).cancel_requested
    assert store.request_cancel(job.id) == cancelling  # idempotent: nothing moves
    store.transition(job.id, JobStatus.FINALIZING)
    cancelled = store.transition(job.id, JobStatus.CANCELLED)
    assert cancelled.cancel_requested_at == cancelling.cancel_requested_at
    assert cancelled.cancelled_at >= cancelled.cancelling_at
    assert store.get_job(job.id).status is JobStatus.CANCELLED  # still readable


def test_cancel_leaves_terminal_jobs_as_they_ended(store: JobStore):
    job = make_job(store)
    store.transition(job.id, JobStatus.VALIDATING)
    done = store.transition(job.id, JobStatus.SUCCEEDED)
    assert store.request_cancel(job.id) == done
    assert not store.get_job(job.id).cancel_requested
    with pytest.raises(JobNotFound):
        store.request_cancel("job_missing")


def test_cancel_of_a_queued_job_ends_it_at_once(store: JobStore):
    job = make_job(store)
    cancelled = store.request_cancel(job.id, owner="alice", reason="user asked")
    assert cancelled.status is JobStatus.CANCELLED and cancelled.terminal and cancelled.cancel_requested
    assert cancelled.status_reason.startswith("user asked before its input was read")
    assert cancelled.started_at is None and cancelled.cancelled_at == cancelled.completed_at
    assert cancelled.cancel_requested_at == cancelled.cancelled_at
    assert (cancelled.total, cancelled.completed) == (0, 0)
    assert store.request_cancel(job.id) == cancelled  # idempotent
    # Its run, starting later, finds it ended: a step moving it on is refused, and no step does.
    with pytest.raises(InvalidTransition):
        store.transition(job.id, JobStatus.VALIDATING)


# -- counts and other fields ----------------------------------------------------------------


def test_counts_set_and_add(store: JobStore):
    job = make_job(store)
    assert store.set_counts(job.id, total=10).total == 10
    store.add_counts(job.id, completed=3, succeeded=2, failed=1)
    job2 = store.add_counts(job.id, completed=2, succeeded=2)
    assert (job2.total, job2.completed, job2.succeeded, job2.failed) == (10, 5, 4, 1)
    job3 = store.set_counts(job.id, completed=10, succeeded=9, failed=1)
    assert (job3.total, job3.completed, job3.succeeded, job3.failed) == (10, 10, 9, 1)
    with pytest.raises(ValueError, match="failed must be >= 0"):
        store.set_counts(job.id, failed=-1)
    with pytest.raises(JobNotFound):
        store.add_counts("job_missing", completed=1)



def test_shard_rows_sum_into_live_counts_that_only_go_up(store: JobStore):
    """One row per shard; the job's counts are its invalid lines plus the rows' sums, and a
    stale report (read before a newer one was written) never lowers a row or the job."""
    job = make_job(store, resources={"gpus": 2})
    store.set_counts(job.id, total=20, completed=2, succeeded=0, failed=2, invalid=2)
    store.transition(job.id, "VALIDATING")
    store.transition(job.id, "RUNNING")
    store.report_shard(job.id, 0, state="running", total=9, done=6, succeeded=5, failed=1,
                       prompt_tokens=60, completion_tokens=30, cached_prompt_tokens=12, engine_seconds=3.0)
    both = store.report_shard(job.id, 1, state="running", total=9, done=4, succeeded=4, failed=0,
                              prompt_tokens=40, completion_tokens=20, engine_seconds=2.0)
    assert (both.completed, both.succeeded, both.failed) == (12, 9, 3)
    assert (both.prompt_tokens, both.completion_tokens, both.cached_prompt_tokens) == (100, 50, 12)
    assert both.engine_seconds == 5.0 and both.tokens_per_s == 20.0  # 30/3 + 20/2
    stale = store.report_shard(job.id, 0, state="running", total=9, done=3, succeeded=3, failed=0,
                               prompt_tokens=30, completion_tokens=15, engine_seconds=1.0)
    assert (stale.completed, stale.succeeded, stale.failed, stale.prompt_tokens) == (12, 9, 3, 100)
    ended = store.report_shard(job.id, 1, state="failed", total=9, done=5, succeeded=4, failed=1,
                               prompt_tokens=50, completion_tokens=25, engine_seconds=2.5,
                               reason="the worker failed (exit status 1)")
    assert (ended.completed, ended.succeeded, ended.failed) == (13, 9, 4)
    assert ended.tokens_per_s == 10.0  # only shard 0 still runs
    rows = store.shard_records(job.id)
    assert [(r.shard, r.done, r.state, r.reason) for r in rows] == [
        (0, 6, "running", None), (1, 5, "failed", "the worker failed (exit status 1)")]
    store.transition(job.id, "FINALIZING")
    final = store.set_counts(job.id, completed=20, succeeded=15, failed=5)
    late = store.report_shard(job.id, 0, state="done", total=9, done=9, succeeded=9, failed=0)
    assert (late.completed, late.succeeded, late.failed) == (20, 15, 5)  # not lowered by the sums
    store.transition(job.id, "SUCCEEDED")
    after_end = store.report_shard(job.id, 0, state="done", total=9, done=9, succeeded=9, failed=0)
    assert after_end == store.get_job(job.id) and final.completed == 20
    assert store.shard_records(job.id)[0].state == "done"
    store.delete_job(job.id)
    assert store.shard_records(job.id) == []
    with pytest.raises(JobNotFound):
        store.report_shard("job_missing", 0, state="running")


def test_concurrent_shard_reports_lose_nothing(store: JobStore):
    """Many watchers reporting at once: every report lands, the counts add up at the end."""
    job = make_job(store)
    store.set_counts(job.id, total=16 * 10, invalid=0)
    store.transition(job.id, "VALIDATING")
    store.transition(job.id, "RUNNING")

    def watcher(shard: int) -> None:
        for done in range(1, 11):
            ok = done - done // 3
            store.report_shard(job.id, shard, state="running", total=10, done=done, succeeded=ok,
                               failed=done - ok, completion_tokens=done)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(watcher, range(16)))
    job = store.get_job(job.id)
    assert (job.completed, job.succeeded, job.failed, job.completion_tokens) == (160, 16 * 7, 16 * 3, 160)


def test_owner_usage_counts_live_jobs_requests_files_and_adapters(store: JobStore):
    done = make_job(store, owner="carol")
    store.set_counts(done.id, total=7)
    store.transition(done.id, "FAILED", "x")
    live = make_job(store, owner="carol")
    store.set_counts(live.id, total=4)
    store.create_file(owner="carol", purpose="batch", filename="a", bytes=100, uri="/x/a")
    gone = store.create_file(owner="carol", purpose="batch", filename="b", bytes=50, uri="/x/b")
    store.mark_file_deleted(gone.id)
    store.create_adapter(owner="carol", name="bot", base="m", uri="/x/bot/", rank=8, bytes=30)
    store.create_adapter(owner="dave", name="bot", base="m", uri="/x/dave-bot/", rank=8, bytes=7)
    make_job(store, owner="dave")
    assert store.owner_usage("carol") == {"live_jobs": 1, "requests_in_flight": 4, "file_bytes": 130}
    store.delete_adapter("carol", "bot")
    assert store.owner_usage("carol")["file_bytes"] == 100
    assert [j.id for j in store.jobs_writing("/nowhere")] == []

def test_outputs_priority_and_dag_run(store: JobStore):
    job = make_job(store)
    errors = [{"code": "invalid_json", "message": "line 3: not JSON", "count": 2}]
    out = store.set_outputs(job.id, output_file_id="file-out", error_file_id="file-err", errors=errors)
    assert (out.output_file_id, out.error_file_id, out.errors) == ("file-out", "file-err", errors)
    assert store.set_outputs(job.id, output_uri="s3://b/o.jsonl").output_file_id == "file-out"  # others kept
    assert store.set_priority(job.id, 9, owner="alice").priority == 9
    assert store.set_dag_run(job.id, "api__job_1").dag_run_id == "api__job_1"
    assert store.get_job(job.id).updated_at > job.updated_at


# -- listing ------------------------------------------------------------------------------


@pytest.fixture
def listed(store: JobStore) -> list:
    """12 jobs, one minute apart, spread over owners, models, dialects and statuses."""
    jobs = []
    for i in range(12):
        job = make_job(
            store,
            owner="alice" if i % 3 else "bob",
            model="tiny" if i % 2 else "small",
            dialect=("openai", "mistral", "scale")[i % 3],
            metadata={"batch": f"b{i % 4}"},
            priority=i % 5,
            created_at=T0 + timedelta(minutes=i),
        )
        if i % 4 == 0:
            store.transition(job.id, JobStatus.VALIDATING)
            job = store.transition(job.id, JobStatus.FAILED)
        jobs.append(job)
    return jobs


def test_list_filters(store: JobStore, listed: list):
    def ids(**filters):
        page, total = store.list_jobs(**filters)
        assert total == len(page)
        return {j.id for j in page}

    def expect(pred):
        return {j.id for j in listed if pred(j)}

    assert ids(owner="alice") == expect(lambda j: j.owner == "alice")
    assert ids(statuses=[JobStatus.FAILED]) == expect(lambda j: j.status is JobStatus.FAILED)
    assert ids(statuses=["QUEUED", "FAILED"]) == expect(lambda j: True)
    assert ids(model="small", owner="bob") == expect(lambda j: j.model == "small" and j.owner == "bob")
    assert ids(dialect="mistral") == expect(lambda j: j.dialect == "mistral")
    assert ids(metadata={"batch": "b1"}) == expect(lambda j: j.metadata["batch"] == "b1")
    assert ids(metadata={"batch": "nope"}) == set()
    assert ids(created_after=T0 + timedelta(minutes=9)) == expect(lambda j: j.created_at > T0 + timedelta(minutes=9))
    assert len(ids(statuses=[])) == 0


def test_list_ordering(store: JobStore, listed: list):
    newest_first, _ = store.list_jobs()
    assert [j.id for j in newest_first] == [j.id for j in reversed(listed)]
    oldest_first, _ = store.list_jobs(order_by="created_at")
    assert [j.id for j in oldest_first] == [j.id for j in listed]
    by_priority, _ = store.list_jobs(order_by="-priority")
    assert [j.priority for j in by_priority] == sorted((j.priority for j in listed), reverse=True)
    with pytest.raises(ValueError, match="cannot order by 'owner'"):
        store.list_jobs(order_by="owner")
    with pytest.raises(ValueError, match="limit"):
        store.list_jobs(limit=0)


@pytest.mark.parametrize("order_by", ["-created_at", "created_at", "-priority", "priority"])
def test_pagination_offset_and_cursor_visit_each_job_once(store: JobStore, listed: list, order_by: str):
    everything = [j.id for j in store.list_jobs(order_by=order_by, limit=100)[0]]
    by_offset, by_cursor, after = [], [], None
    for offset in range(0, 12, 5):
        page, total = store.list_jobs(order_by=order_by, limit=5, offset=offset)
        assert total == 12
        by_offset += [j.id for j in page]
    while True:
        page, total = store.list_jobs(order_by=order_by, limit=5, after=after)
        if not page:
            break
        by_cursor += [j.id for j in page]
        after = page[-1].id
    assert by_offset == by_cursor == everything and len(set(everything)) == 12
    with pytest.raises(InvalidCursor):
        store.list_jobs(after="job_unknown")


def test_list_expires_before_finds_overdue_jobs(store: JobStore):
    soon = make_job(store, max_runtime_sec=1, created_at=T0)
    make_job(store, max_runtime_sec=3600, created_at=T0)
    make_job(store)
    overdue, total = store.list_jobs(expires_before=T0 + timedelta(minutes=1))
    assert [j.id for j in overdue] == [soon.id] and total == 1


def test_search_matches_id_prefix_file_name_path_and_labels_literally_per_owner(store: JobStore):
    upload = store.create_file(owner="alice", purpose="batch", filename="Prompts_50%.jsonl", bytes=1, uri="/f/1")
    by_file = make_job(store, id="job_aaa111", input={"file_ids": [upload.id]})
    by_path = make_job(store, id="job_bbb222", input={"uri": "/store/x/nightly-eval.jsonl", "path": "/data/nightly-eval.jsonl"})
    by_label = make_job(store, id="job_ccc333", labels={"team": "Search-Quality"})
    make_job(store, id="job_ddd444", owner="bob", labels={"team": "search-quality"})

    def found(text: str, owner: str | None = "alice") -> list[str]:
        jobs, total = store.list_jobs(owner=owner, search=text)
        assert total == len(jobs)
        return sorted(j.id for j in jobs)

    assert found("job_aaa") == [by_file.id]  # id prefix
    assert found("aaa111") == []  # an id matches by prefix only
    assert found("prompts_50%") == [by_file.id]  # file name, any case, % literal
    assert found("prompts_5_") == [] and found("%") == [by_file.id]  # wildcards are plain characters
    assert found("nightly") == [by_path.id]
    assert found("/store/x") == []  # the stored URI is ours, not the user's: only the path they gave
    assert found("search-quality") == [by_label.id]  # another owner's job is not listed
    assert found("team") == [by_label.id]  # a label key
    assert found("search-quality", owner=None) == sorted([by_label.id, "job_ddd444"])  # admins: every owner
    with pytest.raises(ValueError, match="1-200"):
        store.list_jobs(search="x" * 201)


def test_search_pages_with_the_keyset_cursor(store: JobStore):
    ids = [make_job(store, labels={"run": "sweep"}, created_at=T0 + timedelta(seconds=i)).id for i in range(5)]
    make_job(store, labels={"run": "other"})
    seen, after = [], None
    while True:
        jobs, total = store.list_jobs(search="sweep", limit=2, after=after)
        assert total == 5
        seen += [j.id for j in jobs]
        if len(jobs) < 2:
            break
        after = jobs[-1].id
    assert seen == ids[::-1]


def test_a_derived_job_names_its_source(store: JobStore):
    from llm_batch.core.job_request import DerivedFrom

    source = make_job(store)
    retry = make_job(store, derived_from=DerivedFrom(source.id, "retry"))
    assert store.get_job(retry.id).derived_from == DerivedFrom(source.id, "retry")
    assert source.derived_from is None
    with pytest.raises(ValueError, match="unknown"):
        DerivedFrom(source.id, "clone")


# -- files --------------------------------------------------------------------------------


def test_files_crud_and_ownership(store: JobStore):
    f = store.create_file(owner="alice", purpose="batch", filename="in.jsonl", bytes=3 * 1024**3, uri="/x/in.jsonl")
    assert f.id.startswith("file-") and f.kind == "input" and f.bytes == 3 * 1024**3  # > 2**31 fits
    out = store.create_file(owner="alice", purpose="batch_output", filename="o.jsonl", bytes=5, uri="/x/o", kind="output", job_id="job_1")
    store.create_file(owner="bob", purpose="batch", filename="b.jsonl", bytes=1, uri="/x/b")
    assert store.get_file(f.id, owner="alice") == f
    assert store.get_file(f.id, owner="bob") is None
    files, total = store.list_files(owner="alice")
    assert total == 2 and [x.id for x in files] == [out.id, f.id]
    assert [x.id for x in store.list_files(job_id="job_1")[0]] == [out.id]
    assert store.list_files(kind="output")[1] == 1
    with pytest.raises(FileNotFound):
        store.mark_file_deleted(f.id, owner="bob")
    deleted = store.mark_file_deleted(f.id, owner="alice")
    assert deleted.deleted and store.mark_file_deleted(f.id) == deleted  # idempotent
    assert store.get_file(f.id) is None and store.get_file(f.id, include_deleted=True) == deleted
    assert store.list_files(owner="alice")[1] == 1
    assert store.list_files(owner="alice", include_deleted=True)[1] == 2
    with pytest.raises(ValueError, match="file kind 'weird'"):
        store.create_file(owner="a", purpose="batch", filename="x", bytes=1, uri="/x", kind="weird")


# -- owners' adapters ---------------------------------------------------------------------


def test_owner_adapters_are_their_owners_alone(store: JobStore):
    mine = store.create_adapter(owner="alice", name="bot", base="tiny", uri="/w/adapters/alice/bot-1/", rank=8, bytes=9)
    assert (mine.owner, mine.name, mine.base, mine.rank, mine.bytes) == ("alice", "bot", "tiny", 8, 9)
    assert mine.id.startswith("adapter-") and mine.created_at.tzinfo is not None
    store.create_adapter(owner="alice", name="another", base="tiny", uri="/w/a/", rank=16, bytes=1)
    theirs = store.create_adapter(owner="bob", name="bot", base="other", uri="/w/b/", rank=4, bytes=1)  # same name, another owner
    with pytest.raises(AdapterExists, match="'alice' already has an adapter named 'bot'"):
        store.create_adapter(owner="alice", name="bot", base="tiny", uri="/w/c/", rank=8, bytes=1)
    assert [a.name for a in store.list_adapters("alice")] == ["another", "bot"]
    assert store.list_adapters("bob") == [theirs] and store.list_adapters("carol") == []
    assert store.get_adapter("alice", "bot") == mine and store.get_adapter("carol", "bot") is None
    with pytest.raises(AdapterNotFound):
        store.delete_adapter("carol", "bot")
    assert store.delete_adapter("alice", "bot") == mine
    assert store.get_adapter("alice", "bot") is None and store.get_adapter("bob", "bot") == theirs
    with pytest.raises(AdapterNotFound):
        store.delete_adapter("alice", "bot")
    again = store.create_adapter(owner="alice", name="bot", base="tiny", uri="/w/d/", rank=8, bytes=1)  # the name is free again
    assert again.id != mine.id


# -- API keys -----------------------------------------------------------------------------


def test_api_keys_create_authenticate_revoke(store: JobStore):
    record, plaintext = store.create_api_key("alice", "laptop")
    admin, admin_plaintext = store.create_api_key("root", "ops", is_admin=True)
    assert plaintext.startswith("lbk_") and plaintext != admin_plaintext
    assert plaintext not in repr(record) and record.prefix == plaintext[: len(record.prefix)]
    assert store.authenticate_api_key(plaintext) == "alice"
    assert store.identify_api_key(admin_plaintext).is_admin is True
    assert store.identify_api_key(plaintext).is_admin is False
    assert store.authenticate_api_key(plaintext[:-1] + ("A" if plaintext[-1] != "A" else "B")) is None
    assert store.authenticate_api_key("") is None and store.authenticate_api_key("garbage") is None
    with pytest.raises(ApiKeyNotFound):
        store.revoke_api_key(record.id, owner="bob")
    revoked = store.revoke_api_key(record.id, owner="alice")
    assert revoked.revoked and store.authenticate_api_key(plaintext) is None
    assert store.authenticate_api_key(admin_plaintext) == "root"
    assert [k.id for k in store.list_api_keys()] == [admin.id]
    assert len(store.list_api_keys(include_revoked=True)) == 2


# -- concurrency --------------------------------------------------------------------------


def test_200_concurrent_submissions_and_counter_updates_from_threads(store: JobStore):
    def submit(i: int):
        job = make_job(store, owner=f"user{i % 7}", metadata={"n": str(i)})
        store.add_counts(job.id, total=1)
        return job.id

    with ThreadPoolExecutor(max_workers=16) as pool:
        ids = list(pool.map(submit, range(200)))
    assert len(set(ids)) == 200
    jobs, total = store.list_jobs(limit=1000)
    assert total == 200 and {j.id for j in jobs} == set(ids)
    assert sorted(int(j.metadata["n"]) for j in jobs) == list(range(200))
    assert all(j.total == 1 for j in jobs)

    # Many workers reporting progress on one job at once: every increment counts.
    target = ids[0]
    with ThreadPoolExecutor(max_workers=16) as pool:
        list(pool.map(lambda i: store.add_counts(target, completed=1, succeeded=i % 2, failed=1 - i % 2), range(300)))
    job = store.get_job(target)
    assert (job.completed, job.succeeded, job.failed) == (300, 150, 150)


def test_racing_terminal_moves_have_exactly_one_winner(store: JobStore):
    job = make_job(store)
    store.transition(job.id, JobStatus.VALIDATING)
    store.transition(job.id, JobStatus.RUNNING)
    terminal = [JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED, JobStatus.TIMEOUT_EXCEEDED]

    def attempt(i: int) -> tuple[str, JobStatus | None]:
        status = terminal[i % 4]
        if i % 3 == 0:  # end_job never raises: it reports how the job ended
            return "end", store.end_job(job.id, status).status
        if i % 3 == 1:
            return "cancel", store.request_cancel(job.id).status
        try:
            return "move", store.transition(job.id, status).status
        except InvalidTransition:
            return "move", None

    with ThreadPoolExecutor(max_workers=8) as pool:
        outcomes = list(pool.map(attempt, range(30)))
    final = store.get_job(job.id)
    assert final.status in TERMINAL_STATUSES and final.completed_at is not None
    # Whatever raced, each call saw either the one final status or a live state before it.
    ended = [status for kind, status in outcomes if status is not None and status.terminal]
    assert ended and set(ended) == {final.status}
    assert all(status in (JobStatus.CANCELLING, final.status) for kind, status in outcomes if kind == "cancel")
