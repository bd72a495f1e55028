"""A batch_inference run and its job agree on the real stack: a user marking a running
run failed (PATCH /api/v2/dags/batch_inference/dagRuns/{id}) ends the job FAILED with a
reason naming the mark and stops its workers; clearing the run's tasks afterwards does not
bring the job back to life. The plugin loads once (no import error, listed once)."""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest

from tests.e2e.conftest import FEW_SEQS, MODEL, AirflowAPI, hold_shards, long_batch, shard_pids, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.engine, pytest.mark.airflow]

JOB_TIMEOUT = 420
DAG = "batch_inference"


def _job(stack: Any, job_id: str) -> Any:
    from llm_batch.infra.jobstore import get_job_store

    return get_job_store(stack.settings.database_url).get_job(job_id)


def _counts(job: Any) -> tuple:
    return (job.status.value, job.total, job.succeeded, job.failed)


def test_plugin_loads_once(e2e_stack, airflow):
    errors = airflow.call("GET", "/importErrors", params={"limit": 100})["import_errors"]
    bad = [e for e in errors if "llm_batch" in (e.get("stack_trace") or "") + (e.get("filename") or "")]
    assert bad == [], bad
    plugins = airflow.call("GET", "/plugins", params={"limit": 100})["plugins"]
    assert [p["name"] for p in plugins].count("llm_batch") == 1, [p["name"] for p in plugins]
    listed = next(p for p in plugins if p["name"] == "llm_batch")
    assert any("listeners" in str(x) for x in listed.get("listeners") or []), listed


def test_marking_a_run_failed_fails_its_job_and_clearing_does_not_revive_it(
        e2e_stack, airflow, batch_client, job_logs, tmp_path):
    batch = long_batch(tmp_path / "mark.jsonl", 80, first_tokens=8, step=1)
    file_id = batch_client.upload(batch)
    job_id = f"e2e_mark_{uuid.uuid4().hex[:12]}"
    hold_shards(job_id, 1)  # mid-run when the run is marked failed, by construction
    job_logs.append(job_id)
    conf = {"job_id": job_id, "input_file_ids": [file_id], "endpoint": "/v1/chat/completions", "model": MODEL,
            "owner": "admin", "model_config": FEW_SEQS}
    run_id = airflow.trigger(DAG, conf)

    wait_until(f"the worker of {job_id}", lambda: shard_pids(e2e_stack, job_id), JOB_TIMEOUT)
    wait_until(f"job {job_id} to finish its first request",
               lambda: (lambda j: j is not None and (j.succeeded > 0 or j.terminal))(_job(e2e_stack, job_id)), JOB_TIMEOUT, 0.5)
    assert not _job(e2e_stack, job_id).terminal, _job(e2e_stack, job_id)

    airflow.call("PATCH", f"/dags/{DAG}/dagRuns/{run_id}", json={"state": "failed"})
    marked_at = time.monotonic()
    job = wait_until(f"job {job_id} to end", lambda: (lambda j: j if j.terminal else None)(_job(e2e_stack, job_id)), 30, 0.5)
    assert job.status.value == "FAILED", job
    assert f"a user marked the DAG run {run_id} failed" in (job.status_reason or ""), job.status_reason
    wait_until(f"the workers of {job_id} to stop", lambda: not shard_pids(e2e_stack, job_id),
               max(5.0, 45 - (time.monotonic() - marked_at)))
    run = airflow.call("GET", f"/dags/{DAG}/dagRuns/{run_id}")
    assert run["state"] == "failed", run
    assert job_id in (run.get("note") or "") and "FAILED" in (run.get("note") or ""), run.get("note")

    # No shard keeps writing: the counts hold still.
    ended = _counts(_job(e2e_stack, job_id))
    time.sleep(8)
    assert _counts(_job(e2e_stack, job_id)) == ended

    # 1. Clearing the interrupted shard task (and what follows it): the runner sees the job
    #    ended and starts no worker; 2. clearing every task of the run: plan maps no shard.
    shard_task = next(ti for ti in airflow.call("GET", f"/dags/{DAG}/dagRuns/{run_id}/taskInstances",
                                                params={"limit": 100})["task_instances"]
                      if ti["task_id"].startswith("run_shard") and ti["map_index"] >= 0)
    assert shard_task["state"] == "failed", shard_task
    _clear_and_watch(e2e_stack, airflow, run_id, job_id, ended, task_ids=[shard_task["task_id"]], include_downstream=True)
    shard_after = airflow.call("GET", f"/dags/{DAG}/dagRuns/{run_id}/taskInstances/{shard_task['task_id']}/0")
    assert shard_after["try_number"] > shard_task["try_number"] and shard_after["state"] == "success", shard_after
    _clear_and_watch(e2e_stack, airflow, run_id, job_id, ended)
    job = _job(e2e_stack, job_id)
    assert _counts(job) == ended, job
    assert f"a user marked the DAG run {run_id} failed" in (job.status_reason or "")
    assert airflow.call("GET", f"/dags/{DAG}/dagRuns/{run_id}")["state"] == "failed"


