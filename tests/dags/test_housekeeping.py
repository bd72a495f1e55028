"""llm_batch_housekeeping with dag.test(): run states come through Airflow's Execution API."""

from __future__ import annotations

from datetime import timedelta

import pytest

from llm_batch.core.config import get_settings
from llm_batch.core.jobs import JobStatus
from llm_batch.infra.jobstore import get_job_store, utcnow

pytestmark = [pytest.mark.airflow]


def test_housekeeping_expires_and_reconciles(dag_bag):
    store = get_job_store(get_settings().database_url)
    # A real batch_inference run that ended (failed at register: multi-node refused).
    batch_run = dag_bag.get_dag("batch_inference").test(
        run_conf={"job_id": "job_hk_refused", "input_uri": "/x.jsonl", "nodes_per_worker": 3}
    )
    assert batch_run.state == "failed"
    # A job left RUNNING although that run is over (as if its finalize never ran) ...
    orphan = store.create_job(dialect="openai", endpoint="/v1/chat/completions", model="m", owner="o",
                              max_runtime_sec=3600, dag_run_id=batch_run.run_id)
    for status in (JobStatus.VALIDATING, JobStatus.RUNNING):
        store.transition(orphan.id, status)
    # ... one long past its expires_at, and one still fine.
    stale = store.create_job(dialect="openai", endpoint="/v1/chat/completions", model="m", owner="o",
                             created_at=utcnow() - timedelta(hours=3), max_runtime_sec=60)
    fresh = store.create_job(dialect="openai", endpoint="/v1/chat/completions", model="m", owner="o",
                             max_runtime_sec=3600)

    run = dag_bag.get_dag("llm_batch_housekeeping").test()

    assert run.state == "success"
    assert store.get_job(stale.id).status == JobStatus.TIMEOUT_EXCEEDED
    reconciled = store.get_job(orphan.id)
    assert reconciled.status == JobStatus.FAILED and "before the shards' results were merged" in reconciled.status_reason
    assert store.get_job(fresh.id).status == JobStatus.QUEUED
