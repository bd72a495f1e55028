"""OpenAI Batch API: request and response models (the ``openai`` SDK's types are the contract)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from llm_batch.api.file_models import UNIX, ExpiresAfter, epoch
from llm_batch.core.endpoints import SUPPORTED_LISTED
from llm_batch.core.job_spec import check_pairs
from llm_batch.core.jobs import JobStatus
from llm_batch.core.snapshots import Job

COMPLETION_WINDOW_SECONDS = {"24h": 24 * 3600}

# The categories of an OpenAI moderation result (the openai SDK's Moderation: each one
# required in category_scores): an OpenAI /v1/moderations batch needs a model whose registry
# moderation map names them all.
MODERATION_CATEGORIES = (
    "harassment", "harassment/threatening", "hate", "hate/threatening", "illicit", "illicit/violent",
    "self-harm", "self-harm/instructions", "self-harm/intent", "sexual", "sexual/minors", "violence",
    "violence/graphic",
)

# The dialect's word for each canonical status.
OPENAI_STATUS = {
    JobStatus.QUEUED: "validating",
    JobStatus.VALIDATING: "validating",
    JobStatus.RUNNING: "in_progress",
    JobStatus.FINALIZING: "finalizing",
    JobStatus.CANCELLING: "cancelling",
    JobStatus.SUCCEEDED: "completed",
    JobStatus.FAILED: "failed",
    JobStatus.TIMEOUT_EXCEEDED: "expired",
    JobStatus.CANCELLED: "cancelled",
}


class CreateBatchRequest(BaseModel):
    """Create a batch from an uploaded JSONL file (``client.batches.create``). Unknown fields
    are ignored."""

    model_config = ConfigDict(extra="ignore")

    input_file_id: str = Field(
        min_length=1,
        max_length=128,
        description="Id of one of your uploaded input files (POST /v1/files, purpose `batch`): one request per "
        "line. A job's output or error file is refused (400). The model is taken from the first request line's "
        "`body.model` and runs every line (the model other lines name is not used)",
    )
    endpoint: str = Field(
        max_length=128,
        description=f"The API every request of the batch calls: {SUPPORTED_LISTED}; another is 400 listing these",
    )
    completion_window: Literal["24h"] = Field(
        default="24h",
        description="Only `24h`: the batch's deadline, 24 h after creation. At the deadline workers stop, "
        "finished results are kept and the status is `expired`",
    )
    metadata: dict[str, str] | None = Field(
        default=None,
        description="Your key-value pairs, stored with the batch and answered as given: at most 16 pairs, keys "
        "up to 64 characters, values up to 512 (422 beyond)",
    )

    output_expires_after: ExpiresAfter | None = Field(
        default=None,
        description="When the batch's output and error files expire: `{\"anchor\": \"created_at\", \"seconds\": "
        "3600..2592000}`, counted from each file's creation (capped by the deployment's retention); the files "
        "are deleted then (404). Without it they follow the retention (LLM_BATCH_RETENTION_DAYS)",
    )

    # OpenAI's rule: up to 16 pairs, keys up to 64 characters, values up to 512.
    _metadata = field_validator("metadata")(lambda value: check_pairs(value, max_pairs=16))


class BatchRequestCounts(BaseModel):
    """The batch's request counts: live while it runs (a count never goes down)."""

    total: int = Field(description="Requests in the batch; 0 until its input has been read")
    completed: int = Field(description="Requests that succeeded (OpenAI's meaning: not every request with an outcome)")
    failed: int = Field(
        description="Requests that failed: invalid input lines, engine errors, and requests never run "
        "(cancelled, expired or a failed shard)"
    )


class InputTokensDetails(BaseModel):
    """Details of the prompt tokens."""

    cached_tokens: int | None = Field(
        default=None,
        description="Prompt tokens served from the engine's prefix cache; null when the engine did not say "
        "(OpenAI always gives a number)",
    )


class OutputTokensDetails(BaseModel):
    """Details of the generated tokens."""

    reasoning_tokens: int = Field(
        default=0,
        description="Hidden reasoning tokens: 0 unless the output lines count some (the engine returns every "
        "token it generates as output)",
    )


class BatchUsage(BaseModel):
    """The SDK's ``BatchUsage``: live while the batch runs, exact once merged."""

    input_tokens: int = Field(description="Prompt tokens of the requests run so far")
    input_tokens_details: InputTokensDetails = Field(description="Details of the prompt tokens")
    output_tokens: int = Field(description="Generated tokens of the requests run so far")
    output_tokens_details: OutputTokensDetails = Field(description="Details of the generated tokens")
    total_tokens: int = Field(description="input_tokens + output_tokens")

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
    """One batch-level error: an entry of the job's error summary, or the reason a failed
    batch failed. Each request's own error is a line of the error file."""

    code: str | None = Field(
        default=None,
        description="`batch_failed` (the reason the batch failed), `invalid_request` (input lines failed "
        "validation), `not_run` (requests never run: cancel, deadline or a failed shard) or `request_failed` "
        "(requests failed in the engine)",
    )
    message: str | None = Field(default=None, description="What went wrong, in a sentence")
    param: str | None = Field(default=None, description="The parameter at fault; null in these summaries")
    line: int | None = Field(
        default=None,
        description="1-based input line; null in these summaries (the error file gives each failed request's line)",
    )


