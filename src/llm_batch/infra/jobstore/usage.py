"""Usage: what owners hold now (the per-owner limits' measures), what jobs used, summed by
owner, model or label (``/v1/usage``, ``llm-batch usage``), and the whole store's figures for
a metrics scrape (``/batch/metrics``)."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import func, select

from llm_batch.core.jobs import JobStatus
from llm_batch.core.snapshots import UsageRow
from llm_batch.infra.jobstore.models import ADAPTERS, ATTEMPTS, DELIVERIES, FILES, JOBS
from llm_batch.infra.jobstore.paging import matching
from llm_batch.infra.jobstore.repository import ENDED_STATUSES, LIVE_STATUSES, Repository, require_aware

# JobStore.usage: what it groups by, and the groups that are not a value of the column.
USAGE_GROUPINGS = ("owner", "model", "label")
USAGE_ALL_GROUP = "(all)"  # by=None: one row over every job
USAGE_NO_LABELS_GROUP = "(none)"  # by="label": the jobs without labels


@dataclasses.dataclass(frozen=True)
class LiveJob:
    id: str
    status: str
    dag_run_id: str | None
    still_s: float  # seconds since it last changed (progress, status)
    terminal: bool = False  # always (a live job); read where a store's Job is too


@dataclasses.dataclass(frozen=True)
class StoreFigures:
    jobs: dict[tuple[str, str], int]  # (status, model) -> jobs
    live: list[LiveJob]  # every live job, least recently updated first
    tokens_per_s: dict[str, float]  # model -> output tokens/s of its running jobs
    usage: UsageRow  # sums over every job in the store
    deliveries: dict[str, int]  # outbox status (pending, delivered, failed) -> deliveries
    oldest_pending_delivery_s: float  # 0 without a pending one
    attempts: dict[bool, int]  # answered with 2xx? -> attempts
    failed_by_code: dict[str, int]  # ended jobs' failed requests by their summary's code


def _age(then: datetime | None, now: datetime) -> float:
    if then is None:
        return 0.0
    then = then if then.tzinfo else then.replace(tzinfo=UTC)  # SQLite keeps naive UTC
    return max(0.0, (now - then).total_seconds())


class UsageRepository(Repository):
    def owner_usage(self, owner: str) -> dict[str, int]:
        """What `owner` holds now: live jobs, their requests (known totals) and the bytes of
        their files not deleted and their adapters."""
        with self._transaction(write=False) as connection:
            jobs, requests = connection.execute(
                select(func.count(), func.coalesce(func.sum(JOBS.c.total), 0))
                .where(JOBS.c.owner == owner, JOBS.c.status.in_(LIVE_STATUSES))
            ).one()
            stored = connection.execute(
                select(func.coalesce(func.sum(FILES.c.bytes), 0))
                .where(FILES.c.owner == owner, FILES.c.deleted_at.is_(None))
            ).scalar_one()
            adapters = connection.execute(
                select(func.coalesce(func.sum(ADAPTERS.c.bytes), 0)).where(ADAPTERS.c.owner == owner)
            ).scalar_one()
        return {"live_jobs": int(jobs), "requests_in_flight": int(requests), "file_bytes": int(stored) + int(adapters)}

    def usage(
        self, by: str | None = None, since: datetime | None = None, owner: str | None = None
    ) -> list[UsageRow]:
        """Usage summed over jobs (any status) created at or after `since`, of `owner` when
        given, by group, ordered by group. ``by``: None -> one row ``(all)`` (zeros when no job
        matches); ``owner``; ``model`` -> each model that answered (``_by_model``); ``label`` ->
        each ``key=value`` a job has (a job counts in each of its labels, one without in
        ``(none)``).

        GPU seconds of a job: its engine seconds x the ``gpus`` in its resources, 1 when it
        names none (what every shard is planned with; the device a shard ran on is not recorded).
        """
        if by is not None and by not in USAGE_GROUPINGS:
            raise ValueError(f"cannot group usage by {by!r}; use one of {', '.join(USAGE_GROUPINGS)} (or none)")
        require_aware(since=since)
        c = JOBS.c
        filters = matching(JOBS, owner=owner)
        if since is not None:
            filters.append(c.created_at >= since)
        gpus = func.coalesce(c.resources["gpus"].as_integer(), 1)
        measures = {  # UsageRow's field -> the jobs column it sums
            "requests_total": c.total, "requests_succeeded": c.succeeded, "requests_failed": c.failed,
            "prompt_tokens": c.prompt_tokens, "completion_tokens": c.completion_tokens,
            "cached_prompt_tokens": c.cached_prompt_tokens, "reasoning_tokens": c.reasoning_tokens,
            "cached_requests": c.result_cache_hits, "cached_tokens": c.result_cache_tokens,
            "invalid_output": c.invalid_output, "output_retries": c.output_retries, "retry_tokens": c.retry_tokens,
            "engine_seconds": c.engine_seconds, "gpu_seconds": c.engine_seconds * gpus,
        }
        names = list(measures)
        with self._transaction(write=False) as connection:
            if by in ("model", "label"):
                # JSON (labels, per-model usage): summed in Python over the streamed rows.
                keys = (c.model, c.model_usage) if by == "model" else (c.labels,)
                rows = connection.execution_options(yield_per=1000).execute(
                    select(*keys, *measures.values()).where(*filters))
                totals: dict[str, dict[str, float]] = {}
                for row in rows:
                    job = {name: value or 0 for name, value in zip(names, row[len(keys):], strict=True)}
                    if by == "model":
                        _by_model(totals, row[0], row[1], job)
                        continue
                    labels = row[0]
                    pairs = labels.items() if isinstance(labels, dict) else ()
                    for group in [f"{key}={value}" for key, value in pairs] or [USAGE_NO_LABELS_GROUP]:
                        _add(totals, group, job)
                return [_row(group, sums) for group, sums in sorted(totals.items())]
            query = select(func.count(), *(func.coalesce(func.sum(m), 0) for m in measures.values())).where(*filters)
            if by is None:
                jobs, *sums = connection.execute(query).one()
                return [_row(USAGE_ALL_GROUP, {"jobs": jobs, **dict(zip(names, sums, strict=True))})]
            key = c[by]
            rows = connection.execute(query.add_columns(key).group_by(key).order_by(key))
            return [_row(group, {"jobs": jobs, **dict(zip(names, sums, strict=True))}) for jobs, *sums, group in rows]


    def figures(self) -> StoreFigures:
        """The whole store's figures, read in one transaction for a metrics scrape."""
        now = datetime.now(UTC)
        c = JOBS.c
        with self._transaction(write=False) as connection:
            jobs = {(status, model): int(n) for status, model, n in connection.execute(
                select(c.status, c.model, func.count()).group_by(c.status, c.model))}
            still = [LiveJob(job_id, status, run_id, _age(updated, now)) for job_id, status, run_id, updated in
                     connection.execute(select(c.id, c.status, c.dag_run_id, c.updated_at)
                                        .where(c.status.in_(LIVE_STATUSES)).order_by(c.updated_at))]
            rates = {model: float(rate or 0) for model, rate in connection.execute(
                select(c.model, func.sum(c.tokens_per_s)).where(c.status == JobStatus.RUNNING.value).group_by(c.model))}
            deliveries = {status: int(n) for status, n in connection.execute(
                select(DELIVERIES.c.status, func.count()).group_by(DELIVERIES.c.status))}
            pending = connection.execute(select(func.min(DELIVERIES.c.created_at))
                                         .where(DELIVERIES.c.status == "pending")).scalar_one()
            ok = ATTEMPTS.c.status_code.between(200, 299)
            attempts = {bool(answered): int(n) for answered, n in connection.execute(
                select(func.coalesce(ok, False), func.count()).group_by(func.coalesce(ok, False)))}
            # Only ended jobs with failures have a summary (a scan of those rows, not of every job).
            failed_by_code: dict[str, int] = {}
            rows = connection.execution_options(yield_per=1000).execute(
                select(c.errors).where(c.status.in_(ENDED_STATUSES), c.failed > 0))
            for (summary,) in rows:
                for entry in summary if isinstance(summary, list) else ():
                    if isinstance(entry, dict) and isinstance(entry.get("count"), int):
                        code = str(entry.get("code"))
                        failed_by_code[code] = failed_by_code.get(code, 0) + entry["count"]
        return StoreFigures(jobs=jobs, live=still, tokens_per_s=rates, usage=self.usage()[0],
                            deliveries=deliveries, oldest_pending_delivery_s=_age(pending, now), attempts=attempts,
                            failed_by_code=failed_by_code)

