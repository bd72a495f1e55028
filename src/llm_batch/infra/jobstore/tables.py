"""The job store's tables as SQLAlchemy Core ``Table`` objects: what the repositories'
statements (``select``, ``insert``, ``update``, ``delete``) run on."""

from __future__ import annotations

from sqlalchemy import Table

from llm_batch.infra.jobstore.models import (
    AdapterRow,
    ApiKeyRow,
    FileRow,
    IdempotencyKeyRow,
    JobRow,
    ProgressHistoryRow,
    ResultCacheRow,
    ShardProgressRow,
    WebhookAttemptRow,
    WebhookDeliveryRow,
    WebhookEndpointRow,
)

JOBS: Table = JobRow.__table__
SHARDS: Table = ShardProgressRow.__table__
HISTORY: Table = ProgressHistoryRow.__table__
FILES: Table = FileRow.__table__
API_KEYS: Table = ApiKeyRow.__table__
IDEMPOTENCY_KEYS: Table = IdempotencyKeyRow.__table__
ENDPOINTS: Table = WebhookEndpointRow.__table__
DELIVERIES: Table = WebhookDeliveryRow.__table__
ATTEMPTS: Table = WebhookAttemptRow.__table__
ADAPTERS: Table = AdapterRow.__table__
RESULT_CACHE: Table = ResultCacheRow.__table__