class BatchErrors(BaseModel):
    """The batch's errors, as the SDK's ``Errors`` list."""

    object: Literal["list"] = Field(default="list", description="Always `list`")
    data: list[BatchErrorData] = Field(description="The errors; the failure reason of a failed batch first")


class BatchOut(BaseModel):
    """A batch (the SDK's ``Batch``); every job is readable here by id."""

    id: str = Field(description="The batch id (`job_<hex>` when made through the API): the job's id in every dialect")
    object: Literal["batch"] = Field(default="batch", description="Always `batch`")
    endpoint: str = Field(
        description="The API every request calls: `/v1/chat/completions`, `/v1/completions`, `/v1/embeddings` "
        "or `/v1/responses`"
    )
    model: str | None = Field(
        default=None,
        description="The model every request runs on (for a batch made here: the first request line's `body.model`); "
        "null when the job names none",
    )
    errors: BatchErrors | None = Field(
        default=None,
        description="Batch-level errors: the job's error summary and, for a failed batch, its reason; null when "
        "there are none. Invalid input lines are not listed one by one as OpenAI does: each is a line of the "
        "error file",
    )
    input_file_id: str = Field(
        description="The input file's id (the first one for a job made from several files); empty for a job made "
        "from inline requests in another dialect"
    )
    completion_window: str = Field(
        default="24h", description="Always `24h`, whatever the job's actual deadline (see expires_at)"
    )
    status: str = Field(
        description="`validating` (queued or reading its input), `in_progress`, `finalizing`, `completed`, "
        "`failed`, `expired` (stopped at its deadline), `cancelling` or `cancelled`"
    )
    output_file_id: str | None = Field(
        default=None,
        description="Id of the JSONL file of the succeeded requests' results (GET /v1/files/{id}/content), in input "
        "order; set once the results are merged, also for a cancelled or expired batch (its partial results)",
    )
    error_file_id: str | None = Field(
        default=None,
        description="Id of the JSONL file of the failed requests, one line each with its 1-based input `line`; set "
        "once the results are merged (even when empty: OpenAI leaves it null), or when its input was rejected",
    )
    created_at: int = Field(description=f"When the batch was created, {UNIX}")
    in_progress_at: int | None = Field(
        default=None, description=f"When its requests started running, {UNIX}; null before"
    )
    expires_at: int | None = Field(
        default=None,
        description=f"The deadline, {UNIX}: created_at + the completion window (or the job's own runtime limit)",
    )
    finalizing_at: int | None = Field(default=None, description=f"When merging the results began, {UNIX}; null before")
    completed_at: int | None = Field(
        default=None, description=f"When the batch completed, {UNIX}; set only for status `completed`"
    )
    failed_at: int | None = Field(default=None, description=f"When the batch failed, {UNIX}; null unless it failed")
    expired_at: int | None = Field(
        default=None, description=f"When the batch passed its deadline, {UNIX}; null unless it expired"
    )
    cancelling_at: int | None = Field(
        default=None, description=f"When its cancel was requested, {UNIX}; null if never"
    )
    cancelled_at: int | None = Field(
        default=None, description=f"When the batch ended cancelled, {UNIX}; null unless cancelled"
    )
    request_counts: BatchRequestCounts = Field(description="Request counts, live while the batch runs")
    usage: BatchUsage | None = Field(
        default=None,
        description="Token usage: live while the batch runs, exact once merged; null while it has not started running",
    )
    metadata: dict[str, Any] | None = Field(default=None, description="The metadata given at creation; null when none")

    @classmethod
    def of(cls, job: Job) -> BatchOut:
        return cls(
            id=job.id,
            endpoint=job.endpoint,
            model=job.model or None,
            errors=_errors(job),
            input_file_id=(job.input.file_ids or [""])[0],
            status=OPENAI_STATUS[job.status],
            output_file_id=job.output_file_id,
            error_file_id=job.error_file_id,
            created_at=epoch(job.created_at) or 0,
            **{name: epoch(getattr(job, name)) for name in _TIMES},
            # OpenAI sets completed_at only for a batch that completed.
            completed_at=epoch(job.completed_at) if OPENAI_STATUS[job.status] == "completed" else None,
            # OpenAI's "completed" counts succeeded requests; "failed" the others.
            request_counts=BatchRequestCounts(total=job.total, completed=job.succeeded, failed=job.failed),
            usage=BatchUsage.of(job),
            metadata=job.metadata or None,
        )


_TIMES = ("in_progress_at", "expires_at", "finalizing_at", "failed_at", "expired_at", "cancelling_at", "cancelled_at")


def _errors(job: Job) -> BatchErrors | None:
    data = [
        BatchErrorData(code=e.get("code"), message=e.get("message"), line=e.get("line"), param=e.get("param"))
        for e in job.errors
    ]
    if job.status_reason and job.status.value == "FAILED":
        data.insert(0, BatchErrorData(code="batch_failed", message=job.status_reason))
    return BatchErrors(data=data) if data else None


class BatchList(BaseModel):
    """A page of your batches, newest first (the SDK's cursor page)."""

    object: Literal["list"] = Field(default="list", description="Always `list`")
    data: list[BatchOut] = Field(description="The batches of this page, newest first")
    first_id: str | None = Field(default=None, description="Id of the first batch of the page; null when it is empty")
    last_id: str | None = Field(
        default=None,
        description="Id of the last batch of the page (pass it as `after` for the next page); null when empty",
    )
    has_more: bool = Field(description="Whether batches follow this page")
