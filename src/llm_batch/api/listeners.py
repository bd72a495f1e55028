"""Keep a batch_inference run and its job in agreement, whatever ended the run (docs/orchestration.md
"Runs and jobs agree"). A failure is logged, never raised into the scheduler loop or the API call."""

from __future__ import annotations

import logging
from typing import Any
from urllib.parse import quote

from airflow.configuration import conf
from airflow.listeners import hookimpl
from airflow.utils.state import DagRunState
from sqlalchemy.orm import object_session

from llm_batch.core.config import get_settings
from llm_batch.core.jobs import JobStatus
from llm_batch.core.layout import JobLayout
from llm_batch.core.markdown import escape
from llm_batch.core.run_conf import BATCH_DAG_ID, run_job_id
from llm_batch.infra import storage
from llm_batch.pipeline.shard_task import write_cancel_marker

log = logging.getLogger("llm_batch.listeners")


def _manual(msg: str | None) -> bool:
    return "manually set" in (msg or "")


def _store():
    from llm_batch.infra.jobstore import get_job_store  # heavy

    return get_job_store(get_settings().database_url)


def _job_id(dag_run: Any) -> str:
    return run_job_id(dag_run.conf or {}, dag_run.run_id)


def job_link(job_id: str) -> str:
    """Where the job is seen: its page on Airflow's Batch jobs view (docs/ui.md)."""
    try:
        base = (conf.get("api", "base_url", fallback="") or "").rstrip("/")
    except Exception:  # noqa: BLE001
        base = ""
    return f"{base}/batch/ui/jobs#job={quote(job_id, safe='')}"


def run_note(job: Any) -> str:
    """The run's note in markdown; the id and the reason may hold what a user wrote: escaped."""
    counts = f"{job.succeeded} succeeded, {job.failed} failed of {job.total}" if job.total is not None else "no counts"
    return (f"**llm-batch job {escape(job.id)}: {job.status.value}** ({counts})\n\n"
            f"{escape(job.status_reason or '')}\n\n[job status]({job_link(job.id)})")


def end_job_of_run(dag_run: Any, state: str, msg: str | None) -> Any:
    """End the live job of `dag_run`, which ended in `state` ("failed" / "success"); stops its workers."""
    store = _store()
    job_id = _job_id(dag_run)
    job = store.get_job(job_id)
    if job is None or job.terminal or job.dag_run_id not in (None, dag_run.run_id):
        return job
    if _manual(msg):
        reason = user_mark_reason(dag_run.run_id, state)
    elif state == "failed":
        reason = f"the DAG run {dag_run.run_id} failed ({msg or 'no reason given'})"
    else:
        reason = f"the DAG run {dag_run.run_id} ended ({msg or state}) before the job finished"
    if job.status != JobStatus.QUEUED:  # (cancelling a queued one would end it CANCELLED)
        job = store.request_cancel(job_id, reason=reason)
    # A shard task killed by the state change may leave a worker behind.
    try:
        write_cancel_marker(JobLayout(get_settings().work_uri, job_id).cancel_marker, job)
    except storage.StorageError as exc:
        log.warning("job %s: could not write the cancel marker: %s", job_id, exc)
    status = JobStatus.FAILED if state == "failed" else JobStatus.CANCELLED
    job = store.end_job(job_id, status, reason)
    log.info("job %s ended %s: %s", job_id, job.status.value, reason)
    return job


def user_mark_reason(run_id: str, state: str) -> str:
    return f"a user marked the DAG run {run_id} {state}"


def keep_a_users_failed_mark(dag_run: Any, state: str, msg: str | None, job: Any) -> bool:
    """On SQLite (no row locks) the scheduler can end success a run a user just marked failed:
    the job kept the mark, so the run goes back to failed. Returns whether it did."""
    if state != "success" or _manual(msg) or job is None or job.status.value != "FAILED":
        return False
    if user_mark_reason(dag_run.run_id, "failed") not in (job.status_reason or ""):
        return False
    dag_run.set_state(DagRunState.FAILED)
    log.warning("run %s: a user marked it failed, the scheduler then ended it success; kept failed", dag_run.run_id)
    return True


def _on_run_end(dag_run: Any, state: str, msg: str | None) -> None:
    if getattr(dag_run, "dag_id", None) != BATCH_DAG_ID:
        return
    try:
        if keep_a_users_failed_mark(dag_run, state, msg, _store().get_job(_job_id(dag_run))):
            return
        job = end_job_of_run(dag_run, state, msg)
        # Committed by the caller with the state change (dag.test's run has no session: no note).
        if job is not None and job.terminal and object_session(dag_run) is not None:
            dag_run.note = run_note(job)
    except Exception:  # noqa: BLE001 - never break the scheduler loop or the API call
        log.exception("llm-batch: could not reconcile the job of run %s", getattr(dag_run, "run_id", "?"))


@hookimpl
def on_dag_run_failed(dag_run: Any, msg: str) -> None:
    _on_run_end(dag_run, "failed", msg)


@hookimpl
def on_dag_run_success(dag_run: Any, msg: str) -> None:
    _on_run_end(dag_run, "success", msg)
