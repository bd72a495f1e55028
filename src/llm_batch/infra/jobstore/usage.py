"""Usage: what owners hold now (the per-owner limits' measures) and what jobs used, summed by
owner, model or label (``/v1/usage``, ``llm-batch usage``). Reads the ``jobs`` and ``files``
tables; writes nothing.
"""

from __future__ import annotations

import dataclasses
from datetime import datetime
from typing import Any, Protocol

from sqlalchemy import func, select
from sqlalchemy.sql.elements import ColumnElement

from llm_batch.core.jobs import JobStatus
from llm_batch.infra.jobstore.repository import Repository, require_aware
from llm_batch.infra.jobstore.tables import FILES, JOBS

# JobStore.usage: what it groups by, and the groups that are not a value of the column.
USAGE_GROUPINGS = ("owner", "model", "label")
USAGE_ALL_GROUP = "(all)"  # by=None: one row over every job
USAGE_NO_LABELS_GROUP = "(none)"  # by="label": the jobs without labels


@dataclasses.dataclass(frozen=True)
class UsageRow:
    """JobStore.usage: the sums over one group's jobs (any status; live jobs with their live
    counts). ``gpu_seconds``: each job's engine seconds x its GPUs (see JobStore.usage)."""

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


class Usage(Protocol):
    """Usage, as the API's limits and usage report and the CLI read it (UsageRepository)."""

    def owner_usage(self, owner: str) -> dict[str, int]: ...
    def usage(
        self, by: str | None = None, since: datetime | None = None, owner: str | None = None
    ) -> list[UsageRow]: ...


