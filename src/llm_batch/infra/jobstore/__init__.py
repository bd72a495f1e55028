"""The job store: jobs, files, API keys, usage, webhooks and owners' adapters in our own SQL
database (SQLite or PostgreSQL, never Airflow's); docs/jobstore.md."""

from llm_batch.core.snapshots import ApiKey, FileObject, Job, OwnerAdapter, ShardRecord
from llm_batch.infra.jobstore.adapters import AdapterRepository
from llm_batch.infra.jobstore.api_keys import ApiKeyRepository
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
from llm_batch.infra.jobstore.estimates import EstimatesRepository
from llm_batch.infra.jobstore.files import FileRepository, new_file_id
from llm_batch.infra.jobstore.idempotency import IdempotencyRepository
from llm_batch.infra.jobstore.jobs import JobRepository
from llm_batch.infra.jobstore.progress import ProgressRepository
from llm_batch.infra.jobstore.repository import utcnow
from llm_batch.infra.jobstore.result_cache import ResultCacheRepository
from llm_batch.infra.jobstore.store import JobStore, get_job_store
from llm_batch.infra.jobstore.usage import UsageRepository
from llm_batch.infra.jobstore.webhooks import WebhookRepository

__all__ = [
    "AdapterExists",
    "AdapterNotFound",
    "AdapterRepository",
    "ApiKey",
    "ApiKeyNotFound",
    "ApiKeyRepository",
    "ConcurrentUpdate",
    "DuplicateId",
    "EstimatesRepository",
    "FileNotFound",
    "FileObject",
    "FileRepository",
    "IdempotencyRepository",
    "InvalidCursor",
    "Job",
    "JobNotFound",
    "JobRepository",
    "JobStore",
    "JobStoreError",
    "OwnerAdapter",
    "ProgressRepository",
    "ResultCacheRepository",
    "ShardRecord",
    "UsageRepository",
    "WebhookRepository",
    "get_job_store",
    "new_file_id",
    "upgrade_to_head",
    "utcnow",
]
