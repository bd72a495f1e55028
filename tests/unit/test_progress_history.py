"""The job store's progress history (the UI's plots), on SQLite and on a real PostgreSQL
(the ``store_url`` fixture of test_jobstore.py: ``-m "not postgres"`` deselects it)."""

from __future__ import annotations

from datetime import timedelta

import pytest

from llm_batch.infra.jobstore import JobStore
from llm_batch.infra.jobstore import progress as progress_module
from tests.unit.test_jobstore import T0, make_job, store, store_url  # noqa: F401 (fixtures)


def _running(store: JobStore, total: int = 100):
    job = make_job(store)
    store.set_counts(job.id, total=total)
    store.transition(job.id, "VALIDATING")
    store.transition(job.id, "RUNNING")
    return job


def test_report_shard_appends_a_point_with_the_jobs_live_counts(store: JobStore):
    store.history_interval_s = 0
    job = _running(store)
    assert store.progress_history(job.id) == []
    store.report_shard(job.id, 0, state="running", total=100, done=10, succeeded=9, failed=1,
                       completion_tokens=50, engine_seconds=5.0)
    store.report_shard(job.id, 0, state="running", total=100, done=30, succeeded=28, failed=2,
                       completion_tokens=200, engine_seconds=10.0)
    points = store.progress_history(job.id)
    assert [(p.completed, p.succeeded, p.failed, p.total) for p in points] == [(10, 9, 1, 100), (30, 28, 2, 100)]
    assert [p.tokens_per_s for p in points] == [10.0, 20.0]
    assert points[0].at < points[1].at and points[0].at.tzinfo is not None


def test_points_are_at_most_one_per_interval_per_job(store: JobStore):
    store.history_interval_s = 3600
    job, other = _running(store), _running(store)
    for done in range(1, 6):
        store.report_shard(job.id, 0, state="running", total=100, done=done, succeeded=done)
    store.report_shard(other.id, 0, state="running", total=100, done=1, succeeded=1)
    assert [p.completed for p in store.progress_history(job.id)] == [1]  # the first report only
    assert len(store.progress_history(other.id)) == 1  # per job, not global


def test_history_is_thinned_evenly_and_keeps_first_and_last(store: JobStore, monkeypatch: pytest.MonkeyPatch):
    clock = iter(T0 + timedelta(seconds=i) for i in range(10_000))  # a report each second
    monkeypatch.setattr(progress_module, "utcnow", lambda: next(clock))
    store.history_interval_s = 0
    store.max_history_points = 20
    job = _running(store, total=1000)
    for done in range(1, 101):
        store.report_shard(job.id, 0, state="running", total=1000, done=done, succeeded=done)
    points = store.progress_history(job.id)
    assert 10 <= len(points) <= 20
    assert points[0].completed == 1 and points[-1].completed == 100
    assert [p.completed for p in points] == sorted(p.completed for p in points)
    gaps = [(b.at - a.at).total_seconds() for a, b in zip(points, points[1:])]
    mean = (points[-1].at - points[0].at).total_seconds() / len(gaps)
    assert max(gaps) <= 2.5 * mean  # even over the whole run, not a blurred start


def test_history_follows_ownership_and_ended_jobs_and_deletion(store: JobStore):
    store.history_interval_s = 0
    job = _running(store)
    store.report_shard(job.id, 0, state="running", total=100, done=5, succeeded=5)
    assert len(store.progress_history(job.id, owner="alice")) == 1
    assert store.progress_history(job.id, owner="bob") == []  # someone else's: nothing
    assert store.progress_history("no-such-job") == []
    store.end_job(job.id, "CANCELLED")
    store.report_shard(job.id, 0, state="cancelled", total=100, done=7, succeeded=7)  # ended: left alone
    assert len(store.progress_history(job.id)) == 1
    store.delete_job(job.id)
    assert store.progress_history(job.id) == []


def test_default_interval_and_cap(store: JobStore):
    assert store.history_interval_s == progress_module.HISTORY_INTERVAL_S > 0
    assert store.max_history_points == progress_module.MAX_HISTORY_POINTS == 500
    job = _running(store)
    store.report_shard(job.id, 0, state="running", total=100, done=1, succeeded=1)
    store.report_shard(job.id, 0, state="running", total=100, done=2, succeeded=2)
    (point,) = store.progress_history(job.id)
    assert point.completed == 1 and timedelta(0) <= point.at - job.created_at
