"""The job store's tables as SQLAlchemy Core ``Table`` objects: what the repositories'
statements run on."""

from __future__ import annotations

from sqlalchemy import Table

from llm_batch.infra.jobstore import models

JOBS: Table = models.JobRow.__table__
SHARDS: Table = models.ShardProgressRow.__table__
HISTORY: Table = models.ProgressHistoryRow.__table__
FILES: Table = models.FileRow.__table__
API_KEYS: Table = models.ApiKeyRow.__table__
IDEMPOTENCY_KEYS: Table = models.IdempotencyKeyRow.__table__
ENDPOINTS: Table = models.WebhookEndpointRow.__table__
DELIVERIES: Table = models.WebhookDeliveryRow.__table__
ATTEMPTS: Table = models.WebhookAttemptRow.__table__
ADAPTERS: Table = models.AdapterRow.__table__
RESULT_CACHE: Table = models.ResultCacheRow.__table__
