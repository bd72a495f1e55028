"""Where a job's run waits in Airflow's queue, and taking a cancelled job's shards out of it.
``queue_places`` orders by the scheduler's own columns, in its order
(``SchedulerJobRunner._executable_task_instances_to_queued``), so a place is the one it follows."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

from airflow.utils.state import DagRunState, TaskInstanceState
from sqlalchemy import Select, case, func, select
from sqlalchemy.orm import Session

from llm_batch.api.state import DAG_ID
from llm_batch.core.run_conf import SHARD_TASK_ID

# A run with a task in one of these is under way: it has no place in a queue.
_UNDER_WAY = (TaskInstanceState.QUEUED, TaskInstanceState.RUNNING, TaskInstanceState.DEFERRED,
              TaskInstanceState.RESTARTING, TaskInstanceState.UP_FOR_RESCHEDULE)
# What holds a pool's slot (deferred too only in a pool that counts it; the stack's do not).
_IN_SLOT = (TaskInstanceState.QUEUED, TaskInstanceState.RUNNING)
_NOT_STARTED = (TaskInstanceState.SCHEDULED, TaskInstanceState.UP_FOR_RETRY)


@dataclass(frozen=True)
class QueuePlace:
    """A waiting run's place: ``position`` 1 starts next."""

    position: int
    pool: str | None  # None: the run waits to start at all (the DAG's active runs)
    waiting_for: str


def queue_places(run_ids: list[str], session: Session) -> dict[str, QueuePlace]:
    """The place of each of ``run_ids`` that waits (a run with a task under way has none), in a
    few queries whatever their number."""
    from airflow.models.dag import DagModel  # airflow
    from airflow.models.dagrun import DagRun  # airflow
    from airflow.models.pool import Pool  # airflow
    from airflow.models.taskinstance import TaskInstance as TI  # airflow

    wanted = {r for r in run_ids if r}
    if not wanted:
        return {}
    runs = {r.run_id: r for r in session.scalars(
        select(DagRun).where(DagRun.dag_id == DAG_ID, DagRun.run_id.in_(wanted)))}
    places: dict[str, QueuePlace] = {}

    if any(r.state == DagRunState.QUEUED for r in runs.values()):
        # The line as this read sees it (a run started since the read above has left it).
        line = list(session.scalars(select(DagRun.run_id).where(
            DagRun.dag_id == DAG_ID, DagRun.state == DagRunState.QUEUED).order_by(DagRun.run_after, DagRun.id)))
        most = session.scalar(select(DagModel.max_active_runs).where(DagModel.dag_id == DAG_ID))
        what = f"a run slot of DAG {DAG_ID} ({most} of its runs run at once)" if most else f"a run slot of DAG {DAG_ID}"
        # Behind every started run still waiting for a pool's slot: no two jobs at one place.
        ahead = session.scalar(_waiting_in_pools(func.count(func.distinct(TI.run_id)))) or 0
        for position, run_id in enumerate(line, start=1 + ahead):
            if run_id in wanted:
                places[run_id] = QueuePlace(position, None, what)

    running = [r for r in runs.values() if r.state == DagRunState.RUNNING]
    if not running:
        return places
    ours = session.execute(select(TI.run_id, TI.state).where(
        TI.dag_id == DAG_ID, TI.run_id.in_([r.run_id for r in running]))).all()
    under_way = {run_id for run_id, state in ours if state in _UNDER_WAY}
    waiting = {run_id for run_id, state in ours if state == TaskInstanceState.SCHEDULED} - under_way
    if not waiting:
        return places
    # The whole line of every pool our runs wait in: every DAG's scheduled tasks, in the scheduler's order.
    pools = set(session.scalars(select(TI.pool).where(
        TI.dag_id == DAG_ID, TI.run_id.in_(waiting), TI.state == TaskInstanceState.SCHEDULED)))
    line = session.execute(
        select(TI.pool, TI.dag_id, TI.run_id)
        .join(DagRun, (DagRun.dag_id == TI.dag_id) & (DagRun.run_id == TI.run_id))
        .where(TI.pool.in_(pools), TI.state == TaskInstanceState.SCHEDULED)
        .order_by(TI.pool, TI.priority_weight.desc(), DagRun.logical_date, TI.map_index)
    ).all()
    # pool -> {(dag_id, run_id): 0-based place}, a run placed where its first task stands.
    places_in: dict[str, dict[tuple[str, str], int]] = defaultdict(dict)
    for pool, dag_id, run_id in line:
        places_in[pool].setdefault((dag_id, run_id), len(places_in[pool]))
    first_pool: dict[str, str] = {}  # where the run stands nearest the front
    for run_id in waiting:
        standing = [(where[(DAG_ID, run_id)], pool) for pool, where in places_in.items() if (DAG_ID, run_id) in where]
        if standing:
            first_pool[run_id] = min(standing)[1]
    slots = dict(session.execute(select(Pool.pool, Pool.slots).where(Pool.pool.in_(pools))).all())
    used: dict[str, int] = defaultdict(int)
    for pool, n in session.execute(select(TI.pool, TI.pool_slots).where(TI.pool.in_(pools), TI.state.in_(_IN_SLOT))):
        used[pool] += n or 1
    for run_id, pool in first_pool.items():
        total = slots.get(pool)
        size = "unknown size" if total is None else f"{used[pool]} of {total} in use"
        places[run_id] = QueuePlace(places_in[pool][(DAG_ID, run_id)] + 1, pool, f"a slot of pool {pool} ({size})")
    return places


