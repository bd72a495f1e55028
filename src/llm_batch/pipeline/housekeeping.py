"""Housekeeping of the job store: end expired jobs, reconcile jobs whose run ended without
finalizing them, delete files past their retention and ended jobs (no Airflow here).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import suppress
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from llm_batch.core.config import Settings
from llm_batch.core.jobs import JobStatus
from llm_batch.infra import storage
from llm_batch.pipeline import result_cache
from llm_batch.pipeline.steps import fail_job, finalize, layout_of, merge

if TYPE_CHECKING:
    from llm_batch.infra.jobstore import FileObject, FileRepository, IdempotencyRepository, Job, JobRepository, JobStore

log = logging.getLogger("llm_batch.pipeline.housekeeping")


def live_jobs(store: JobRepository, **filters: Any) -> Iterator[Job]:
    """Every job not yet terminal (paged through the store), oldest first."""
    live = [s for s in JobStatus if not s.terminal]
    while True:
        page, _ = store.list_jobs(statuses=live, order_by="created_at", limit=500, **filters)
        yield from page
        if len(page) < 500:
            return
        filters["after"] = page[-1].id


def expire(store: JobStore, settings: Settings, now: datetime | None = None) -> list[str]:
    """End as TIMEOUT_EXCEEDED the live jobs past their expires_at (+ the cancel grace, by which
    their workers have stopped), their finished results merged first; returns their ids."""
    cutoff = (now or datetime.now(UTC)) - timedelta(seconds=settings.cancel_grace_seconds)
    expired = []
    for job in list(live_jobs(store, expires_before=cutoff)):
        _end(store, settings, job.id, f"expired: the job passed its expires_at ({job.expires_at})")
        expired.append(job.id)
    return expired


def _end(store: JobStore, settings: Settings, job_id: str, why: str) -> None:
    """Merge and finalize a job outside its run; if that fails, FAILED with `why`."""
    try:
        merge(store, settings, job_id)
        finalize(store, settings, job_id)
    except Exception as exc:  # noqa: BLE001 - whatever happens, the job must end
        log.warning("job %s: could not merge and finalize (%s)", job_id, exc)
        fail_job(store, job_id, f"{why}; its results could not be merged: {exc}")
        return
    fail_job(store, job_id, why)  # only if finalize left it live (it never should)


def reconcile(store: JobStore, settings: Settings, run_states: dict[str, str]) -> list[str]:
    """Live jobs whose DAG run has ended (``run_states``: dag_run_id -> Airflow state) were
    not finalized (a killed run, a scheduler crash): merge what exists and finalize them."""
    reconciled = []
    for job in list(live_jobs(store)):
        state = run_states.get(job.dag_run_id or "")
        if state not in ("success", "failed"):
            continue
        _end(store, settings, job.id, f"reconciled after its run ended ({state})")
        reconciled.append(job.id)
    return reconciled


def delete_expired_files(store: JobStore, settings: Settings, now: datetime | None = None) -> list[str]:
    """Delete the files older than the retention (and their job's work folder); returns their ids."""
    cutoff = (now or datetime.now(UTC)) - timedelta(days=settings.retention_days)
    deleted = []
    while page := store.list_files(created_before=cutoff, limit=500)[0]:
        for file in page:
            _remove_file(store, file)
            deleted.append(file.id)
            if file.job_id:
                _drop_work_dir(settings, file.job_id)
    return deleted


def delete_job(store: JobStore, settings: Settings, job: Job) -> None:
    """Remove an ended job and what it made (output, error and inline-input files, work folder,
    cache entries), then its record. The owner's uploads stay: other jobs may read them."""
    made = [job.output_file_id, job.error_file_id, job.input.inline_file_id]
    for file_id in filter(None, made):
        if (file := store.get_file(file_id)) is not None:
            _remove_file(store, file)
    _drop_work_dir(settings, job.id)
    result_cache.forget_job(store, job.id)  # its answers leave the owner's cache with it
    store.delete_job(job.id)


def _remove_file(store: FileRepository, file: FileObject) -> None:
    """Delete a file object's content (already gone is fine) and mark its record deleted."""
    with suppress(storage.ObjectNotFound):
        storage.delete(file.uri)
    store.mark_file_deleted(file.id)


def _drop_work_dir(settings: Settings, job_id: str) -> None:
    with suppress(storage.ObjectNotFound):
        storage.delete_prefix(layout_of(settings, job_id).root.rstrip("/") + "/")


# Idempotency keys are kept at least this long (src/llm_batch/api/idempotency.py).
IDEMPOTENCY_KEEP = timedelta(hours=24)


def delete_old_idempotency_keys(store: IdempotencyRepository, now: datetime | None = None) -> int:
    """Delete the idempotency keys older than IDEMPOTENCY_KEEP; returns how many."""
    return store.delete_idempotency_keys(created_before=(now or datetime.now(UTC)) - IDEMPOTENCY_KEEP)


def delete_files_past_expiry(store: JobStore, now: datetime | None = None) -> list[str]:
    """Delete the files whose own expires_at has passed (content removed, record marked deleted);
    returns their ids."""
    now = now or datetime.now(UTC)
    deleted = []
    while page := store.list_expiring_files(expires_before=now, limit=500):
        for file in page:
            _remove_file(store, file)
            deleted.append(file.id)
    return deleted
