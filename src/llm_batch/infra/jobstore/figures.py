"""Operational figures of the whole store, read at once for a metrics scrape (``/batch/metrics``)."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime

from sqlalchemy import func, select

from llm_batch.core.jobs import JobStatus
from llm_batch.infra.jobstore.repository import ENDED_STATUSES, LIVE_STATUSES, Repository
from llm_batch.infra.jobstore.snapshots import UsageRow
from llm_batch.infra.jobstore.tables import ATTEMPTS, DELIVERIES, JOBS


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


class FiguresRepository(Repository):
    def figures(self) -> StoreFigures:
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
