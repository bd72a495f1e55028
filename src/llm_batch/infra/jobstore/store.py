"""JobStore: the job store's composition root, every repository over one engine.

Each concern is a repository of its own module (none imports another), a ``Repository`` (``repository.py``: the
engine, transactions) with a small ``Protocol`` of what its callers use:

- ``jobs.py``: jobs, their status moves and counters (``Jobs``);
- ``progress.py``: shard progress and progress history (``Progress``);
- ``files.py``: file objects (``Files``);
- ``api_keys.py``: API keys and owner names (``ApiKeys``);
- ``idempotency.py``: idempotency keys (``IdempotencyKeys``);
- ``adapters.py``: owners' own LoRA adapters (``Adapters``);
- ``usage.py``: usage reports and per-owner holdings (``Usage``);
- ``figures.py``: the whole store's operational figures for metrics (``Figures``);
- ``estimates.py``: jobs' estimates, measured tokens/s, the live work ahead (``Estimates``);
- ``result_cache.py``: the result cache's index (``ResultCacheIndex``);
- ``health.py``: the health check (``Health``);
- ``webhooks.py``: webhook endpoints, the delivery outbox, attempts (``WebhookEndpoints``,
  ``WebhookOutbox``).

Every public method is one transaction and returns snapshots (``snapshots.Job`` etc.),
never live ORM objects. Getters return None for an unknown (or not-owned) id; mutators
raise ``JobNotFound`` / ``FileNotFound`` / ``ApiKeyNotFound`` / ``AdapterNotFound``. ``owner=None`` means "any
owner" (admins, the DAG); a given owner restricts the call to that owner's rows, so
someone else's id looks exactly like a missing one.

Statements are SQLAlchemy Core on the models' tables (``tables.py``): a snapshot's fields are
exactly its table's column names, so a result row becomes a snapshot directly, and every
update is a single ``UPDATE ... RETURNING``.
"""

from __future__ import annotations

from functools import lru_cache

from sqlalchemy import Connection, Row

from llm_batch.core.config import get_settings
from llm_batch.infra.jobstore.adapters import AdapterRepository
from llm_batch.infra.jobstore.api_keys import ApiKeyRepository
from llm_batch.infra.jobstore.estimates import EstimatesRepository
from llm_batch.infra.jobstore.figures import FiguresRepository
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
    FiguresRepository,
    HealthRepository,
    WebhookRepository,
    AdapterRepository,
    EstimatesRepository,
    ResultCacheRepository,
):
    """The job store at `url`: every repository's methods over one engine (see the module
    docstring; construction and threads as ``Repository``)."""

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