def _clear_and_watch(stack: Any, airflow: AirflowAPI, run_id: str, job_id: str, ended: tuple, **body: Any) -> None:
    """Clear tasks of the run; until the run ends again no worker starts and the job holds."""
    before = {(ti["task_id"], ti["map_index"]): ti["try_number"] for ti in airflow.call(
        "GET", f"/dags/{DAG}/dagRuns/{run_id}/taskInstances", params={"limit": 100})["task_instances"]}
    cleared = airflow.call("POST", f"/dags/{DAG}/clearTaskInstances",
                           json={"dag_run_id": run_id, "dry_run": False, "only_failed": False,
                                 "reset_dag_runs": True, **body})
    assert cleared["task_instances"], cleared

    def rerun_over() -> bool:
        state = airflow.call("GET", f"/dags/{DAG}/dagRuns/{run_id}")["state"]
        tis = airflow.call("GET", f"/dags/{DAG}/dagRuns/{run_id}/taskInstances", params={"limit": 100})
        finalize = next(ti for ti in tis["task_instances"] if ti["task_id"] == "finalize")
        return state in ("success", "failed") and finalize["try_number"] > before[("finalize", -1)]

    saw_worker = False
    deadline = time.monotonic() + JOB_TIMEOUT
    while time.monotonic() < deadline and not rerun_over():
        saw_worker = saw_worker or bool(shard_pids(stack, job_id))
        assert _counts(_job(stack, job_id)) == ended, _job(stack, job_id)
        time.sleep(1)
    assert rerun_over(), f"run {run_id} did not end again after the clear"
    assert not saw_worker, "a cleared shard task started a worker for the ended job"
    assert _counts(_job(stack, job_id)) == ended


def test_a_run_refused_at_prepare_leaves_a_failed_job_and_a_note(e2e_stack, airflow, batch_client, tmp_path):
    """A run that admission refuses when it registers (its input file deleted after the
    trigger, which admitted it: the trigger form and /api/v2 refuse a bad conf themselves,
    tests/api/test_same_refusal.py): prepare fails once with the reason, the job is FAILED with
    it (the page and the API show it), and the run's note (the real plugin's run-end listener)
    says why. The DAG is paused from the trigger to the delete: the order by construction."""
    batch = long_batch(tmp_path / "refused.jsonl", 2)
    file_id = batch_client.upload(batch)
    job_id = f"e2e_refused_{uuid.uuid4().hex[:12]}"
    conf = {"job_id": job_id, "input_file_ids": [file_id], "endpoint": "/v1/chat/completions", "model": MODEL,
            "owner": "admin"}
    airflow.call("PATCH", f"/dags/{DAG}", json={"is_paused": True})
    try:
        run_id = airflow.trigger(DAG, conf)
        batch_client._call("DELETE", f"/v1/files/{file_id}")
    finally:
        airflow.call("PATCH", f"/dags/{DAG}", json={"is_paused": False})
    run = wait_until(f"run {run_id} to end", lambda: (lambda r: r if r["state"] in ("failed", "success") else None)(
        airflow.call("GET", f"/dags/{DAG}/dagRuns/{run_id}")), 180, 1.0)
    assert run["state"] == "failed", run
    job = _job(e2e_stack, job_id)
    assert job is not None and job.status.value == "FAILED", job
    assert file_id in job.status_reason and "input_file_ids[0]" in job.status_reason, job.status_reason
    note = wait_until(f"the note of {run_id}", lambda: airflow.call("GET", f"/dags/{DAG}/dagRuns/{run_id}").get("note"),
                      30, 0.5)
    assert "FAILED" in note and "refused" in note and "No file found" in note, note  # (markdown-escaped)
    # The native API shows the job and its reason.
    native = batch_client.get_job(job_id)
    assert native["status"] == "FAILED" and file_id in str(native), native
