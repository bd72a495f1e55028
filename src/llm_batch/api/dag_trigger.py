"""The one place that touches a ``batch_inference`` run through Airflow's internals (its
``trigger_dag`` is not a public interface): it starts a job's run, committed before the API
answers, and re-prioritises the run's tasks that have not started yet.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Annotated, Any

from airflow.api_fastapi.common.db.common import SessionDep
from airflow.exceptions import DagRunAlreadyExists
from airflow.utils.state import TaskInstanceState
from airflow.utils.types import DagRunTriggeredByType
from fastapi import Depends
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.orm import Session
from tenacity import Retrying, retry_if_exception_type, stop_after_attempt, wait_random_exponential

from llm_batch.api.auth import CallerDep
from llm_batch.api.state import DAG_ID
from llm_batch.core import strict_json
from llm_batch.core.run_conf import api_run_id

TRIGGER_ATTEMPTS = 8
# Airflow keeps (dag_id, logical_date) unique: a job made in the same microsecond as another
# takes the next free microsecond (its place in the queue is the same).
LOGICAL_DATE_TRIES = 50

# (job_id, conf, submitted_at) -> run id; raises TriggerError.
Trigger = Callable[[str, dict[str, Any], datetime], str]


class TriggerError(RuntimeError):
    """The run could not be started; the message says why (it becomes the job's reason)."""


run_id_for = api_run_id  # deterministic: see run_conf.api_run_id


def _trigger_once(job_id: str, conf: dict[str, Any], submitted_at: datetime, user_name: str, session: Session) -> str:
    from airflow.api.common.trigger_dag import trigger_dag  # airflow

    for shift in range(LOGICAL_DATE_TRIES):
        try:
            dag_run = trigger_dag(
                DAG_ID,
                run_id=run_id_for(job_id),
                conf=conf,
                logical_date=submitted_at + timedelta(microseconds=shift),
                replace_microseconds=False,
                triggered_by=DagRunTriggeredByType.REST_API,
                triggering_user_name=user_name,
                session=session,
            )
            session.commit()
        except DagRunAlreadyExists:
            session.rollback()
            return run_id_for(job_id)
        except IntegrityError as exc:
            session.rollback()
            if "logical_date" not in str(exc):
                raise
            continue  # another run has this instant: the next microsecond
        except Exception:
            session.rollback()
            raise
        if dag_run is None:
            raise TriggerError(f"DAG {DAG_ID!r} did not create a run")
        return dag_run.run_id
    raise TriggerError(f"no free logical date within {LOGICAL_DATE_TRIES} microseconds of {submitted_at.isoformat()}")


def trigger_batch_dag(job_id: str, conf: dict[str, Any], submitted_at: datetime, user_name: str, session: Session) -> str:
    """Start the run of `job_id`; returns the run id or raises TriggerError. Its logical date
    is the submission time, so jobs of one priority start in the order they were submitted; a
    busy metadata DB is retried."""
    # Airflow's scheduler stops on a conf it cannot serialise.
    if (problem := strict_json.problem(conf)) is not None:
        raise TriggerError(f"the run's conf is not strict JSON: {problem}")
    retrying = Retrying(retry=retry_if_exception_type(OperationalError), stop=stop_after_attempt(TRIGGER_ATTEMPTS),
                        wait=wait_random_exponential(multiplier=0.05, max=2), reraise=True)
    try:
        return retrying(_trigger_once, job_id, conf, submitted_at, user_name, session)
    except TriggerError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure must end as the job's reason
        raise TriggerError(f"could not start DAG {DAG_ID!r}: {type(exc).__name__}: {exc}") from exc


def reprioritize_waiting_tasks(job_id: str, weight: int, session: Session) -> int:
    """Give the run's tasks not yet started, and its conf (read by shard tasks made later), the
    priority `weight`; returns how many tasks changed."""
    from airflow.models.dagrun import DagRun  # airflow
    from airflow.models.taskinstance import TaskInstance  # airflow

    run = session.query(DagRun).filter(DagRun.dag_id == DAG_ID, DagRun.run_id == run_id_for(job_id)).one_or_none()
    if run is not None:
        run.conf = {**(run.conf or {}), "priority": weight}

    waiting = [TaskInstanceState.SCHEDULED, TaskInstanceState.QUEUED, TaskInstanceState.UP_FOR_RETRY]
    changed = (
        session.query(TaskInstance)
        .filter(TaskInstance.dag_id == DAG_ID, TaskInstance.run_id == run_id_for(job_id))
        .filter((TaskInstance.state.is_(None)) | (TaskInstance.state.in_(waiting)))
        .update({TaskInstance.priority_weight: weight}, synchronize_session=False)
    )
    session.commit()
    return changed


def get_trigger(caller: CallerDep, session: SessionDep) -> Trigger:
    """This request's trigger: runs start as the caller, in the request's metadata-DB session."""
    return lambda job_id, conf, submitted_at: trigger_batch_dag(job_id, conf, submitted_at, caller.name, session)


TriggerDep = Annotated[Trigger, Depends(get_trigger)]
