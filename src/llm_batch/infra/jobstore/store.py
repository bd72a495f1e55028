"""JobStore: every repository of the job store over one engine (docs/jobstore.md: its API
and rules). Each concern is a ``Repository`` of its own module, none importing another."""

from __future__ import annotations

from functools import lru_cache

from sqlalchemy import Connection, Row

from llm_batch.core.config import get_settings
from llm_batch.infra.jobstore.adapters import AdapterRepository
from llm_batch.infra.jobstore.api_keys import ApiKeyRepository
from llm_batch.infra.jobstore.estimates import EstimatesRepository
from llm_batch.infra.jobstore.files import FileRepository
from llm_batch.infra.jobstore.health import HealthRepository
from llm_batch.infra.jobstore.idempotency import IdempotencyRepository
from llm_batch.infra.jobstore.jobs import JobRepository
from llm_batch.infra.jobstore.progress import ProgressRepository
from llm_batch.infra.jobstore.result_cache import ResultCacheRepository
from llm_batch.infra.jobstore.usage import UsageRepository
from llm_batch.infra.jobstore.webhooks import WebhookRepository, enqueue_job_end


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
    """The job store at `url` (construction and threads as ``Repository``)."""

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
