"""Mistral batch jobs: request and response models (``mistralai``'s ``BatchJob`` is the contract)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from llm_batch.jobs import MISTRAL_STATUS
from llm_batch.jobstore import Job
from llm_batch_plugin.models_files import epoch
from llm_batch_plugin.state import MAX_INLINE_REQUESTS, check_pairs


class InlineRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    custom_id: str | None = Field(default=None, max_length=512)
    body: dict[str, Any]


class CreateBatchJobRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    input_files: list[str] | None = Field(default=None, max_length=100)
    requests: list[InlineRequest] | None = Field(default=None, max_length=MAX_INLINE_REQUESTS)
    endpoint: str = Field(max_length=128)
    model: str | None = Field(default=None, max_length=256)
    agent_id: str | None = None
    metadata: dict[str, str] | None = None
    timeout_hours: int = Field(default=24, ge=1, le=168)

    _metadata = field_validator("metadata")(check_pairs)


class BatchErrorOut(BaseModel):
    message: str
    count: int = 1


class BatchJobOut(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    input_files: list[str]
    metadata: dict[str, Any] | None = None
    endpoint: str
    model: str | None = None
    agent_id: str | None = None
    output_file: str | None = None
    error_file: str | None = None
    errors: list[BatchErrorOut]
    outputs: list[dict[str, Any]] | None = None
    status: str
    created_at: int
    total_requests: int
    completed_requests: int
    succeeded_requests: int
    failed_requests: int
    started_at: int | None = None
    completed_at: int | None = None

    @classmethod
    def of(cls, job: Job, outputs: list[dict[str, Any]] | None = None) -> BatchJobOut:
        errors = [BatchErrorOut(message=str(e.get("message")), count=int(e.get("count") or 1)) for e in job.errors]
        if job.status_reason and job.status.value in ("FAILED", "TIMEOUT_EXCEEDED"):
            errors.insert(0, BatchErrorOut(message=job.status_reason, count=1))
        return cls(
            id=job.id,
            input_files=list(job.input.get("file_ids") or []),
            metadata=job.metadata or None,
            endpoint=job.endpoint,
            model=job.model or None,
            output_file=job.output_file_id,
            error_file=job.error_file_id,
            errors=errors,
            outputs=outputs,
            status=MISTRAL_STATUS[job.status],
            created_at=epoch(job.created_at) or 0,
            total_requests=job.total,
            completed_requests=job.completed,
            succeeded_requests=job.succeeded,
            failed_requests=job.failed,
            started_at=epoch(job.started_at),
            completed_at=epoch(job.completed_at),
        )


class BatchJobList(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchJobOut]
    total: int


class DeleteBatchJobResponse(BaseModel):
    """The SDK's ``DeleteBatchJobResponse``."""

    id: str
    object: Literal["batch"] = "batch"
    deleted: bool = True
