"""``GET /v1/usage``: tokens, requests, engine and GPU seconds summed over jobs, grouped by owner,
model or label. Admins see every owner's jobs (or one owner's); anyone else only their own."""

from __future__ import annotations

import math
from dataclasses import asdict
from datetime import UTC, datetime
from typing import Annotated, Literal

from fastapi import APIRouter, Query
from pydantic import BaseModel, Field

from llm_batch.api.auth import CallerDep
from llm_batch.api.errors import ApiError
from llm_batch.api.state import StoreDep
from llm_batch.core.snapshots import UsageRow

UsageGrouping = Literal["owner", "model", "label"]


class UsageRequests(BaseModel):
    """The request counts of a group's jobs, summed."""

    total: int = Field(description="Requests of the group's jobs (their input lines; 0 for a job not yet validated)")
    succeeded: int = Field(description="Requests answered successfully")
    failed: int = Field(description="Requests with an error line: invalid input lines, failed requests, and "
                        "requests that never ran (cancelled, expired, shard failed)")


class UsageGroup(BaseModel):
    """One group's jobs, requests, tokens, engine and GPU seconds, summed over its jobs."""

    group: str = Field(description="The owner, the model or a label `key=value` (per `by`); `(none)`: the jobs "
                       "without labels; `(all)`: every job, when `by` is not given")
    jobs: int = Field(description="Jobs in the group, whatever their status (a job with n labels is in n label groups)")
    requests: UsageRequests = Field(description="The jobs' request counts (live for jobs still running)")
    prompt_tokens: int = Field(description="Prompt (input) tokens")
    completion_tokens: int = Field(description="Completion (output) tokens")
    cached_prompt_tokens: int = Field(description="Prompt tokens served from the prefix cache (a job whose count "
                                      "is unknown adds 0)")
    reasoning_tokens: int = Field(description="Hidden reasoning tokens (0 unless the outputs counted some)")
    cached_requests: int = Field(default=0, description="Succeeded requests answered from the result cache (no engine "
                                 "time; in `requests.succeeded`)")
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
    gpu_seconds: float = Field(description="Each job's engine seconds x its GPUs (the job's `gpus`, 1 when it names "
                               "none; a job recorded with 0 GPUs adds 0), summed")

    @classmethod
    def of(cls, row: UsageRow) -> UsageGroup:
        requests = UsageRequests(total=row.requests_total, succeeded=row.requests_succeeded, failed=row.requests_failed)
        return cls(**{**asdict(row), "engine_seconds": round(row.engine_seconds, 3),
                      "gpu_seconds": round(row.gpu_seconds, 3)}, requests=requests)


class UsageList(BaseModel):
    """The usage report of `GET /v1/usage`: one entry per group, of the caller's own jobs
    (admins: every owner's, or the `owner` asked for)."""

    object: Literal["list"] = Field("list", description="Always `list`")
    by: UsageGrouping | None = Field(description="What the groups are: owner, model, label, or null (one group, "
                                     "`(all)`)")
    since: datetime | None = Field(description="Only jobs created at or after this time (UTC, ISO 8601) are counted; "
                                   "null: every job")
    owner: str | None = Field(default=None, description="Whose jobs are counted: the caller's own name for a "
                              "non-admin, the `owner` an admin asked for, null: every owner's (admins)")
    data: list[UsageGroup] = Field(description="One entry per group, ordered by group (empty when no job matches a "
                                   "`by`)")


router = APIRouter(prefix="/v1/usage", tags=["usage"])


def parse_since(text: str) -> datetime:
    """Unix seconds or ISO 8601 (no zone means UTC) -> an aware UTC datetime."""
    value = text.strip()
    try:
        try:
            seconds = float(value)
        except ValueError:
            when = datetime.fromisoformat(value)
            return (when.replace(tzinfo=UTC) if when.tzinfo is None else when).astimezone(UTC)
        if not math.isfinite(seconds):
            raise ValueError("not a finite number")
        return datetime.fromtimestamp(seconds, UTC)
    except (ValueError, OverflowError, OSError) as exc:
        raise ApiError(400, f"since={text[:64]!r} is not a time: give Unix seconds (1767225600) or ISO 8601 "
                       f"(2026-01-01, 2026-01-01T12:00:00Z) ({exc})", param="since", code="invalid_value") from None


@router.get("", response_model=UsageList,
            summary="Usage summed over jobs, by owner, model or label (your own jobs; admins: every owner's)")
def get_usage(
    caller: CallerDep, store: StoreDep,
    by: Annotated[UsageGrouping | None, Query(
        description="Group by owner, model or label (one group per label key=value: a job with two labels "
        "counts in both, jobs without labels in `(none)`); omitted: one group `(all)`")] = None,
    since: Annotated[str | None, Query(max_length=64, description="Only jobs created at or after this time: Unix "
                                       "seconds or ISO 8601 (no zone: UTC)")] = None,
    owner: Annotated[str | None, Query(max_length=256, description="Admins: only this owner's jobs; others always "
                                       "get only their own")] = None,
) -> UsageList:
    start = parse_since(since) if since is not None else None
    counted = owner if caller.is_admin else caller.name
    rows = store.usage(by=by, since=start, owner=counted)
    return UsageList(by=by, since=start, owner=counted, data=[UsageGroup.of(row) for row in rows])
