"""Estimates: a job's stored estimate, the tokens/s this deployment measured for a model
from its ended jobs, and the live jobs a new job would queue behind
(``llm_batch.pipeline.estimate`` does the arithmetic)."""

from __future__ import annotations

import dataclasses
from datetime import datetime
from typing import Any

from sqlalchemy import select

from llm_batch.infra.jobstore.models import JOBS
from llm_batch.infra.jobstore.repository import ENDED_STATUSES, LIVE_STATUSES, Repository

# How many of a model's newest ended jobs its measured rate is taken over: recent enough to
# follow a change of hardware or settings, enough jobs to smooth one odd run out.
RATE_JOBS = 20


@dataclasses.dataclass(frozen=True)
class MeasuredRate:
    """What a model's ended jobs took: tokens (prompt + completion) over engine seconds, and
    the median of what each took beyond its engine time once running (``overhead_seconds``:
    the engine's start when it was cold, scheduling, the merge)."""

    model: str
    jobs: int
    tokens: int
    engine_seconds: float
    overhead_seconds: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.engine_seconds


@dataclasses.dataclass(frozen=True)
class LiveWork:
    """A live job as a queue estimate sees it: its lane (priority, GPU type), when it was
    made, its stored estimate (None until its input is validated) and its engine seconds so far."""

    id: str
    priority: int
    gpu_type: str | None
    created_at: datetime
    estimate: dict[str, Any] | None
    engine_seconds: float


class EstimatesRepository(Repository):
    def set_estimate(self, job_id: str, estimate: dict[str, Any]) -> None:
        self._update_job(job_id, estimate=estimate)

    def measured_rate(self, model: str, last: int = RATE_JOBS) -> MeasuredRate | None:
        """The tokens/s of `model` over its `last` newest ended jobs that ran an engine
        (engine seconds and tokens above 0; cancelled and timed-out jobs count for what they
        ran); None when it has none."""
        c = JOBS.c
        query = (select(c.prompt_tokens, c.completion_tokens, c.engine_seconds, c.in_progress_at, c.completed_at,
                        c.data_parallelism)
                 .where(c.model == model, c.status.in_(ENDED_STATUSES), c.engine_seconds > 0,
                        c.prompt_tokens + c.completion_tokens > 0)
                 .order_by(c.completed_at.desc(), c.id).limit(last))
        with self._transaction(write=False) as connection:
            rows = connection.execute(query).all()
        if not rows:
            return None
        overheads = sorted(
            max(0.0, (row.completed_at - row.in_progress_at).total_seconds()
                - row.engine_seconds / max(1, row.data_parallelism or 1))
            for row in rows if row.in_progress_at is not None and row.completed_at is not None)
        return MeasuredRate(model, len(rows), sum(int(row.prompt_tokens) + int(row.completion_tokens) for row in rows),
                            sum(float(row.engine_seconds) for row in rows),
                            overheads[len(overheads) // 2] if overheads else 0.0)

    def live_work(self) -> list[LiveWork]:
        """Every live job, oldest first (few: jobs that have not ended)."""
        c = JOBS.c
        query = (select(c.id, c.priority, c.resources, c.created_at, c.estimate, c.engine_seconds)
                 .where(c.status.in_(LIVE_STATUSES)).order_by(c.created_at, c.id))
        with self._transaction(write=False) as connection:
            rows = connection.execute(query).all()
        return [LiveWork(job_id, int(priority or 0), (resources or {}).get("gpu_type"), created,
                         estimate if isinstance(estimate, dict) else None, float(seconds or 0))
                for job_id, priority, resources, created, estimate, seconds in rows]