_SECONDS = ("engine_seconds", "gpu_seconds")


def _row(group: Any, sums: dict[str, Any]) -> UsageRow:
    """A group's sums (``jobs`` and UsageRow's figures by name; missing ones are 0) as a row."""
    return UsageRow(str(group), **{name: (float if name in _SECONDS else int)(value or 0)
                                   for name, value in sums.items()})


def _add(totals: dict[str, dict[str, float]], group: str, figures: dict[str, float], job: bool = True) -> None:
    """Add one job's figures (UsageRow's fields by name) to a group, and the job itself unless
    `job` is False (the group already counted it)."""
    sums = totals.setdefault(group, {"jobs": 0})
    sums["jobs"] += 1 if job else 0
    for name, value in figures.items():
        sums[name] = sums.get(name, 0) + value


def _by_model(totals: dict[str, dict[str, float]], model: str, per_model: Any, job: dict[str, float]) -> None:
    """Add one job to the models that answered it: a job run on one model counts under it; a
    job whose lines ran on several (its base and LoRA adapters, ``model_usage``) counts in
    each: that model's succeeded requests and tokens exactly, its share of the engine and GPU
    seconds by its share of the job's tokens; the job's failed requests, and whatever no model
    claims, under the job's own model."""
    parts = per_model if isinstance(per_model, dict) and len(per_model) > 1 else {}
    used = {name: [int(u.get(k, 0)) for k in ("succeeded", "prompt_tokens", "completion_tokens")]
            for name, u in sorted(parts.items())}
    job_tokens = sum(p + q for _, p, q in used.values())
    left, rest = dict(job), 1.0  # what no model claims; the seconds' share left
    for name, (ok, p, q) in used.items():
        share = (p + q) / job_tokens if job_tokens else 0.0
        claimed = {"requests_total": ok, "requests_succeeded": ok, "prompt_tokens": p, "completion_tokens": q}
        _add(totals, name, {**claimed, **{k: job[k] * share for k in _SECONDS}})
        for field, value in claimed.items():
            left[field] -= value
        rest -= share
    left.update({k: job[k] * rest for k in _SECONDS})
    if not parts or any(left.values()):
        _add(totals, model, left, job=not parts or model not in parts)
