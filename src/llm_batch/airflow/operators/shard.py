"""What the shard runners share: the shard's arguments, stop checks and outcome."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from typing import TYPE_CHECKING, Any

from sqlalchemy.exc import OperationalError
from tenacity import Retrying, retry_if_exception_type, stop_after_delay, wait_fixed

from llm_batch.core.config import Settings, get_settings
from llm_batch.infra.log_context import bind_job
from llm_batch.pipeline import steps
from llm_batch.pipeline.shard_task import ShardOutcome, ShardTask, interpret_exit, shard_stop_cause, try_report_shard

if TYPE_CHECKING:
    from llm_batch.infra.jobstore import JobStore

# How long a shard task starting while the job store is down (a PostgreSQL restart) waits
# for it instead of spending a retry.
STORE_WAIT_S = 60.0
STORE_RETRY_S = 2.0


def error_tail(lines: list[str], last: int = 5, chars: int = 600) -> str:
    """Why a worker failed, from its last output lines: the last error lines, else the last
    ``last`` lines, joined and bounded to ``chars``."""
    errors = [line for line in lines if "ERROR" in line or "Error" in line or "error:" in line]
    text = " | ".join(errors[-2:] or lines[-last:])
    return text if len(text) <= chars else "..." + text[-chars:]


def exit_code_of(pod: Any, container: str) -> int | None:
    """The exit code of the pod's `container` once it has exited: its state's, or its last
    state's once the kubelet restarted it (a group's StatefulSet pods restart on every exit)."""
    for status in (pod.status.container_statuses if pod is not None and pod.status else None) or []:
        if status.name == container:
            for state in (status.state, status.last_state):
                if state is not None and state.terminated is not None:
                    return state.terminated.exit_code
    return None


def shard_stop_of(task: ShardTask, settings: Settings) -> dict[str, Any]:
    """``watch_shard``'s argument (serializable, for a trigger)."""
    return {"job_id": task.job_id, "shard": task.shard, "progress_uri": task.progress_uri,
            "cancel_marker": task.cancel_marker, "deadline": task.deadline,
            "grace_seconds": settings.cancel_grace_seconds}


@dataclass(frozen=True)
class _ShardRef:
    """What try_report_shard reads of a ShardTask: a trigger carries only these."""
    job_id: str
    shard: int
    progress_uri: str


def watch_shard(shard_stop: dict[str, Any]) -> str | None:
    """One round of a shard's stop watch (blocking): report the shard's progress, mirror a
    cancel to the marker, and return the stop cause if any. Reads the job store of the
    caller's own settings (a triggerer's LLM_BATCH_DATABASE_URL)."""
    from llm_batch.infra.jobstore import get_job_store  # heavy

    store = get_job_store(get_settings().database_url)
    if shard_stop.get("progress_uri") is not None:  # a trigger serialized before they were added has none
        try_report_shard(store, _ShardRef(shard_stop["job_id"], int(shard_stop["shard"]), shard_stop["progress_uri"]))
    return shard_stop_cause(store, shard_stop["job_id"], shard_stop["cancel_marker"],
                            datetime.fromisoformat(shard_stop["deadline"]))


