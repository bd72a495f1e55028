"""Shard progress and progress history: each shard's reports (the ``shard_progress`` table),
the job's live counts summed from them, and a point of those counts every few seconds (the
``progress_history`` table, the UI's plots).
"""

from __future__ import annotations

import dataclasses
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, Row, and_, case, delete, func, insert, select, update

from llm_batch.core.jobs import JobStatus
from llm_batch.core.snapshots import Job, ShardRecord
from llm_batch.infra.jobstore.errors import JobNotFound
from llm_batch.infra.jobstore.models import HISTORY, JOBS, SHARDS
from llm_batch.infra.jobstore.paging import owned
from llm_batch.infra.jobstore.repository import Repository, from_row, job_snapshot, require_non_negative, upsert, utcnow

HISTORY_INTERVAL_S = 5.0
MAX_HISTORY_POINTS = 500
# A shard row's counters: each only moves up (a stale report cannot lower it).
_SHARD_COUNTERS = ("total", "done", "succeeded", "failed", "prompt_tokens", "completion_tokens",
                   "cached_prompt_tokens", "engine_seconds")
_LIVE_SHARD_STATES = ("starting", "running")


@dataclasses.dataclass(frozen=True, slots=True)
class ProgressPoint:
    """A job's live counts and tokens/s at one instant (a progress_history row)."""

    job_id: str
    at: datetime
    total: int
    completed: int
    succeeded: int
    failed: int
    completion_tokens: int
    tokens_per_s: float


def _live_from_rows(job: Row, sums: Row) -> dict[str, Any]:
    """The job's live counts and usage from the sum of its shard rows on top of its invalid
    lines, never lower than it shows. The three counts move together, and only when none
    goes down (so succeeded + failed == completed at every moment)."""
    counts = {"completed": job.invalid + sums.done, "succeeded": sums.succeeded, "failed": job.invalid + sums.failed}
    values: dict[str, Any] = counts if all(counts[k] >= job._mapping[k] for k in counts) else {}
    for name in ("prompt_tokens", "completion_tokens", "cached_prompt_tokens", "engine_seconds"):
        values[name] = max(job._mapping[name] or 0, sums._mapping[name])
    values["tokens_per_s"] = round(float(sums.tokens_per_s), 1)
    return values


def _thinned_out(instants: list[datetime], keep: int) -> list[datetime]:
    """The instants to drop so that about `keep` remain, evenly spaced over the whole span
    (the first and last stay; older points, already sparse, stay; dense recent ones go)."""
    if len(instants) <= 2 or keep < 2:
        return []
    step = (instants[-1] - instants[0]) / keep
    kept = instants[0]
    dropped = []
    for instant in instants[1:-1]:
        if instant - kept >= step and instants[-1] - instant >= step / 2:
            kept = instant
        else:
            dropped.append(instant)
    return dropped


