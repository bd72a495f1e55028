"""OpenAI Batch API: request and response models (the ``openai`` SDK's types are the contract)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from llm_batch.jobs import OPENAI_STATUS
from llm_batch.jobstore import Job
from llm_batch_plugin.models_files import epoch
from llm_batch_plugin.state import MAX_OPENAI_METADATA_PAIRS, check_pairs

COMPLETION_WINDOW_SECONDS = {"24h": 24 * 3600}


def check_metadata(value: dict[str, str] | None) -> dict[str, str] | None:
    """OpenAI's rule: up to 16 pairs, keys up to 64 characters, values up to 512."""
    return check_pairs(value, max_pairs=MAX_OPENAI_METADATA_PAIRS)


class CreateBatchRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    input_file_id: str = Field(min_length=1, max_length=128)
    endpoint: str = Field(max_length=128)
    completion_window: Literal["24h"] = "24h"
    metadata: dict[str, str] | None = None

    _metadata = field_validator("metadata")(check_metadata)


class BatchRequestCounts(BaseModel):
    total: int
    completed: int
    failed: int


class InputTokensDetails(BaseModel):
    cached_tokens: int | None = None  # None: the engine did not say


class OutputTokensDetails(BaseModel):
    # Hidden reasoning tokens: 0 unless the output lines count some (the engine returns
    # every token it generates as output).
    reasoning_tokens: int = 0


class BatchUsage(BaseModel):
    """The SDK's ``BatchUsage``: live from the shards' progress while the batch runs, the
    exact sum of the output lines' usage once it is merged."""

    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int

    @classmethod
    def of(cls, job: Job) -> BatchUsage | None:
        """None while nothing can be known yet (the batch has not started running)."""
        if job.in_progress_at is None and not job.terminal:
            return None
        return cls(
            input_tokens=job.prompt_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=job.cached_prompt_tokens),
            output_tokens=job.completion_tokens,
            output_tokens_details=OutputTokensDetails(reasoning_tokens=job.reasoning_tokens),
            total_tokens=job.prompt_tokens + job.completion_tokens,
        )


class BatchErrorData(BaseModel):
    code: str | None = None
    message: str | None = None
    param: str | None = None
    line: int | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchErrorData]


class BatchOut(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    model: str | None = None
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str = "24h"
    status: str
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: BatchRequestCounts
    usage: BatchUsage | None = None
    metadata: dict[str, Any] | None = None

    @classmethod
    def of(cls, job: Job) -> BatchOut:
        return cls(
            id=job.id,
            endpoint=job.endpoint,
            model=job.model or None,
            errors=_errors(job),
            input_file_id=(job.input.get("file_ids") or [""])[0],
            status=OPENAI_STATUS[job.status],
            output_file_id=job.output_file_id,
            error_file_id=job.error_file_id,
            created_at=epoch(job.created_at) or 0,
            in_progress_at=epoch(job.in_progress_at),
            expires_at=epoch(job.expires_at),
            finalizing_at=epoch(job.finalizing_at),
            # OpenAI sets completed_at only for a batch that completed.
            completed_at=epoch(job.completed_at) if OPENAI_STATUS[job.status] == "completed" else None,
            failed_at=epoch(job.failed_at),
            expired_at=epoch(job.expired_at),
            cancelling_at=epoch(job.cancelling_at),
            cancelled_at=epoch(job.cancelled_at),
            # OpenAI's "completed" counts succeeded requests; "failed" the others.
            request_counts=BatchRequestCounts(total=job.total, completed=job.succeeded, failed=job.failed),
            usage=BatchUsage.of(job),
            metadata=job.metadata or None,
        )


def _errors(job: Job) -> BatchErrors | None:
    data = [
        BatchErrorData(code=e.get("code"), message=e.get("message"), line=e.get("line"), param=e.get("param"))
        for e in job.errors
    ]
    if job.status_reason and job.status.value == "FAILED":
        data.insert(0, BatchErrorData(code="batch_failed", message=job.status_reason))
    return BatchErrors(data=data) if data else None


class BatchList(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchOut]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool
