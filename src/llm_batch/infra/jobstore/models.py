"""The job store's tables, as the migrations create them (a change needs a new migration)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import JSON, BigInteger, Boolean, DateTime, Float, Index, Integer, String, Table, Text, UniqueConstraint
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator


class UTCDateTime(TypeDecorator[datetime]):
    """A timezone-aware UTC datetime on every backend (naive UTC in SQLite); naive values are
    refused, since they would be misread as UTC."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r}: the job store takes timezone-aware values")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class Base(DeclarativeBase):
    type_annotation_map = {datetime: UTCDateTime(), dict[str, Any]: JSON(), list[Any]: JSON()}


class JobRow(Base):
    """One batch job, in the canonical (dialect-neutral) job model (docs/jobstore.md)."""

    __tablename__ = "jobs"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    dialect: Mapped[str] = mapped_column(String(16))
    endpoint: Mapped[str] = mapped_column(String(64))
    model: Mapped[str] = mapped_column(String(256), index=True)
    model_config: Mapped[dict[str, Any]] = mapped_column(default=dict)
    # File ids, a URI, or a reference to inline requests: what the DAG reads.
    input: Mapped[dict[str, Any]] = mapped_column(default=dict)
    input_format: Mapped[str | None] = mapped_column(String(32))
    output_uri: Mapped[str | None] = mapped_column(Text)
    # Scale's output_data_path: where the JSON array of results is written for the user.
    array_output_uri: Mapped[str | None] = mapped_column(Text)
    output_file_id: Mapped[str | None] = mapped_column(String(64))
    error_file_id: Mapped[str | None] = mapped_column(String(64))
    # "metadata" is reserved on declarative classes, hence the attribute name.
    metadata_: Mapped[dict[str, Any]] = mapped_column("metadata", default=dict)
    labels: Mapped[dict[str, Any]] = mapped_column(default=dict)
    priority: Mapped[int] = mapped_column(Integer, default=0)
    data_parallelism: Mapped[int] = mapped_column(Integer, default=1)
    resources: Mapped[dict[str, Any]] = mapped_column(default=dict)
    max_runtime_sec: Mapped[int | None] = mapped_column(Integer)

    status: Mapped[str] = mapped_column(String(32))
    status_reason: Mapped[str | None] = mapped_column(Text)

    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]
    started_at: Mapped[datetime | None]
    in_progress_at: Mapped[datetime | None]
    finalizing_at: Mapped[datetime | None]
    completed_at: Mapped[datetime | None]
    failed_at: Mapped[datetime | None]
    cancelling_at: Mapped[datetime | None]
    cancelled_at: Mapped[datetime | None]
    expired_at: Mapped[datetime | None]
    expires_at: Mapped[datetime | None]
    cancel_requested_at: Mapped[datetime | None]

    total: Mapped[int] = mapped_column(Integer, default=0)
    completed: Mapped[int] = mapped_column(Integer, default=0)
    succeeded: Mapped[int] = mapped_column(Integer, default=0)
    failed: Mapped[int] = mapped_column(Integer, default=0)
    # Lines that failed validation (part of completed and failed).
    invalid: Mapped[int] = mapped_column(Integer, default=0)
    # Usage: live from the shards' progress, exact after merge; cached None: unknown.
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    completion_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    cached_prompt_tokens: Mapped[int | None] = mapped_column(BigInteger)
    reasoning_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    # Seconds the shards' engine loops ran (all attempts), and the summed output rate.
    engine_seconds: Mapped[float] = mapped_column(Float, default=0.0)
    tokens_per_s: Mapped[float] = mapped_column(Float, default=0.0)
    # Summary of request errors: [{"code", "message", "count"}].
    errors: Mapped[list[Any]] = mapped_column(default=list)
    # {model: {"succeeded", "prompt_tokens", "completion_tokens"}} from the merge.
    model_usage: Mapped[dict[str, Any] | None] = mapped_column(JSON(), nullable=True)
    estimate: Mapped[dict[str, Any] | None] = mapped_column(JSON(), nullable=True)
    # Lines answered from the result cache (part of succeeded) and their tokens.
    result_cache_hits: Mapped[int] = mapped_column(Integer, default=0)
    result_cache_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    # Checked outputs: lines failed (part of failed), answers retried, their tokens.
    invalid_output: Mapped[int] = mapped_column(Integer, default=0)
    output_retries: Mapped[int] = mapped_column(Integer, default=0)
    retry_tokens: Mapped[int] = mapped_column(BigInteger, default=0)

    owner: Mapped[str] = mapped_column(String(256))
    dag_run_id: Mapped[str | None] = mapped_column(String(256))
    # A job made from another (llm_batch.core.job_request.DerivedFrom): its id and how.
    derived_from_id: Mapped[str | None] = mapped_column(String(64), index=True)
    derived_kind: Mapped[str | None] = mapped_column(String(16))

    __table_args__ = (
        Index("ix_jobs_owner_created_at", "owner", "created_at"),
        Index("ix_jobs_owner_status", "owner", "status"),
        Index("ix_jobs_dialect_created_at", "dialect", "created_at"),
        Index("ix_jobs_created_at", "created_at"),
    )


