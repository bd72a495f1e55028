"""Keep a batch_inference run and its job in agreement, whatever ended the run.

Airflow calls these hooks in the process that changed the run's state:

- a user marking a run failed / success (UI or ``PATCH /api/v2/.../dagRuns/{id}``): the
  **api-server** (``api_fastapi.core_api.services.public.dag_run.patch_dag_run_state``,
  msg "Dag Run's state was manually set to `failed`.");
- a run the scheduler ends (its tasks finished, a task failed for good, dagrun_timeout):
  the **scheduler** (``DagRun.notify_dagrun_state_changed``).

Both have a metadata-database session, so the hooks only need the job store: the FastAPI
app of the plugin is not required (it is built in the api-server only).

What they do:

- run failed or marked success while its job is live: the job's workers are told to stop
  (cancel flag + cancel marker) and the job ends at once, with a reason saying who ended
  the run (a user marking it, or the scheduler's reason);
- every ended run of the batch DAG gets a note: the job's status, counts and a link to it
  (the run of a CANCELLED / TIMEOUT_EXCEEDED job is also failed by ``finalize``).

A failure here is logged and never breaks the caller (the scheduler loop, the API call).
"""

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
    """The note of a run: its job's status, counts, reason and link (markdown). The id and
    the reason may hold what a user wrote (a conf's job_id, a path, a model name): escaped."""
    counts = f"{job.succeeded} succeeded, {job.failed} failed of {job.total}" if job.total is not None else "no counts"
    return (f"**llm-batch job {escape(job.id)}: {job.status.value}** ({counts})\n\n"
            f"{escape(job.status_reason or '')}\n\n[job status]({job_link(job.id)})")


def end_job_of_run(dag_run: Any, state: str, msg: str | None) -> Any:
    """End the live job of `dag_run`, which ended in `state` ("failed" / "success").
    Returns the job (None when the store has none)."""
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
    # Stop its workers (a shard task killed by the state change may leave one behind).
    job = store.request_cancel(job_id, reason=reason)
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
    """A run a user marked failed can still be ended success by the scheduler when the
    metadata DB is SQLite (no row locks: the scheduler's loop read the run as running before
    the mark was committed, then found its tasks finished). The job kept what the user did,
    so the run goes back to failed. Returns whether it did."""
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
        if job is not None and job.terminal:
            _set_note(dag_run, run_note(job))
    except Exception:  # noqa: BLE001 - never break the scheduler loop or the API call
        log.exception("llm-batch: could not reconcile the job of run %s", getattr(dag_run, "run_id", "?"))


def _set_note(dag_run: Any, note: str) -> None:
    """The run's note, in the caller's session (the scheduler's or the API call's: it
    commits it with the state change). A run object without one (in-process dag.test
    callers) keeps its note."""
    if object_session(dag_run) is None:
        log.debug("run %s is not bound to a session: no note", dag_run.run_id)
        return
    dag_run.note = note


@hookimpl
def on_dag_run_failed(dag_run: Any, msg: str) -> None:
    _on_run_end(dag_run, "failed", msg)


@hookimpl
def on_dag_run_success(dag_run: Any, msg: str) -> None:
    _on_run_end(dag_run, "success", msg)