class ShardTaskMixin:
    """For an operator with a ``shard_task`` dict: a ``steps.shard_ref``, or a whole ShardTask."""

    shard_task: dict[str, Any]

    @cached_property
    def shard(self) -> ShardTask:
        return steps.shard_task(self.shard_task, self.llm_settings)

    @cached_property
    def llm_settings(self) -> Settings:
        return get_settings()

    def use_settings(self, settings: Settings | None) -> None:
        """Run on ``settings``; None: ``get_settings()``, read when first needed."""
        if settings is not None:
            self.llm_settings = settings

    @cached_property
    def job_store(self) -> JobStore:
        from llm_batch.infra.jobstore import get_job_store  # heavy

        return get_job_store(self.llm_settings.database_url)

    def stop_cause(self) -> str | None:
        """"cancelled" or "deadline" when the shard must stop (the cancel flag mirrored to
        the marker on the way), else None."""
        task = self.shard
        return shard_stop_cause(self.job_store, task.job_id, task.cancel_marker, task.deadline_at)

    def ended_before_start(self, context: Any) -> dict[str, Any] | None:
        """Bind the job's id to the task's logs; the outcome dict of a shard that must not
        start (reported), else None."""
        bind_job(self.shard.job_id)
        early = self.stop_before_start()
        return None if early is None else self.report_outcome(early, context).model_dump()

    def stop_before_start(self) -> ShardOutcome | None:
        """The outcome of a shard whose job has ended already ("ended": a cleared task of a
        finished run never runs inference again), is cancelled or is past its deadline."""
        job = self._job_waiting_for_the_store()
        if job is not None and job.terminal:
            message = (f"job {job.id} has already ended ({job.status.value}): not starting a worker, "
                       "its results stay as they are")
            self.log.info("shard %s: %s", self.shard.shard, message)  # type: ignore[attr-defined]
            return self._unstarted("ended", message)
        cause = self.stop_cause()
        return None if cause is None else self._unstarted(cause, f"not started: {cause}")

    def _unstarted(self, state: str, message: str) -> ShardOutcome:
        return ShardOutcome(shard=self.shard.shard, exit_code=-1, state=state, message=message)

    def _job_waiting_for_the_store(self):
        waiting = Retrying(retry=retry_if_exception_type(OperationalError), stop=stop_after_delay(STORE_WAIT_S),
                           wait=wait_fixed(STORE_RETRY_S), reraise=True)
        return waiting(self.job_store.get_job, self.shard.job_id)

    def report_outcome(self, outcome: ShardOutcome, context: Any = None) -> ShardOutcome:
        """Record how this attempt ended in the shard's row (merge's reason for requests never
        run), a failure naming its attempt; an "ended" shard leaves the row as it was."""
        if outcome.state == "ended":
            return outcome
        ti = (context or {}).get("ti")
        if outcome.state == "usage":
            outcome = outcome.model_copy(update={"message": f"{outcome.message}; not retried"})
        elif outcome.state == "failed" and ti is not None:
            attempts = int(getattr(self, "retries", 0) or 0) + 1
            outcome = outcome.model_copy(update={"message": f"{outcome.message} on attempt {ti.try_number} of {attempts}"})
        try_report_shard(self.job_store, self.shard, outcome)
        return outcome

    def refuse(self, message: str, context: Any) -> dict[str, Any]:
        """Fail the task for good on a usage error, no worker started."""
        return self.finish(self._unstarted("usage", message), context)

    def finish(self, outcome: ShardOutcome, context: Any = None) -> dict[str, Any]:
        """End the task with an outcome, recorded and logged: a usage error fails it for good,
        a failure raises for a retry, else the outcome dict."""
        from airflow.sdk.exceptions import AirflowException, AirflowFailException  # airflow

        outcome = self.report_outcome(outcome, context)
        self.log.info("shard %s: %s (%s)", outcome.shard, outcome.state, outcome.message)  # type: ignore[attr-defined]
        if outcome.state == "usage":
            raise AirflowFailException(outcome.message)
        if outcome.state == "failed":
            raise AirflowException(outcome.message)
        return outcome.model_dump()

    def outcome(self, exit_code: int | None, forced: str | None) -> ShardOutcome:
        """The outcome of a finished worker; ``forced`` is the cause when it was killed."""
        if forced is not None:
            grace = self.llm_settings.cancel_grace_seconds
            return ShardOutcome(shard=self.shard.shard, exit_code=exit_code if exit_code is not None else -9,
                                state=forced, message=f"killed: still running {grace}s after the stop ({forced})")
        return interpret_exit(self.shard.shard, exit_code if exit_code is not None else -1)