class UsageRepository(Repository):
    """Usage (see the module docstring)."""

    def owner_usage(self, owner: str) -> dict[str, int]:
        """What `owner` holds now: live jobs, their requests (known totals) and the bytes of
        their stored files that are not deleted (the per-owner limits' measures)."""
        live = [s.value for s in JobStatus if not s.terminal]
        with self._transaction(write=False) as connection:
            jobs, requests = connection.execute(
                select(func.count(), func.coalesce(func.sum(JOBS.c.total), 0))
                .where(JOBS.c.owner == owner, JOBS.c.status.in_(live))
            ).one()
            stored = connection.execute(
                select(func.coalesce(func.sum(FILES.c.bytes), 0))
                .where(FILES.c.owner == owner, FILES.c.deleted_at.is_(None))
            ).scalar_one()
        return {"live_jobs": int(jobs), "requests_in_flight": int(requests), "file_bytes": int(stored)}

    def usage(
        self, by: str | None = None, since: datetime | None = None, owner: str | None = None
    ) -> list[UsageRow]:
        """Usage summed over jobs created at or after `since` (every job when None), of
        `owner` when given, whatever their status: jobs, requests (total, succeeded,
        failed), tokens, engine seconds and GPU seconds.

        ``by``: None -> one row, group ``(all)`` (zeros when no job matches); ``owner`` or
        ``owner`` -> one row per value (summed in SQL); ``model`` -> one row per model that
        answered (``_usage_by_model``: a job mixing LoRA adapters counts in each); ``label`` -> one row per label
        ``key=value`` a job has: a job with two labels counts in both rows, a job without
        labels in the row ``(none)`` (labels are JSON: summed in Python over the streamed
        rows, keeping only the per-group sums). Rows are ordered by group.

        GPU seconds of a job: its engine seconds x the ``gpus`` in its resources, 1 when it
        names none (what every shard is planned with). A job recorded with ``gpus: 0`` (a CPU
        run) adds 0; the store does not record the device a shard ran on, so a CPU run
        planned with the default counts as 1 GPU.
        """
        if by is not None and by not in USAGE_GROUPINGS:
            raise ValueError(f"cannot group usage by {by!r}; use one of {', '.join(USAGE_GROUPINGS)} (or none)")
        require_aware(since=since)
        c = JOBS.c
        filters: list[ColumnElement[bool]] = []
        if since is not None:
            filters.append(c.created_at >= since)
        if owner is not None:
            filters.append(c.owner == owner)
        gpus = func.coalesce(c.resources["gpus"].as_integer(), 1)
        measures = (c.total, c.succeeded, c.failed, c.prompt_tokens, c.completion_tokens, c.cached_prompt_tokens,
                    c.reasoning_tokens, c.result_cache_hits, c.result_cache_tokens, c.invalid_output,
                    c.output_retries, c.retry_tokens, c.engine_seconds, c.engine_seconds * gpus)
        integers = len(measures) - 2  # the last two are seconds

        def row_of(group: str, jobs: int, sums: list[Any]) -> UsageRow:
            counts, seconds = sums[:integers], sums[integers:]
            return UsageRow(str(group), int(jobs), *(int(v or 0) for v in counts), *(float(v or 0) for v in seconds))

        with self._transaction(write=False) as connection:
            if by == "model":
                return self._usage_by_model(connection, filters, measures)
            if by == "label":
                totals: dict[str, list[float]] = {}
                rows = connection.execution_options(yield_per=1000).execute(select(c.labels, *measures).where(*filters))
                for labels, *values in rows:
                    pairs = labels.items() if isinstance(labels, dict) else ()
                    for group in [f"{key}={value}" for key, value in pairs] or [USAGE_NO_LABELS_GROUP]:
                        sums = totals.setdefault(group, [0] * (len(measures) + 1))
                        sums[0] += 1
                        for i, value in enumerate(values, start=1):
                            sums[i] += value or 0
                return [row_of(group, sums[0], sums[1:]) for group, sums in sorted(totals.items())]
            query = select(func.count(), *(func.coalesce(func.sum(m), 0) for m in measures)).where(*filters)
            if by is None:
                jobs, *sums = connection.execute(query).one()
                return [row_of(USAGE_ALL_GROUP, jobs, sums)]
            key = c[by]
            rows = connection.execute(query.add_columns(key).group_by(key).order_by(key))
            return [row_of(group, jobs, sums) for jobs, *sums, group in rows]

    @staticmethod
    def _usage_by_model(connection: Any, filters: list[ColumnElement[bool]], measures: tuple[Any, ...]) -> list[UsageRow]:
        """One row per model that answered: a job run on one model counts under it; a job
        whose lines ran on several (its base and LoRA adapters, ``model_usage``) counts in
        each: that model's succeeded requests and tokens exactly, its share of the engine
        and GPU seconds by its share of the job's tokens; the job's failed requests, and
        whatever no model claims, under the job's own model."""
        c = JOBS.c
        totals: dict[str, list[float]] = {}
        rows = connection.execution_options(yield_per=1000).execute(select(c.model, c.model_usage, *measures).where(*filters))
        for (model, per_model, total, succeeded, failed, prompt, completion, cached, reasoning, hits, hit_tokens,
             invalid, retries, retry_tokens, seconds, gpu_seconds) in rows:
            parts = per_model if isinstance(per_model, dict) and len(per_model) > 1 else {}
            job_tokens = sum(int(u.get("prompt_tokens", 0)) + int(u.get("completion_tokens", 0)) for u in parts.values())
            claimed = [0, 0, 0]
            for name, used in sorted(parts.items()):
                ok, p, q = (int(used.get(k, 0)) for k in ("succeeded", "prompt_tokens", "completion_tokens"))
                share = (p + q) / job_tokens if job_tokens else 0.0
                _add(totals, name, [ok, ok, 0, p, q, 0, 0, 0, 0, 0, 0, 0,
                                    (seconds or 0) * share, (gpu_seconds or 0) * share])
                claimed = [claimed[0] + ok, claimed[1] + p, claimed[2] + q]
            rest = 1.0 - sum(((int(u.get("prompt_tokens", 0)) + int(u.get("completion_tokens", 0))) / job_tokens
                              if job_tokens else 0.0) for u in parts.values())
            left = [(total or 0) - claimed[0], (succeeded or 0) - claimed[0], failed or 0, (prompt or 0) - claimed[1],
                    (completion or 0) - claimed[2], cached or 0, reasoning or 0, hits or 0, hit_tokens or 0,
                    invalid or 0, retries or 0, retry_tokens or 0, (seconds or 0) * rest, (gpu_seconds or 0) * rest]
            if not parts or any(left):
                _add(totals, model, left, job=not parts or model not in parts)
        return [UsageRow(group, int(sums[0]), *(int(v) for v in sums[1:13]), *(float(v) for v in sums[13:]))
                for group, sums in sorted(totals.items())]


def _add(totals: dict[str, list[float]], group: str, values: list[float], job: bool = True) -> None:
    """Add one job's figures (requests total, succeeded, failed, tokens x4, cached requests and
    tokens, invalid outputs, retries and their tokens, seconds x2) to a group."""
    sums = totals.setdefault(group, [0] * 15)
    sums[0] += 1 if job else 0
    for i, value in enumerate(values, start=1):
        sums[i] += value
