"""The job store: jobs, files, API keys, usage, webhooks and owners' adapters in our own SQL
database (SQLite or PostgreSQL, never Airflow's); docs/jobstore.md."""

from llm_batch.core.snapshots import ApiKey, FileObject, Job, OwnerAdapter, ShardRecord
from llm_batch.infra.jobstore.adapters import Adapters
from llm_batch.infra.jobstore.database import upgrade_to_head
from llm_batch.infra.jobstore.errors import (
    AdapterExists,
    AdapterNotFound,
    ApiKeyNotFound,
    ConcurrentUpdate,
    DuplicateId,
    FileNotFound,
    InvalidCursor,
    JobNotFound,
    JobStoreError,
)
from llm_batch.infra.jobstore.files import Files, new_file_id
from llm_batch.infra.jobstore.jobs import Jobs
from llm_batch.infra.jobstore.repository import utcnow
from llm_batch.infra.jobstore.store import JobStore, get_job_store
from llm_batch.infra.jobstore.webhooks import WebhookOutbox

__all__ = [
    "AdapterExists",
    "AdapterNotFound",
    "Adapters",
    "ApiKey",
    "ApiKeyNotFound",
    "ConcurrentUpdate",
    "DuplicateId",
    "FileNotFound",
    "FileObject",
    "Files",
    "InvalidCursor",
    "Job",
    "JobNotFound",
    "JobStore",
    "JobStoreError",
    "Jobs",
    "OwnerAdapter",
    "ShardRecord",
    "WebhookOutbox",
    "get_job_store",
    "new_file_id",
    "upgrade_to_head",
    "utcnow",
]