@dataclass(frozen=True)
class QueueDepths:
    """What waits, for metrics: per pool (``(run)``: runs waiting to start) the waiting jobs and
    the age of the oldest; shard tries; seconds since the scheduler's newest heartbeat."""

    pools: dict[str, tuple[int, float]]
    shard_tries: int
    shard_retries: int
    scheduler_heartbeat_age_s: float


def queue_depths(session: Session, now: datetime) -> QueueDepths:
    from airflow.jobs.job import Job as AirflowJob  # airflow
    from airflow.models.dagrun import DagRun  # airflow
    from airflow.models.pool import Pool  # airflow
    from airflow.models.taskinstance import TaskInstance as TI  # airflow

    def age(then: datetime | None) -> float:
        return max(0.0, (now - then).total_seconds()) if then else 0.0

    # Every pool reads 0 while nothing waits in it (a series that comes and goes is hard to alert on).
    pools: dict[str, tuple[int, float]] = {name: (0, 0.0) for name in session.scalars(select(Pool.pool))}
    queued = session.execute(select(func.count(), func.min(DagRun.logical_date)).where(
        DagRun.dag_id == DAG_ID, DagRun.state == DagRunState.QUEUED)).one()
    pools["(run)"] = (int(queued[0]), age(queued[1]))
    rows = session.execute(_waiting_in_pools(TI.pool, func.count(func.distinct(TI.run_id)),
                                             func.min(DagRun.logical_date)).group_by(TI.pool)).all()
    for pool, jobs, oldest in rows:
        pools[pool] = (int(jobs), age(oldest))
    tries, retries = session.execute(
        select(func.coalesce(func.sum(TI.try_number), 0),
               func.coalesce(func.sum(case((TI.try_number > 1, TI.try_number - 1), else_=0)), 0))
        .where(TI.dag_id == DAG_ID, TI.task_id == SHARD_TASK_ID)).one()
    beat = session.scalar(select(func.max(AirflowJob.latest_heartbeat)).where(
        AirflowJob.job_type == "SchedulerJob", AirflowJob.state == "running"))
    return QueueDepths(pools, int(tries), int(retries), age(beat) if beat else float("inf"))


def _waiting_in_pools(*columns: Any) -> Select:
    """``columns`` over the scheduled tasks of running batch runs nothing of which is under way."""
    from airflow.models.dagrun import DagRun  # airflow
    from airflow.models.taskinstance import TaskInstance as TI  # airflow

    started = select(TI.run_id).where(TI.dag_id == DAG_ID, TI.state.in_(_UNDER_WAY))
    return (select(*columns).join(DagRun, (DagRun.dag_id == TI.dag_id) & (DagRun.run_id == TI.run_id))
            .where(TI.dag_id == DAG_ID, TI.state == TaskInstanceState.SCHEDULED, DagRun.state == DagRunState.RUNNING,
                   TI.run_id.not_in(started)))


class _JobOfRun(Protocol):
    id: str
    dag_run_id: str | None
    terminal: bool


def job_places(jobs: Sequence[_JobOfRun], session: Session) -> dict[str, QueuePlace]:
    """The place of each live job of `jobs` that waits, by job id."""
    live = {job.dag_run_id: job.id for job in jobs if not job.terminal and job.dag_run_id}
    return {live[run_id]: place for run_id, place in queue_places(list(live), session).items()}


def skip_waiting_shards(run_id: str | None, session: Session) -> int:
    """Mark the run's shard tasks that have not started skipped, so a cancelled job's finalize
    (``all_done``) runs at once; a shard queued meanwhile runs and stops on the cancel marker."""
    from airflow.models.taskinstance import TaskInstance as TI  # airflow

    if not run_id:
        return 0
    now = datetime.now(UTC)
    skipped = (
        session.query(TI)
        .filter(TI.dag_id == DAG_ID, TI.run_id == run_id, TI.task_id == SHARD_TASK_ID, TI.map_index >= 0)
        .filter(TI.state.is_(None) | TI.state.in_(_NOT_STARTED))
        .update({TI.state: TaskInstanceState.SKIPPED, TI.start_date: now, TI.end_date: now, TI.duration: 0},
                synchronize_session=False)
    )
    session.commit()
    return skipped
