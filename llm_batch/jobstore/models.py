"""The job store's tables (SQLAlchemy 2.0 declarative models).

These are the schema the migrations create; callers never see them (the store hands out
snapshots from ``llm_batch.jobstore.snapshots``). A change here needs a new migration script
in ``migrations/versions/``.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import JSON, BigInteger, Boolean, DateTime, Float, Index, Integer, String, Text
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator


class UTCDateTime(TypeDecorator[datetime]):
    """A timezone-aware UTC datetime on every backend.

    PostgreSQL stores ``timestamptz``; SQLite has no time zones, so the value is stored as
    naive UTC and made aware again on the way out. Naive datetimes are refused on the way
    in: a naive value would be silently misread as UTC.
    """

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
    # Lines that failed validation (part of completed and failed): the base the shards'
    # progress rows are added to.
    invalid: Mapped[int] = mapped_column(Integer, default=0)
    # Usage: live from the shards' progress rows, exact from the output lines after merge.
    # cached None = unknown (an output line did not say). reasoning: hidden reasoning tokens,
    # 0 unless the lines count some (our engine returns every generated token as output).
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    completion_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    cached_prompt_tokens: Mapped[int | None] = mapped_column(BigInteger)
    reasoning_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    # Seconds the shards' engine loops ran (all attempts), and the summed output rate.
    engine_seconds: Mapped[float] = mapped_column(Float, default=0.0)
    tokens_per_s: Mapped[float] = mapped_column(Float, default=0.0)
    # Summary of request errors: [{"code", "message", "count"}].
    errors: Mapped[list[Any]] = mapped_column(default=list)

    owner: Mapped[str] = mapped_column(String(256))
    dag_run_id: Mapped[str | None] = mapped_column(String(256))

    __table_args__ = (
        Index("ix_jobs_owner_created_at", "owner", "created_at"),
        Index("ix_jobs_owner_status", "owner", "status"),
        Index("ix_jobs_dialect_created_at", "dialect", "created_at"),
        Index("ix_jobs_created_at", "created_at"),
    )


class ShardProgressRow(Base):
    """One shard of a job: its last reported progress and, once its task ended, its
    outcome (``state`` done|cancelled|deadline|failed|usage and ``reason``). Written only by
    that shard's watcher; the job's live counts are the sum of its rows (JobStore.report_shard)."""

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
    """A point of a job's progress over time (its live counts and tokens/s), appended by
    JobStore.report_shard at most every ``history_interval_s`` per job and thinned to about
    ``MAX_HISTORY_POINTS``: what the UI's plots draw."""

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
