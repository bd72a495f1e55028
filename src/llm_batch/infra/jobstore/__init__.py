"""The job store: jobs, files, API keys, usage, webhooks and owners' adapters in our own SQL
database (SQLite or PostgreSQL, never Airflow's); docs/jobstore.md. ``JobStore`` composes every
repository over one engine; each concern is a ``Repository`` of its own module, none importing another."""

from functools import lru_cache

from sqlalchemy import Connection, Row

from llm_batch.core.config import get_settings
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
from llm_batch.infra.jobstore.health import HealthRepository
from llm_batch.infra.jobstore.idempotency import IdempotencyRepository
from llm_batch.infra.jobstore.jobs import JobRepository
from llm_batch.infra.jobstore.progress import ProgressRepository
from llm_batch.infra.jobstore.repository import utcnow
from llm_batch.infra.jobstore.result_cache import ResultCacheRepository
from llm_batch.infra.jobstore.usage import UsageRepository
from llm_batch.infra.jobstore.webhooks import WebhookRepository, enqueue_job_end

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


class JobStore(
    JobRepository,
    ProgressRepository,
    FileRepository,
    ApiKeyRepository,
    IdempotencyRepository,
    UsageRepository,
    HealthRepository,
    WebhookRepository,
    AdapterRepository,
    EstimatesRepository,
    ResultCacheRepository,
):
    def _job_moved(self, connection: Connection, before: Row, after: Row) -> None:
        enqueue_job_end(connection, before, after)  # a job's end writes its webhook outbox rows


@lru_cache(maxsize=None)
def _store_for(url: str) -> JobStore:
    return JobStore(url)


def get_job_store(url: str | None = None) -> JobStore:
    """The process-wide store for `url` (default: Settings.database_url)."""
    if url is None:
        url = get_settings().database_url
    return _store_for(url)
