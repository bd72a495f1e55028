"""Mistral batch jobs: request and response models (``mistralai``'s ``BatchJob`` is the contract)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from llm_batch.api.file_models import UNIX, epoch
from llm_batch.api.native.models import InlineRequest
from llm_batch.core.endpoints import SUPPORTED_LISTED
from llm_batch.core.job_spec import MAX_INLINE_REQUESTS, JobSpec, check_pairs
from llm_batch.core.jobs import JobStatus
from llm_batch.core.snapshots import Job

# The dialect's word for each canonical status.
MISTRAL_STATUS = {
    JobStatus.QUEUED: "QUEUED",
    JobStatus.VALIDATING: "RUNNING",
    JobStatus.RUNNING: "RUNNING",
    JobStatus.FINALIZING: "RUNNING",
    JobStatus.CANCELLING: "CANCELLATION_REQUESTED",
    JobStatus.SUCCEEDED: "SUCCESS",
    JobStatus.FAILED: "FAILED",
    JobStatus.TIMEOUT_EXCEEDED: "TIMEOUT_EXCEEDED",
    JobStatus.CANCELLED: "CANCELLED",
}


class CreateBatchJobRequest(BaseModel):
    """Create a batch job (``batch.jobs.create``) from uploaded files or inline requests:
    exactly one of ``input_files`` and ``requests``. Unknown fields are ignored."""

    model_config = ConfigDict(extra="ignore")

    input_files: list[str] | None = Field(
        default=None,
        max_length=100,
        description="Ids of your uploaded input files (POST /v1/files), read in order as one batch; each at most "
        "once, and not a job's output or error file (400)",
    )
    requests: list[InlineRequest] | None = Field(
        default=None,
        max_length=MAX_INLINE_REQUESTS,
        description="Inline requests (up to 100,000), instead of input_files; their results come back inline "
        "in `outputs` once the job is done",
    )
    endpoint: str = Field(
        max_length=128,
        description=f"The API every request calls: {SUPPORTED_LISTED}; another (Mistral's conversations, ...) is 400",
    )
    model: str | None = Field(
        default=None,
        max_length=256,
        description="The model to run, a name from the model registry; required here (400 without it), as "
        "agents are not supported. It must serve the endpoint (400 otherwise)",
    )
    agent_id: str | None = Field(
        default=None,
        description="Not supported: this system runs models, not agents; any value is 400 (give `model`)",
    )
    metadata: dict[str, str] | None = Field(
        default=None,
        description="Your key-value pairs, stored with the job and answered as given (list filter `metadata`): at "
        "most 64 pairs, keys up to 64 characters, values up to 512 (422 beyond)",
    )
    timeout_hours: int = Field(
        default=24,
        ge=1,
        le=168,
        description="The job's deadline, in hours after creation (1-168): workers stop there, finished results "
        "are kept and the status is TIMEOUT_EXCEEDED",
    )

    _metadata = field_validator("metadata")(check_pairs)

    def spec(self) -> JobSpec:
        """The job's spec in the canonical words."""
        return JobSpec(model=self.model or "", endpoint=self.endpoint, metadata=self.metadata or {},
                       max_runtime_sec=self.timeout_hours * 3600)


class BatchErrorOut(BaseModel):
    """One entry of a job's error summary (each request's own error is a line of the error file)."""

    message: str = Field(
        description="What went wrong: the reason of a failed or timed-out job, or a kind of request error "
        "(input lines failed validation, requests never run, requests failed in the engine)"
    )
    count: int = Field(default=1, description="How many requests it stands for; 1 for the job's own reason")