class ProgressRepository(Repository):
    history_interval_s: float = HISTORY_INTERVAL_S
    max_history_points: int = MAX_HISTORY_POINTS

    def report_shard(
        self, job_id: str, shard: int, *, state: str, total: int = 0, done: int = 0, succeeded: int = 0,
        failed: int = 0, prompt_tokens: int = 0, completion_tokens: int = 0, cached_prompt_tokens: int = 0,
        engine_seconds: float = 0.0, reason: str | None = None,
    ) -> Job:
        """Record one shard's progress (with `reason`: its task's outcome) in its row, then set
        the job's live counts and usage from the sum of its rows, in one transaction.

        The job row is locked first (``FOR UPDATE``; SQLite's write lock), so one job's reports
        are serialized and every sum sees the rows the others committed. An ended job is
        returned as it ended (its counts are the merge's, final).
        """
        given = dict(total=total, done=done, succeeded=succeeded, failed=failed, prompt_tokens=prompt_tokens,
                     completion_tokens=completion_tokens, cached_prompt_tokens=cached_prompt_tokens,
                     engine_seconds=engine_seconds)
        require_non_negative(given)
        with self._transaction(write=True) as connection:
            job = connection.execute(select(JOBS).where(JOBS.c.id == job_id).with_for_update()).one_or_none()
            if job is None:
                raise JobNotFound(f"no job {job_id!r}")
            if JobStatus(job.status).terminal:
                return job_snapshot(job)
            now = utcnow()
            report = upsert(connection, SHARDS).values(job_id=job_id, shard=shard, state=state, reason=reason,
                                                       updated_at=now, **given)
            new = report.excluded
            connection.execute(report.on_conflict_do_update(
                index_elements=[SHARDS.c.job_id, SHARDS.c.shard],
                set_={**{name: case((SHARDS.c[name] < new[name], new[name]), else_=SHARDS.c[name])
                         for name in _SHARD_COUNTERS},
                      "state": new.state, "reason": new.reason, "updated_at": new.updated_at},
            ))
            c = SHARDS.c
            # Output tokens per engine second of each shard still running, summed.
            rate = case((and_(c.state.in_(_LIVE_SHARD_STATES), c.engine_seconds > 0),
                         c.completion_tokens / c.engine_seconds), else_=0.0)
            sums = connection.execute(
                select(*(func.coalesce(func.sum(c[name]), 0).label(name) for name in _SHARD_COUNTERS),
                       func.coalesce(func.sum(rate), 0).label("tokens_per_s"))
                .where(c.job_id == job_id)
            ).one()
            updated = connection.execute(
                update(JOBS).where(JOBS.c.id == job_id).values(**_live_from_rows(job, sums), updated_at=now)
                .returning(*JOBS.c)
            ).one()
            self._append_history(connection, updated, now)
            return job_snapshot(updated)

    def _append_history(self, connection: Connection, job: Row, now: datetime) -> None:
        """A history point of `job` (under report_shard's lock of the job) unless its last is
        younger than ``history_interval_s``; above ``max_history_points`` the series is thinned
        to about half that evenly over the whole run, so a long job keeps an even picture."""
        h = HISTORY.c
        last = connection.execute(select(h.at).where(h.job_id == job.id).order_by(h.at.desc()).limit(1)).scalar()
        if last is not None and (last >= now or now - last < timedelta(seconds=self.history_interval_s)):
            return
        connection.execute(insert(HISTORY).values(
            job_id=job.id, at=now, total=job.total, completed=job.completed, succeeded=job.succeeded,
            failed=job.failed, completion_tokens=job.completion_tokens, tokens_per_s=job.tokens_per_s))
        count = connection.execute(select(func.count()).where(h.job_id == job.id)).scalar_one()
        if count > self.max_history_points:
            instants = connection.execute(select(h.at).where(h.job_id == job.id).order_by(h.at)).scalars().all()
            dropped = _thinned_out(instants, self.max_history_points // 2)
            connection.execute(delete(HISTORY).where(h.job_id == job.id, h.at.in_(dropped)))

    def progress_history(self, job_id: str, owner: str | None = None) -> list[ProgressPoint]:
        """The job's progress history, oldest first (empty for an unknown or not-owned job,
        or one no shard reported on yet)."""
        with self._transaction(write=False) as connection:
            if connection.execute(select(JOBS.c.id).where(*owned(JOBS, job_id, owner))).one_or_none() is None:
                return []
            rows = connection.execute(select(HISTORY).where(HISTORY.c.job_id == job_id).order_by(HISTORY.c.at))
            return list(map(from_row(ProgressPoint), rows))

    def shard_records(self, job_id: str) -> list[ShardRecord]:
        """The job's shard rows, by shard index (empty before any shard reported)."""
        query = select(SHARDS).where(SHARDS.c.job_id == job_id).order_by(SHARDS.c.shard)
        return self._read_all(query, from_row(ShardRecord))
