"""The usage report's response (``GET /v1/usage``, admins only): the job store's
``JobStore.usage`` rows, grouped by owner, model or label."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, Field

from llm_batch.infra.jobstore.snapshots import UsageRow

UsageGrouping = Literal["owner", "model", "label"]


class UsageRequests(BaseModel):
    """The request counts of a group's jobs, summed."""

    total: int = Field(description="Requests of the group's jobs (their input lines; 0 for a job not yet validated)")
    succeeded: int = Field(description="Requests answered successfully")
    failed: int = Field(
        description="Requests with an error line: invalid input lines, failed requests, and requests that never "
        "ran (cancelled, expired, shard failed)"
    )


class UsageGroup(BaseModel):
    """One group's jobs, requests, tokens, engine and GPU seconds, summed over its jobs."""

    group: str = Field(
        description="The owner, the model or a label `key=value` (per `by`); `(none)`: the jobs without labels; "
        "`(all)`: every job, when `by` is not given"
    )
    jobs: int = Field(description="Jobs in the group, whatever their status (a job with n labels is in n label groups)")
    requests: UsageRequests = Field(description="The jobs' request counts (live for jobs still running)")
    prompt_tokens: int = Field(description="Prompt (input) tokens")
    completion_tokens: int = Field(description="Completion (output) tokens")
    cached_prompt_tokens: int = Field(
        description="Prompt tokens served from the prefix cache (a job whose count is unknown adds 0)"
    )
    reasoning_tokens: int = Field(description="Hidden reasoning tokens (0 unless the outputs counted some)")
    cached_requests: int = Field(
        default=0, description="Succeeded requests answered from the result cache (no engine time; in `requests.succeeded`)")
    cached_tokens: int = Field(
        default=0, description="Prompt + completion tokens of the cached requests (also in the token counts)")
    invalid_output: int = Field(
        default=0, description="Requests whose answers failed the job's `output_check` after its retries (in "
        "`requests.failed`)")
    output_retries: int = Field(
        default=0, description="Answers that failed the job's `output_check` and were tried again")
    retry_tokens: int = Field(
        default=0, description="Prompt + completion tokens of those discarded answers (not in the token counts)")
    engine_seconds: float = Field(description="Seconds the jobs' shard engines ran, all attempts summed")
    gpu_seconds: float = Field(
        description="Each job's engine seconds x its GPUs (the job's `gpus`, 1 when it names none; a job recorded "
        "with 0 GPUs adds 0), summed"
    )

    @classmethod
    def of(cls, row: UsageRow) -> UsageGroup:
        return cls(
            group=row.group,
            jobs=row.jobs,
            requests=UsageRequests(
                total=row.requests_total, succeeded=row.requests_succeeded, failed=row.requests_failed
            ),
            prompt_tokens=row.prompt_tokens,
            completion_tokens=row.completion_tokens,
            cached_prompt_tokens=row.cached_prompt_tokens,
            reasoning_tokens=row.reasoning_tokens,
            cached_requests=row.cached_requests,
            cached_tokens=row.cached_tokens,
            invalid_output=row.invalid_output,
            output_retries=row.output_retries,
            retry_tokens=row.retry_tokens,
            engine_seconds=round(row.engine_seconds, 3),
            gpu_seconds=round(row.gpu_seconds, 3),
        )


class UsageList(BaseModel):
    """The usage report of `GET /v1/usage`: one entry per group, of the caller's own jobs
    (admins: every owner's, or the `owner` asked for)."""

    object: Literal["list"] = Field("list", description="Always `list`")
    by: UsageGrouping | None = Field(
        description="What the groups are: owner, model, label, or null (one group, `(all)`)"
    )
    since: datetime | None = Field(
        description="Only jobs created at or after this time (UTC, ISO 8601) are counted; null: every job"
    )
    owner: str | None = Field(
        default=None,
        description="Whose jobs are counted: the caller's own name for a non-admin, the `owner` an admin asked "
        "for, null: every owner's (admins)",
    )
    data: list[UsageGroup] = Field(
        description="One entry per group, ordered by group (empty when no job matches a `by`)"
    )