class BatchJobOut(BaseModel):
    """A batch job (the SDK's ``BatchJob``); every job is readable here by id."""

    id: str = Field(description="The job id (`job_<hex>` when made through the API): the job's id in every dialect")
    object: Literal["batch"] = Field(default="batch", description="Always `batch`")
    input_files: list[str] = Field(
        description="Ids of the uploaded input files, in order; empty for a job whose input is not uploaded "
        "files (inline requests, a path)"
    )
    metadata: dict[str, Any] | None = Field(default=None, description="The metadata given at creation; null when none")
    endpoint: str = Field(
        description="The API every request calls: `/v1/chat/completions`, `/v1/completions`, `/v1/embeddings` "
        "or `/v1/responses`"
    )
    model: str | None = Field(default=None, description="The model every request runs on; null when the job names none")
    agent_id: str | None = Field(default=None, description="Always null: agents are not supported")
    output_file: str | None = Field(
        default=None,
        description="Id of the JSONL file of the succeeded requests' results (GET /v1/files/{id}/content), in "
        "input order; set once the results are merged, also for a cancelled or timed-out job (its partial results)",
    )
    error_file: str | None = Field(
        default=None,
        description="Id of the JSONL file of the failed requests, one line each with its 1-based input `line`; set "
        "once the results are merged (even when empty), or when the job's input was rejected",
    )
    errors: list[BatchErrorOut] = Field(
        description="The job's error summary; the reason of a FAILED or TIMEOUT_EXCEEDED job first; empty when none"
    )
    outputs: list[dict[str, Any]] | None = Field(
        default=None,
        description="Jobs of inline requests, on GET /v1/batch/jobs/{id} only: the lines of the output file "
        "(the succeeded requests' results, up to 100,000) once it exists; null otherwise",
    )
    status: str = Field(
        description="QUEUED, RUNNING (reading its input, running or merging), SUCCESS, FAILED, TIMEOUT_EXCEEDED, "
        "CANCELLATION_REQUESTED or CANCELLED"
    )
    created_at: int = Field(description=f"When the job was created, {UNIX}")
    total_requests: int = Field(description="Requests in the job; 0 until its input has been read")
    completed_requests: int = Field(
        description="Requests with an outcome (succeeded + failed, Mistral's meaning), live while the job runs"
    )
    succeeded_requests: int = Field(description="Requests that succeeded, live while the job runs")
    failed_requests: int = Field(
        description="Requests that failed: invalid input lines, engine errors, and requests never run "
        "(cancelled, timed out or a failed shard)"
    )
    started_at: int | None = Field(
        default=None, description=f"When the job began reading its input, {UNIX}; null while queued"
    )
    completed_at: int | None = Field(
        default=None, description=f"When the job ended (any end status), {UNIX}; null while it has not ended"
    )

    @classmethod
    def of(cls, job: Job, outputs: list[dict[str, Any]] | None = None) -> BatchJobOut:
        errors = [BatchErrorOut(message=str(e.get("message")), count=int(e.get("count") or 1)) for e in job.errors]
        if job.status_reason and job.status.value in ("FAILED", "TIMEOUT_EXCEEDED"):
            errors.insert(0, BatchErrorOut(message=job.status_reason, count=1))
        return cls(
            id=job.id,
            input_files=list(job.input.file_ids or []),
            metadata=job.metadata or None,
            endpoint=job.endpoint,
            model=job.model or None,
            output_file=job.output_file_id,
            error_file=job.error_file_id,
            errors=errors,
            outputs=outputs,
            status=MISTRAL_STATUS[job.status],
            created_at=epoch(job.created_at) or 0,
            **{f"{name}_requests": getattr(job, name) for name in ("total", "completed", "succeeded", "failed")},
            started_at=epoch(job.started_at),
            completed_at=epoch(job.completed_at),
        )


class BatchJobList(BaseModel):
    """A page of your batch jobs (the SDK's ``ListBatchJobsResponse``)."""

    object: Literal["list"] = Field(default="list", description="Always `list`")
    data: list[BatchJobOut] = Field(description="The jobs of this page, in the order asked (newest first by default)")
    total: int = Field(description="How many jobs match the filters, over all pages")


class DeleteBatchJobResponse(BaseModel):
    """The SDK's ``DeleteBatchJobResponse``: the ended job, its results and errors are gone."""

    id: str = Field(description="The deleted job's id")
    object: Literal["batch"] = Field(default="batch", description="Always `batch`")
    deleted: bool = Field(default=True, description="Always true")
