"""The native jobs route (``/v1/jobs``): request and response models in the canonical words
(``InlineRequest`` is Mistral's inline request too)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from llm_batch.api.file_models import UNIX, epoch
from llm_batch.core.estimates import Estimate
from llm_batch.core.job_spec import MAX_INLINE_REQUESTS, JobSpec
from llm_batch.core.snapshots import Job

JOB_ID_PATTERN = r"^[A-Za-z0-9_.-]{1,128}$"

__all__ = ["JOB_ID_PATTERN", "CreateJob", "DerivedFromOut", "EstimateOut", "JobList", "JobOut", "JobRequestItem"]


class InlineRequest(BaseModel):
    """One inline request of a batch job. No other field is allowed (422)."""

    model_config = ConfigDict(extra="forbid")

    custom_id: str | None = Field(
        default=None,
        max_length=512,
        description="Your id for the request, carried by its result or error line; default: its 0-based "
        "position in `requests`, as a string",
    )
    body: dict[str, Any] = Field(
        description="The request body for the job's endpoint (e.g. `messages`, `max_tokens`); checked per "
        "request by the job's validation (a bad one is an error line, not a refused job). A `model` in it is "
        "not used: the job's model runs"
    )


class JobRequestItem(InlineRequest):  # the same fields as a Mistral inline request (one model)
    """One inline request of a job. No other field is allowed (422)."""


class CreateJob(JobSpec):
    """Create a job: exactly one of ``requests``, ``input_file_ids`` and ``input_uri``, and the
    job's spec. With ``id``, a create is idempotent. Unknown fields are refused (422)."""

    id: str | None = Field(
        default=None,
        pattern=JOB_ID_PATTERN,
        description="Your id for the job (1-128 of A-Z a-z 0-9 _ . -); default: a new `job_<hex>`. Creating an id "
        "that is already yours answers that job unchanged (re-attach: a retried task never submits twice)",
    )
    requests: list[JobRequestItem] | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_INLINE_REQUESTS,
        description="Inline requests (1-100,000), stored as the job's input file",
    )
    input_file_ids: list[str] | None = Field(
        default=None,
        min_length=1,
        max_length=100,
        description="Ids of your uploaded input files (POST /v1/files), read in order as one batch; each at most "
        "once, and not a job's output or error file (400)",
    )
    input_uri: str | None = Field(
        default=None,
        max_length=4096,
        description="A JSONL file you may name: an absolute path under the local roots, or `s3://` in an allowed "
        "bucket (400 naming the rule otherwise)",
    )
    dry_run: bool = Field(
        default=False,
        description="Only estimate: every check of a create runs (auth, model, paths, limits; 4xx as a create), the "
        "input is validated and counted, and the answer is the estimate (`object: job.estimate`); no job, run or "
        "file is created. See \"Estimates (dry run)\" in docs/api.md",
    )



class JobCounts(BaseModel):
    """A job's request counts, live while it runs."""

    total: int = Field(description="Requests in the job; 0 until its input has been read")
    completed: int = Field(description="Requests with an outcome (succeeded + failed)")
    succeeded: int = Field(description="Requests with a result line in the output file")
    failed: int = Field(
        description="Requests with an error line: invalid input lines, engine errors, requests never run "
        "(cancelled, timed out, a failed shard)"
    )
    invalid_output: int = Field(
        default=0, description="Of the failed: requests whose last answer failed the job's `output_check`")


class JobUsage(BaseModel):
    """What a job used so far (final once it ended)."""

    prompt_tokens: int = Field(description="Prompt tokens of the succeeded requests")
    completion_tokens: int = Field(description="Generated tokens of the succeeded requests")
    total_tokens: int = Field(description="prompt_tokens + completion_tokens")
    engine_seconds: float = Field(description="Seconds the engines spent on the job's shards, summed")
    cached_requests: int = Field(
        default=0, description="Succeeded requests answered from the result cache (no engine time), part of succeeded")
    cached_tokens: int = Field(
        default=0, description="Prompt + completion tokens of the cached requests (also in the token counts above)")
    output_retries: int = Field(
        default=0, description="Answers that failed the job's `output_check` and were tried again")
    retry_tokens: int = Field(
        default=0, description="Prompt + completion tokens of those discarded answers (not in the token counts above)")
    tokens_per_s: float = Field(
        default=0.0, description="Generated tokens per engine second: of its running shards while it runs, over "
        "the time its engines ran once it ended (engine start and queue left out); 0 before a shard reports")


class DerivedFromOut(BaseModel):
    """The ended job a job was made from, and how."""

    job_id: str = Field(description="The id of the job it was made from")
    kind: Literal["retry", "rerun"] = Field(
        description="`retry`: only that job's failed and never-run lines; `rerun`: all of its input again"
    )


class QueueOut(BaseModel):
    """Where a job that has not started waits, in the order Airflow's scheduler will follow."""

    position: int = Field(description="1: the next job to start there; counts jobs, not tasks")
    pool: str | None = Field(description="The Airflow pool whose slot the job's tasks wait for; null while its run "
                             "waits to start at all")
    waiting_for: str = Field(description="What it waits for, in words (e.g. `a slot of pool llm_batch_local (1 of 1 in use)`)")