class ShardProgressRow(Base):
    """One shard of a job: its last progress and, once ended, its outcome (written by its watcher only)."""

    __tablename__ = "shard_progress"

    job_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    shard: Mapped[int] = mapped_column(Integer, primary_key=True)
    total: Mapped[int] = mapped_column(Integer, default=0)
    done: Mapped[int] = mapped_column(Integer, default=0)
    succeeded: Mapped[int] = mapped_column(Integer, default=0)
    failed: Mapped[int] = mapped_column(Integer, default=0)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    completion_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    cached_prompt_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    engine_seconds: Mapped[float] = mapped_column(Float, default=0.0)
    state: Mapped[str] = mapped_column(String(16))
    # Why the shard's task ended as it did (its final outcome's message); None while it runs.
    reason: Mapped[str | None] = mapped_column(Text)
    updated_at: Mapped[datetime]


class ProgressHistoryRow(Base):
    """A point of a job's progress over time: what the UI's plots draw."""

    __tablename__ = "progress_history"

    job_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    at: Mapped[datetime] = mapped_column(primary_key=True)
    total: Mapped[int] = mapped_column(Integer, default=0)
    completed: Mapped[int] = mapped_column(Integer, default=0)
    succeeded: Mapped[int] = mapped_column(Integer, default=0)
    failed: Mapped[int] = mapped_column(Integer, default=0)
    completion_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    tokens_per_s: Mapped[float] = mapped_column(Float, default=0.0)


class FileRow(Base):
    """A file object: an uploaded input, or a job's output / error file."""

    __tablename__ = "files"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    owner: Mapped[str] = mapped_column(String(256))
    purpose: Mapped[str] = mapped_column(String(32))
    filename: Mapped[str] = mapped_column(String(512))
    bytes: Mapped[int] = mapped_column(BigInteger)
    uri: Mapped[str] = mapped_column(Text)
    kind: Mapped[str] = mapped_column(String(16))
    job_id: Mapped[str | None] = mapped_column(String(64), index=True)
    created_at: Mapped[datetime]
    expires_at: Mapped[datetime | None]
    deleted_at: Mapped[datetime | None]

    __table_args__ = (Index("ix_files_owner_created_at", "owner", "created_at"),)


class ApiKeyRow(Base):
    """An API key: only its sha256 is stored; ``prefix`` finds the row without the secret."""

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    owner: Mapped[str] = mapped_column(String(256), index=True)
    name: Mapped[str] = mapped_column(String(256))
    prefix: Mapped[str] = mapped_column(String(32), index=True)
    sha256: Mapped[str] = mapped_column(String(64))
    is_admin: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime]
    revoked_at: Mapped[datetime | None]


class IdempotencyKeyRow(Base):
    """An owner's ``Idempotency-Key``: reserved by the first request (``status_code`` null),
    then holding its response, replayed to retries with the same route and body."""

    __tablename__ = "idempotency_keys"

    owner: Mapped[str] = mapped_column(String(256), primary_key=True)
    key: Mapped[str] = mapped_column(String(255), primary_key=True)
    route: Mapped[str] = mapped_column(String(256))  # "POST /v1/batches"
    fingerprint: Mapped[str] = mapped_column(String(64))  # sha256 hex of the request body
    created_at: Mapped[datetime] = mapped_column(index=True)
    # When the current reservation was taken (a pending one older than the lease is free).
    locked_at: Mapped[datetime]
    status_code: Mapped[int | None] = mapped_column(Integer)
    content_type: Mapped[str | None] = mapped_column(String(128))
    response_body: Mapped[str | None] = mapped_column(Text)
    completed_at: Mapped[datetime | None]


