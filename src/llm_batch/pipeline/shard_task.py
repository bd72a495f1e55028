"""The contract between the DAG and a shard's worker: what a shard runner is given (a ShardTask),
how a worker's exit reads (a ShardOutcome), and what runners do while a worker runs. Both shard
runners use only this module, so they behave the same; no Airflow here."""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import TYPE_CHECKING

import orjson
from pydantic import BaseModel, Field

from llm_batch.core import exit_codes
from llm_batch.infra import storage
from llm_batch.infra.progress import read_progress

if TYPE_CHECKING:  # the store pulls in SQLAlchemy: DAG files must parse without it
    from llm_batch.infra.jobstore import Job, JobRepository, JobStore, ProgressRepository

log = logging.getLogger("llm_batch.pipeline.shard_task")


class ShardTask(BaseModel):
    """Everything a shard runner needs for one shard: the arguments both operators take."""

    job_id: str
    shard: int
    requests_uri: str
    results_uri: str
    progress_uri: str
    cancel_marker: str
    endpoint: str
    model_config_json: str  # the worker's --model-config
    deadline: str  # ISO 8601 UTC: workers stop there
    options_json: str = "{}"  # the job's options the worker reads (core.job_spec.JobOptions), JSON
    cache_salt: str | None = None  # the owner's prefix-cache namespace (core.owners.cache_salt)
    gpus: int = 1
    gpu_type: str | None = None
    nodes_per_worker: int = 1
    priority: str = "normal"
    labels: dict[str, str] = Field(default_factory=dict)
    requests: int | None = None  # how many the shard holds (None: planned before it was counted)
    lora: bool = False  # its lines name adapters: its engine has LoRA on (a warm engine of its own)

    def worker_args(self) -> list[str]:
        """`llm-batch worker ...` arguments (after the program name)."""
        return [
            "worker",
            "--job-id", self.job_id,
            "--shard", str(self.shard),
            "--requests", self.requests_uri,
            "--results", self.results_uri,
            "--progress", self.progress_uri,
            "--endpoint", self.endpoint,
            "--model-config", self.model_config_json,
            "--deadline", str(self.deadline_at.timestamp()),
            "--cancel-marker", self.cancel_marker,
            "--options", self.options_json,
            *(["--cache-salt", self.cache_salt] if self.cache_salt else []),
        ]  # fmt: skip

    @property
    def deadline_at(self) -> datetime:
        return datetime.fromisoformat(self.deadline)


class ShardOutcome(BaseModel):
    """How a shard attempt ended, from the worker's exit status."""

    shard: int
    exit_code: int
    state: str  # done | cancelled | deadline | failed | usage
    message: str


_EXIT_STATES = {
    exit_codes.DONE: ("done", "all requests of the shard have results"),
    exit_codes.CANCELLED: ("cancelled", "stopped: the job was cancelled"),
    exit_codes.DEADLINE: ("deadline", "stopped: the job's deadline passed"),
    exit_codes.USAGE: ("usage", "the worker refused its arguments or configuration"),
}


def interpret_exit(shard: int, exit_code: int) -> ShardOutcome:
    """The outcome of a worker exit. "done", "cancelled" and "deadline" end the shard task
    well (merge reports unfinished requests); "failed" should be retried (the worker
    resumes); "usage" will fail again, so retrying is pointless."""
    state, message = _EXIT_STATES.get(
        exit_code, ("failed", f"the worker failed (exit status {exit_code}); a retry resumes")
    )
    return ShardOutcome(shard=shard, exit_code=exit_code, state=state, message=message)


def write_cancel_marker(cancel_marker: str, job: Job) -> None:
    """Drop the marker the job's workers watch (they read it, not the database); a marker
    already there is left as it is. Raises storage.StorageError if it cannot be written."""
    if not storage.exists(cancel_marker):
        storage.write_bytes(cancel_marker, orjson.dumps({"cancel_requested_at": str(job.cancel_requested_at)}))


def mirror_cancel(store: JobRepository, job_id: str, cancel_marker: str) -> bool:
    """If the job's cancel flag is set, make sure its cancel marker exists. True when
    cancel was requested."""
    job = store.get_job(job_id)
    if job is None or not job.cancel_requested:
        return False
    write_cancel_marker(cancel_marker, job)
    return True


def shard_stop_cause(store: JobStore, job_id: str, cancel_marker: str, deadline: datetime) -> str | None:
    """"cancelled" or "deadline" when a job's shard must stop (mirroring the cancel flag to
    the marker on the way), else None. Both shard runners ask this while a worker runs."""
    try:
        if mirror_cancel(store, job_id, cancel_marker):
            return "cancelled"
    except Exception as exc:  # noqa: BLE001 - the store or storage down for a moment (a restart): asked again next round
        log.warning("could not check whether job %s was cancelled (asked again next round): %s", job_id, exc)
    if datetime.now(UTC) >= deadline:
        return "deadline"
    return None


def try_report_shard(store: JobStore, task: ShardTask, outcome: ShardOutcome | None = None) -> None:
    """``report_shard`` for the runners' watch loops: live counts are advisory, so a
    failure is logged and never fails the shard."""
    try:
        report_shard(store, task, outcome)
    except Exception as exc:  # noqa: BLE001
        log.warning("could not report shard %d of job %s: %s", task.shard, task.job_id, exc)


def report_shard(store: ProgressRepository, task: ShardTask, outcome: ShardOutcome | None = None) -> Job | None:
    """Record this shard's own progress object (one storage read, whatever the number of shards)
    in its row, whose sum is the job's live counts; with `outcome` (the task's end) also the
    state and why, which merge reads. None: nothing to report yet."""
    try:
        figures = read_progress(task.progress_uri).model_dump(
            include={"total", "done", "succeeded", "failed", "prompt_tokens", "completion_tokens",
                     "cached_prompt_tokens", "engine_seconds", "state"})
    except (storage.StorageError, ValueError):
        if outcome is None:
            return None
        figures = {}
    if outcome is not None:
        figures |= {"state": outcome.state, "reason": outcome.message}
    return store.report_shard(task.job_id, task.shard, **{**figures, "state": str(figures["state"])})


def shard_not_run_reasons(store: ProgressRepository, job_id: str) -> dict[int, str]:
    """Why each shard that did not finish stopped, from its recorded outcome: what merge
    writes on the requests it never ran (e.g. "shard 3: the worker failed (exit status 1)
    on attempt 3 of 3")."""
    return {r.shard: f"shard {r.shard}: {r.reason}" for r in store.shard_records(job_id)
            if r.reason and r.state != "done"}

