"""The cancel use case: flag the job in the store and drop the job's cancel marker.

Workers watch the marker file (``JobLayout.cancel_marker``) between checkpoints; the DAG
and housekeeping read the store flag. Cancelling an ended job changes nothing and answers
the job as it is (a cancelled job stays readable, never a 404).
"""

from __future__ import annotations

from llm_batch import storage
from llm_batch.config import Settings
from llm_batch.jobstore import Job, JobNotFound, JobStore
from llm_batch.layout import JobLayout
from llm_batch_plugin.errors import ApiError, not_found


def cancel_job(store: JobStore, settings: Settings, job_id: str, owner: str | None, kind: str = "batch") -> Job:
    try:
        job = store.request_cancel(job_id, owner=owner, reason="cancel requested through the API")
    except JobNotFound:
        raise not_found(kind, job_id) from None
    if not job.terminal:
        try:
            storage.write_bytes(JobLayout(settings.work_uri, job.id).cancel_marker, b"")
        except storage.StorageError as exc:
            # The store flag is set and the DAG checks it too; say what failed, loudly.
            raise ApiError(503, f"cancel recorded, but the cancel marker could not be written: {exc}") from exc
    return job
