"""Reading a job the caller may see, and cancelling one: the store's flag (a queued job ends at
once), the workers' cancel marker, its shard tasks that have not started skipped. Cancel is
idempotent; a job that ended otherwise is left as it ended (a 409 naming its status for
dialects whose answer is the job)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Annotated, NamedTuple

from airflow.api_fastapi.common.db.common import SessionDep
from fastapi import Depends

from llm_batch.api.auth import Caller, CallerDep
from llm_batch.api.errors import ApiError, not_found
from llm_batch.api.run_queue import skip_waiting_shards
from llm_batch.api.state import SettingsDep, StoreDep
from llm_batch.core.config import Settings
from llm_batch.core.jobs import JobStatus
from llm_batch.infra import storage
from llm_batch.infra.jobstore import Job, JobNotFound, JobRepository, JobStore
from llm_batch.infra.log_context import bind_job
from llm_batch.pipeline.shard_task import write_cancel_marker
from llm_batch.pipeline.steps import layout_of


def owned_job(store: JobRepository, job_id: str, owner: str | None, kind: str) -> Job:
    """The job of that id, if `owner`'s (None: anyone's); else 404 naming `kind`."""
    if (job := store.get_job(job_id, owner=owner)) is None:
        raise not_found(kind, job_id)
    bind_job(job.id)  # this request's log lines from here on carry it
    return job


class Cancelling(NamedTuple):
    """A cancel route's dependency: call it with the job id (the caller must be allowed to submit)."""

    caller: Caller
    store: JobStore
    settings: Settings
    release: Callable[[str | None], int]  # takes a run's waiting shards out of the queue

    def __call__(self, job_id: str, kind: str = "batch", refuse_ended: Mapping[JobStatus, str] | None = None) -> Job:
        """The job, its cancel requested; with `refuse_ended` (the dialect's status words), a job
        that ended other than cancelled is a 409."""
        self.caller.require_submit()
        try:
            job = self.store.request_cancel(job_id, owner=self.caller.owner_filter,
                                            reason="cancel requested through the API")
        except JobNotFound:
            raise not_found(kind, job_id) from None
        bind_job(job.id)
        if job.terminal and job.status != JobStatus.CANCELLED and refuse_ended is not None:
            raise ApiError(409, f"{kind} {job_id!r} has already ended with status {refuse_ended[job.status]!r}: "
                           "there is nothing to cancel", param="id", code="already_ended")
        if job.status == JobStatus.CANCELLING:
            try:
                write_cancel_marker(layout_of(self.settings, job.id).cancel_marker, job)
            except storage.StorageError as exc:
                # The store flag is set and the DAG checks it too; say what failed, loudly.
                raise ApiError(503, f"cancel recorded, but the cancel marker could not be written: {exc}") from exc
        if job.status in (JobStatus.CANCELLING, JobStatus.CANCELLED):
            self.release(job.dag_run_id)
        return job


def _cancelling(caller: CallerDep, store: StoreDep, settings: SettingsDep, session: SessionDep) -> Cancelling:
    return Cancelling(caller, store, settings, lambda run_id: skip_waiting_shards(run_id, session))


CancellingDep = Annotated[Cancelling, Depends(_cancelling)]