class WebhookEndpointRow(Base):
    """A receiver of one owner's job-end events (a rotated-out secret signs too until it expires)."""

    __tablename__ = "webhook_endpoints"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    owner: Mapped[str] = mapped_column(String(256), index=True)
    url: Mapped[str] = mapped_column(Text)
    events: Mapped[list[Any]] = mapped_column(default=list)
    description: Mapped[str] = mapped_column(String(512), default="")
    secret: Mapped[str] = mapped_column(String(128))
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]
    previous_secret: Mapped[str | None] = mapped_column(String(128))
    previous_secret_expires_at: Mapped[datetime | None]


class WebhookDeliveryRow(Base):
    """The outbox: one event for one endpoint, written in the transaction that ends the job."""

    __tablename__ = "webhook_deliveries"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    endpoint_id: Mapped[str] = mapped_column(String(64))
    owner: Mapped[str] = mapped_column(String(256))
    event_id: Mapped[str] = mapped_column(String(64))
    event_type: Mapped[str] = mapped_column(String(64))
    # None for a test event; a job ends once, so (endpoint, job) is unique.
    job_id: Mapped[str | None] = mapped_column(String(64))
    payload: Mapped[dict[str, Any]] = mapped_column(default=dict)
    status: Mapped[str] = mapped_column(String(16))
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    next_attempt_at: Mapped[datetime]
    give_up_at: Mapped[datetime]
    lease_owner: Mapped[str | None] = mapped_column(String(128))
    lease_expires_at: Mapped[datetime | None]
    created_at: Mapped[datetime]
    delivered_at: Mapped[datetime | None]
    last_error: Mapped[str | None] = mapped_column(Text)

    __table_args__ = (
        UniqueConstraint("endpoint_id", "job_id", name="uq_webhook_deliveries_endpoint_job"),
        Index("ix_webhook_deliveries_status_next_attempt_at", "status", "next_attempt_at"),
        Index("ix_webhook_deliveries_endpoint_created_at", "endpoint_id", "created_at"),
    )


class WebhookAttemptRow(Base):
    """One HTTP attempt of a delivery (status_code None: no answer)."""

    __tablename__ = "webhook_attempts"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    delivery_id: Mapped[str] = mapped_column(String(64), index=True)
    endpoint_id: Mapped[str] = mapped_column(String(64))
    attempt: Mapped[int] = mapped_column(Integer)
    started_at: Mapped[datetime]
    status_code: Mapped[int | None] = mapped_column(Integer)
    latency_ms: Mapped[float] = mapped_column(Float, default=0.0)
    error: Mapped[str | None] = mapped_column(Text)
    deliverer: Mapped[str] = mapped_column(String(128))

    __table_args__ = (Index("ix_webhook_attempts_endpoint_started_at", "endpoint_id", "started_at"),)


class AdapterRow(Base):
    """A LoRA adapter an owner uploaded (its files under the ``uri`` prefix)."""

    __tablename__ = "adapters"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    owner: Mapped[str] = mapped_column(String(256))
    name: Mapped[str] = mapped_column(String(64))
    base: Mapped[str] = mapped_column(String(256))  # the registered generate model it adapts
    uri: Mapped[str] = mapped_column(Text)
    rank: Mapped[int] = mapped_column(Integer)
    bytes: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime]

    __table_args__ = (UniqueConstraint("owner", "name", name="uq_adapters_owner_name"),)


class ResultCacheRow(Base):
    """One cached answer: ``bytes`` bytes at ``at_byte`` of the pack at ``uri``, computed by ``job_id``."""

    __tablename__ = "result_cache"

    owner: Mapped[str] = mapped_column(String(256), primary_key=True)
    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    job_id: Mapped[str] = mapped_column(String(128), index=True)
    uri: Mapped[str] = mapped_column(Text, index=True)
    bytes: Mapped[int] = mapped_column(BigInteger)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    completion_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    created_at: Mapped[datetime] = mapped_column(index=True)
    used_at: Mapped[datetime] = mapped_column(index=True)
    # Where in its pack (``uri``) the answer starts; None: the object holds it alone.
    at_byte: Mapped[int | None] = mapped_column(BigInteger, nullable=True)


# The tables as SQLAlchemy Core objects: what the repositories' statements run on.
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
