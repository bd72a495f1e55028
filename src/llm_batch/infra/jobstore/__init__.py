"""The job store: jobs, file objects, API keys, usage, webhooks and owners' adapters in our own SQL database.

SQLite file by default (``Settings.database_url``), PostgreSQL by URL; never Airflow's
metadata database. See docs/jobstore.md for the API.
"""

from llm_batch.infra.jobstore.adapters import Adapters
from llm_batch.infra.jobstore.api_keys import ApiKeys
from llm_batch.infra.jobstore.database import make_engine, upgrade_to_head
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
from llm_batch.infra.jobstore.health import Health
from llm_batch.infra.jobstore.idempotency import IdempotencyKeys
from llm_batch.infra.jobstore.jobs import Jobs, new_job_id
from llm_batch.infra.jobstore.progress import Progress
from llm_batch.infra.jobstore.repository import utcnow
from llm_batch.infra.jobstore.snapshots import DIALECTS, FILE_KINDS, ApiKey, FileObject, Job, OwnerAdapter, ShardRecord
from llm_batch.infra.jobstore.store import JobStore, get_job_store
from llm_batch.infra.jobstore.usage import Usage
from llm_batch.infra.jobstore.webhooks import WebhookEndpoints, WebhookOutbox

__all__ = [
    "DIALECTS",
    "FILE_KINDS",
    "AdapterExists",
    "AdapterNotFound",
    "Adapters",
    "ApiKey",
    "ApiKeyNotFound",
    "ApiKeys",
    "ConcurrentUpdate",
    "DuplicateId",
    "FileNotFound",
    "FileObject",
    "Files",
    "Health",
    "IdempotencyKeys",
    "InvalidCursor",
    "Job",
    "JobNotFound",
    "JobStore",
    "JobStoreError",
    "Jobs",
    "OwnerAdapter",
    "Progress",
    "ShardRecord",
    "Usage",
    "WebhookEndpoints",
    "WebhookOutbox",
    "get_job_store",
    "make_engine",
    "new_file_id",
    "new_job_id",
    "upgrade_to_head",
    "utcnow",
]