class EstimateOut(Estimate):
    """A dry run's answer: what the job would take. Nothing was created."""

    object: Literal["job.estimate"] = Field(default="job.estimate", description="Always `job.estimate`")


class JobOut(BaseModel):
    """A job in the canonical words (every job, whichever way in made it)."""

    id: str = Field(description="The job id")
    status: str = Field(
        description="QUEUED, VALIDATING, RUNNING, FINALIZING, CANCELLING (live), or SUCCEEDED, FAILED, "
        "TIMEOUT_EXCEEDED, CANCELLED (ended)"
    )
    terminal: bool = Field(description="Whether the status is an end status (the job will not change any more)")
    endpoint: str = Field(description="The API every request calls")
    model: str = Field(description="The model the job runs")
    owner: str = Field(description="Who owns the job (the API key's owner or the Airflow user)")
    counts: JobCounts = Field(description="The request counts")
    usage: JobUsage = Field(description="Tokens and engine time")
    input_file_ids: list[str] = Field(description="Ids of the uploaded input files, in order; empty otherwise")
    output_file_id: str | None = Field(
        default=None,
        description="Id of the JSONL file of the succeeded requests' results in input order (GET "
        "/v1/files/{id}/content); set once the results are merged, also for a cancelled or timed-out job",
    )
    error_file_id: str | None = Field(
        default=None, description="Id of the JSONL file of the failed requests (one line each); set once merged"
    )
    output_uri: str | None = Field(default=None, description="The output_uri the job also writes, as given; null when none")
    created_at: int = Field(description=f"When the job was created, {UNIX}")
    started_at: int | None = Field(default=None, description=f"When the job began reading its input, {UNIX}")
    ended_at: int | None = Field(default=None, description=f"When the job ended (any end status), {UNIX}")
    expires_at: int | None = Field(default=None, description=f"The job's deadline, {UNIX}")
    status_reason: str | None = Field(default=None, description="Why the job is in its status (a failure's reason)")
    dag_run_id: str | None = Field(default=None, description="The batch_inference DAG run that drives the job")
    labels: dict[str, Any] = Field(description="The job's labels")
    derived_from: DerivedFromOut | None = Field(
        default=None,
        description="The job this one was made from by `POST /v1/jobs/{id}/retry` or `/rerun`; null for a job "
        "submitted otherwise",
    )
    queue: QueueOut | None = Field(
        default=None,
        description="While the job waits for Airflow to start it (a slot of its pool, or its run's start): its "
        "place; null once any of its tasks runs, and for an ended job",
    )
    estimate: Estimate | None = Field(
        default=None,
        description="What the job was expected to take, made when its input was validated (beside `usage`, "
        "`started_at` and `ended_at`, what it took); null before, and for jobs validated before estimates existed",
    )

    @classmethod
    def of(cls, job: Job, queue: QueueOut | None = None) -> JobOut:
        ended = job.completed_at or job.failed_at or job.cancelled_at or job.expired_at
        return cls(
            id=job.id,
            status=job.status.value,
            terminal=job.terminal,
            endpoint=job.endpoint,
            model=job.model,
            owner=job.owner,
            counts=JobCounts(total=job.total, completed=job.completed, succeeded=job.succeeded, failed=job.failed,
                             invalid_output=job.invalid_output),
            usage=JobUsage(
                prompt_tokens=job.prompt_tokens,
                completion_tokens=job.completion_tokens,
                total_tokens=job.prompt_tokens + job.completion_tokens,
                engine_seconds=job.engine_seconds,
                cached_requests=job.result_cache_hits,
                cached_tokens=job.result_cache_tokens,
                output_retries=job.output_retries,
                retry_tokens=job.retry_tokens,
                tokens_per_s=job.tokens_per_s,
            ),
            input_file_ids=list(job.input.file_ids or []),
            output_file_id=job.output_file_id,
            error_file_id=job.error_file_id,
            output_uri=job.array_output_uri,
            created_at=epoch(job.created_at) or 0,
            started_at=epoch(job.started_at),
            ended_at=epoch(ended) if job.terminal else None,
            expires_at=epoch(job.expires_at),
            status_reason=job.status_reason,
            dag_run_id=job.dag_run_id,
            labels=dict(job.labels or {}),
            derived_from=DerivedFromOut(job_id=job.derived_from.job_id, kind=job.derived_from.kind)
            if job.derived_from else None,
            queue=None if job.terminal else queue,
            estimate=_kept_estimate(job.estimate),
        )


def _kept_estimate(kept: dict[str, Any] | None) -> Estimate | None:
    """A stored estimate as answered; one the model no longer reads (an older shape) is left out."""
    if not kept:
        return None
    try:
        return Estimate.model_validate(kept)
    except ValueError:
        return None


class JobList(BaseModel):
    """A page of jobs, newest first."""

    data: list[JobOut] = Field(description="The jobs of this page")
    next_cursor: str | None = Field(
        default=None, description="Pass as `after` for the next page; null on the last page"
    )
    has_more: bool = Field(description="Whether another page follows")
