"""Every job's batch_inference run has a logical date: the job's submission time.

Airflow's scheduler picks waiting tasks by priority weight, then by their run's logical
date; a run without one sorts first on SQLite and last on PostgreSQL, so API jobs jumped
(or fell behind) runs from the form. Here the runs are really triggered in Airflow's
metadata DB (tests/api/conftest.py).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from tests.api.conftest import chat_lines

pytestmark = pytest.mark.usefixtures("airflow_dags_in_db")


def _logical_date(job_id: str) -> datetime | None:
    from airflow.models.dagrun import DagRun
    from airflow.utils.session import create_session

    from llm_batch.api.dag_trigger import run_id_for

    with create_session() as session:
        run = session.query(DagRun).filter(DagRun.dag_id == "batch_inference", DagRun.run_id == run_id_for(job_id)).one()
        return run.logical_date


def test_runs_are_ordered_by_submission_time(client, creds, api_store):
    ids = []
    for _ in range(3):
        made = client.post("/v1/jobs", headers=creds.key("alice"), json={
            "model": "tiny-random-llama", "requests": [{"custom_id": "a", "body": {"messages": [{"role": "user", "content": "hi"}]}}]})
        assert made.status_code in (200, 201), made.text
        ids.append(made.json()["id"])
    dates = [_logical_date(job_id) for job_id in ids]
    assert all(d is not None for d in dates)
    assert dates == sorted(dates) and len(set(dates)) == 3
    for job_id, date in zip(ids, dates, strict=True):
        assert date == api_store.get_job(job_id).created_at  # to the microsecond


def test_a_job_made_in_the_same_microsecond_takes_the_next_one(airflow_dags_in_db):
    from airflow.utils.session import create_session

    from llm_batch.api.dag_trigger import trigger_batch_dag

    instant = datetime.now(UTC).replace(microsecond=500) + timedelta(days=1)
    with create_session() as session:
        first = trigger_batch_dag("same-instant-1", {"job_id": "same-instant-1"}, instant, "alice", session)
    with create_session() as session:
        second = trigger_batch_dag("same-instant-2", {"job_id": "same-instant-2"}, instant, "alice", session)
    assert first != second
    assert _logical_date("same-instant-1") == instant
    assert _logical_date("same-instant-2") == instant + timedelta(microseconds=1)


def test_an_openai_batch_run_has_its_date_too(client, creds):
    # An uploaded file's job gets its date too (the OpenAI way in).
    up = client.post("/v1/files", headers=creds.key("bob"), files={"file": ("b.jsonl", chat_lines(2))}, data={"purpose": "batch"})
    assert up.status_code == 200, up.text
    made = client.post("/v1/batches", headers=creds.key("bob"), json={
        "input_file_id": up.json()["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"})
    assert made.status_code == 200, made.text
    assert _logical_date(made.json()["id"]) is not None
