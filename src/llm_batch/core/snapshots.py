"""What the job store hands to callers: frozen snapshots, never live ORM objects (safe to keep
after the transaction and to pass between threads); a snapshot's fields are its table's columns.
They live in the core so the API's dialects can answer from them without the store."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from llm_batch.core.job_request import DIALECTS, DerivedFrom
from llm_batch.core.job_spec import JobInput
from llm_batch.core.jobs import JobStatus

__all__ = ["DIALECTS", "FILE_KINDS", "ApiKey", "FileObject", "Job", "OwnerAdapter", "ShardRecord"]

FILE_KINDS = ("input", "output", "error")


@dataclass(frozen=True, slots=True)
class Job:
    id: str
    dialect: str
    endpoint: str
    model: str
    owner: str
    status: JobStatus
    created_at: datetime
    updated_at: datetime
    model_config: dict[str, Any] = field(default_factory=dict)
    input: JobInput = field(default_factory=JobInput)  # the row's JSON, read as a JobInput
    input_format: str | None = None
    output_uri: str | None = None
    array_output_uri: str | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    labels: dict[str, Any] = field(default_factory=dict)
    priority: int = 0
    data_parallelism: int = 1
    resources: dict[str, Any] = field(default_factory=dict)
    max_runtime_sec: int | None = None
    status_reason: str | None = None
    started_at: datetime | None = None
    in_progress_at: datetime | None = None
    finalizing_at: datetime | None = None
    completed_at: datetime | None = None
    failed_at: datetime | None = None
    cancelling_at: datetime | None = None
    cancelled_at: datetime | None = None
    expired_at: datetime | None = None
    expires_at: datetime | None = None
    cancel_requested_at: datetime | None = None
    total: int = 0
    completed: int = 0
    succeeded: int = 0
    failed: int = 0
    invalid: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int | None = None
    reasoning_tokens: int = 0
    engine_seconds: float = 0.0
    tokens_per_s: float = 0.0
    errors: list[dict[str, Any]] = field(default_factory=list)
    dag_run_id: str | None = None
    derived_from_id: str | None = None  # the job this one was made from (retry, rerun)
    derived_kind: str | None = None  # how: one of llm_batch.core.job_request.DERIVED_KINDS
    # Usage per model that answered (the base, its LoRA adapters), from the merge.
    model_usage: dict[str, dict[str, int]] | None = None
    # What the job was expected to take (llm_batch.pipeline.estimate), set at validation.
    estimate: dict[str, Any] | None = None
    # Lines answered from the result cache (part of succeeded) and their tokens.
    result_cache_hits: int = 0
    result_cache_tokens: int = 0
    # Checked outputs: lines recorded invalid_output (part of failed), answers tried again, their tokens.
    invalid_output: int = 0
    output_retries: int = 0
    retry_tokens: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.input, JobInput):  # a row's stored JSON (a dict)
            object.__setattr__(self, "input", JobInput.from_stored(self.input))

    @property
    def terminal(self) -> bool:
        return self.status.terminal

    @property
    def cancel_requested(self) -> bool:
        return self.cancel_requested_at is not None

    @property
    def derived_from(self) -> DerivedFrom | None:
        """The job this one was made from, and how; None for an ordinary job."""
        if self.derived_from_id is None or self.derived_kind is None:
            return None
        return DerivedFrom(self.derived_from_id, self.derived_kind)


@dataclass(frozen=True, slots=True)
class ShardRecord:
    """A shard's row: its last reported progress, and its task's outcome once it ended
    (``reason`` is None while it runs)."""

    job_id: str
    shard: int
    state: str
    updated_at: datetime
    total: int = 0
    done: int = 0
    succeeded: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    engine_seconds: float = 0.0
    reason: str | None = None


@dataclass(frozen=True, slots=True)
class FileObject:
    id: str
    owner: str
    purpose: str
    filename: str
    bytes: int
    uri: str
    kind: str
    created_at: datetime
    job_id: str | None = None
    expires_at: datetime | None = None
    deleted_at: datetime | None = None

    @property
    def deleted(self) -> bool:
        return self.deleted_at is not None


@dataclass(frozen=True, slots=True)
class ApiKey:
    """An API key's record; the secret itself is never stored (only its sha256)."""

    id: str
    owner: str
    name: str
    prefix: str
    is_admin: bool
    created_at: datetime
    revoked_at: datetime | None = None

    @property
    def revoked(self) -> bool:
        return self.revoked_at is not None


@dataclass(frozen=True, slots=True)
class OwnerAdapter:
    """A LoRA adapter its owner uploaded (seen by that owner only): ``base`` is the registered
    model it adapts, ``uri`` the storage prefix (ending in ``/``) holding its two files."""

    name: str
    base: str
    uri: str
    rank: int
    bytes: int
    created_at: datetime
    owner: str
    id: str


@dataclass(frozen=True, slots=True)
class CacheEntry:
    """One answer in an owner's result cache: ``bytes`` bytes at ``at_byte`` of the pack at
    ``uri`` (None: the object at ``uri`` holds it alone)."""

    owner: str
    key: str
    job_id: str
    uri: str
    bytes: int
    prompt_tokens: int
    completion_tokens: int
    created_at: datetime
    used_at: datetime
    at_byte: int | None = None


@dataclass(frozen=True, slots=True)
class CachedAnswer:
    """Where a lookup finds one cached answer (a ``CacheEntry``'s ``key``, ``uri``, ``bytes`` and
    ``at_byte``): all that reading it takes, so a big job's lookup converts no other column."""

    key: str
    uri: str
    bytes: int
    at_byte: int | None = None


@dataclass(frozen=True, slots=True)
class UsageRow:
    """JobStore.usage: the sums over one group's jobs (any status; live jobs with their live counts)."""

    group: str
    jobs: int = 0
    requests_total: int = 0
    requests_succeeded: int = 0
    requests_failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0  # jobs whose count is unknown (None) add 0
    reasoning_tokens: int = 0
    cached_requests: int = 0  # answered from the result cache (part of requests_succeeded)
    cached_tokens: int = 0  # their prompt + completion tokens (part of the token counts)
    invalid_output: int = 0  # answers that failed the job's output check (part of requests_failed)
    output_retries: int = 0  # answers tried again because they failed it
    retry_tokens: int = 0  # prompt + completion tokens of the discarded answers (not in the token counts)
    engine_seconds: float = 0.0
    gpu_seconds: float = 0.0

