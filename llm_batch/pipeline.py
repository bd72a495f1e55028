"""The steps of one batch job as plain functions: the DAG's tasks are thin wrappers.

No Airflow and no vLLM here: every step takes the job store, the settings and a job id,
so it is tested without a scheduler and reused by the housekeeping DAG and the CLI.

A run goes ``register -> validate -> plan -> run shards -> merge -> finalize``. Each step
is idempotent (a retried task redoes nothing harmful) and does nothing to a job that is
already terminal, so a run that was cut short can be finished or reconciled later.
Whatever happens, ``finalize`` (or ``fail_job`` from the run's failure path, or
``reconcile`` from housekeeping) leaves the job in a terminal status with a reason.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import orjson
from pydantic import BaseModel, ConfigDict, Field

from llm_batch import exit_codes, storage
from llm_batch.config import Settings
from llm_batch.jobs import JobStatus
from llm_batch.layout import JobLayout, join_uri

if TYPE_CHECKING:  # the store pulls in SQLAlchemy: DAG files must parse without it
    from llm_batch.jobstore import FileObject, Job, JobStore

log = logging.getLogger("llm_batch.pipeline")

# The Scale contract's gpu_type enum: the values the DAG form and the pod renderer accept.
GPU_TYPES: tuple[str, ...] = (
    "nvidia-tesla-t4",
    "nvidia-ampere-a10",
    "nvidia-ampere-a100",
    "nvidia-ampere-a100e",
    "nvidia-hopper-h100",
    "nvidia-hopper-h100-1g20gb",
    "nvidia-hopper-h100-3g40gb",
)
# The parameterised DAG whose runs are jobs (its file, housekeeping, recurring DAGs and the API name it).
BATCH_DAG_ID = "batch_inference"
HOUSEKEEPING_DAG_ID = "llm_batch_housekeeping"
INPUT_FORMATS: tuple[str, ...] = ("jsonl", "scale-v2", "scale-v1")
DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_OWNER = "airflow"
MAX_DATA_PARALLELISM = 64
DEFAULT_RUNTIME_SEC = 86_400
# The longest deadline any dialect allows: Mistral's timeout_hours goes to 168 (Scale's
# max_runtime_sec stops at 172,800 s; its API edge enforces that).
MAX_RUNTIME_SEC = 168 * 3600


class JobRejected(Exception):
    """The job cannot run (bad input, unsupported resources): it is FAILED with this reason."""


# -- pools and lanes ------------------------------------------------------------------------


@dataclass(frozen=True)
class PoolSpec:
    """An Airflow pool the shard tasks use; created by the embedded stack and tests."""

    name: str
    slots: int
    description: str


def gpu_pool(settings: Settings, gpu_type: str) -> str:
    return f"{settings.gpu_pool_prefix}{gpu_type.replace('-', '_')}"


def pool_specs(settings: Settings) -> list[PoolSpec]:
    """Every pool the batch DAG may name, with its configured size."""
    pools = [PoolSpec(settings.local_pool, settings.local_pool_slots, "llm-batch local shard workers")]
    pools += [
        PoolSpec(gpu_pool(settings, g), settings.gpu_pool_slots, f"llm-batch shards on {g}")
        for g in GPU_TYPES
    ]
    return pools


@dataclass(frozen=True)
class Lane:
    """One mapped shard task of the DAG: a pool and a priority band.

    Airflow fixes a mapped task's pool and priority_weight when the DAG is parsed, not per
    run, so the DAG has one mapped shard task per (pool, priority band) and ``plan`` puts a
    job's shards in the lane of its gpu_type and priority; the other lanes expand to zero
    tasks (skipped).
    """

    name: str
    pool: str
    priority: str
    priority_weight: int


def priority_bands(settings: Settings) -> list[tuple[str, int]]:
    return sorted(settings.priority_weights.items(), key=lambda item: item[1])


def lanes(settings: Settings) -> list[Lane]:
    pools = (
        [("local", settings.local_pool)]
        if settings.shard_runner == "local"
        else [(g.replace("-", "_"), gpu_pool(settings, g)) for g in GPU_TYPES]
    )
    return [
        Lane(f"{pool_key}__{band}", pool, band, weight)
        for pool_key, pool in pools
        for band, weight in priority_bands(settings)
    ]


def priority_band(settings: Settings, priority: str | int | None) -> str:
    """The band of a job priority: a band name, or a number mapped to the nearest band
    at or below it; no priority (None, "", 0: the store's "not given") and unknown names
    are "normal" (or the middle band)."""
    bands = priority_bands(settings)
    names = [name for name, _ in bands]
    default = "normal" if "normal" in names else names[len(names) // 2]
    if priority in (None, "", 0, "0"):
        return default
    if isinstance(priority, str) and priority.strip().lower() in names:
        return priority.strip().lower()
    try:
        number = int(priority)
    except (TypeError, ValueError):
        return default
    below = [name for name, weight in bands if weight <= number]
    return below[-1] if below else names[0]


def lane_for(settings: Settings, gpu_type: str | None, priority: str | int | None) -> str:
    band = priority_band(settings, priority)
    if settings.shard_runner == "local":
        return f"local__{band}"
    return f"{(gpu_type or GPU_TYPES[0]).replace('-', '_')}__{band}"


# -- the run's configuration ---------------------------------------------------------------


class RunConf(BaseModel):
    """The DAG run's conf (the batch_inference Params), already checked by Airflow.

    With ``job_id`` naming a job in the store (the REST API's runs), the store's record is
    the job and the other fields are ignored. Otherwise (Airflow UI, ``/api/v2``, recurring
    DAGs) a job is created from these fields, with ``job_id`` as its id when given.
    """

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    job_id: str | None = None
    input_uri: str | None = None
    input_file_ids: list[str] | None = None
    input_requests: list[dict[str, Any]] | None = None
    input_format: str = "jsonl"
    output_uri: str | None = None
    endpoint: str = "/v1/chat/completions"
    model: str = DEFAULT_MODEL
    engine_config: dict[str, Any] = Field(default_factory=dict, alias="model_config")
    data_parallelism: int = 1
    max_runtime_sec: int | None = None
    priority: str | int | None = None
    labels: dict[str, Any] = Field(default_factory=dict)
    metadata: dict[str, Any] = Field(default_factory=dict)
    gpus: int = 1
    gpu_type: str | None = None
    nodes_per_worker: int = 1
    owner: str = DEFAULT_OWNER

    def job_input(self) -> dict[str, Any]:
        if self.input_requests:
            return {"requests": self.input_requests}
        if self.input_file_ids:
            return {"file_ids": self.input_file_ids}
        if self.input_uri:
            return {"uri": self.input_uri}
        return {}


def run_job_id(conf: dict[str, Any], dag_run_id: str) -> str:
    """The job id of a DAG run: the conf's job_id, else one derived from the run id (so
    the run's failure path and housekeeping find the job without any XCom)."""
    given = conf.get("job_id")
    if given:
        return str(given)
    return "job_" + hashlib.blake2b(dag_run_id.encode(), digest_size=16).hexdigest()


def layout_of(settings: Settings, job_id: str) -> JobLayout:
    return JobLayout(settings.work_uri, job_id)


def _job(store: JobStore, job_id: str) -> Job:
    job = store.get_job(job_id)
    if job is None:
        raise JobRejected(f"job {job_id!r} is not in the job store")
    return job


def fail_job(store: JobStore, job_id: str, reason: str, *, dag_run_id: str | None = None) -> Job | None:
    """End a live job as FAILED with `reason` (a terminal job is left as it ended). With
    `dag_run_id`, only if the job is that run's: a foreign run's failure leaves it alone."""
    job = store.get_job(job_id)
    if job is None or job.terminal:
        return job
    if dag_run_id is not None and job.dag_run_id not in (None, dag_run_id):
        return job
    return store.end_job(job_id, JobStatus.FAILED, reason)


def check_resources(nodes_per_worker: int | None, gpu_type: str | None) -> None:
    """Refuse what no runner can honour, before anything runs."""
    if nodes_per_worker not in (None, 1):
        raise JobRejected(
            f"nodes_per_worker={nodes_per_worker} is not supported: a shard worker runs on one "
            "node (tensor parallel over its gpus); use data_parallelism for more workers"
        )
    if gpu_type is not None and gpu_type not in GPU_TYPES:
        raise JobRejected(f"gpu_type {gpu_type!r} is unknown; use one of {', '.join(GPU_TYPES)}")


# -- register -----------------------------------------------------------------------------


def register(
    store: JobStore, settings: Settings, conf: dict[str, Any], dag_run_id: str, *, trusted: bool = False
) -> str:
    """The run's job id: the job named by the conf, or a new QUEUED job made from it.

    Records the DAG run on the job. A conf that cannot become a job (no input, unsupported
    resources, a path its owner may not name) still gets a job record, FAILED with the
    reason, and raises JobRejected. `trusted` runs (scheduled ones: their conf comes from an
    admin's spec, not a user) may name paths outside the owner's namespace.
    A conf naming another owner's existing job is refused and that job left alone.
    """
    run = RunConf.model_validate(conf)
    job_id = run_job_id(conf, dag_run_id)
    existing = store.get_job(job_id)
    if existing is not None:
        if not _run_may_drive(existing, run.owner, dag_run_id, trusted):
            raise JobRejected(f"job {job_id!r} belongs to another run; give a new job_id (or none)")
        if existing.dag_run_id != dag_run_id:
            store.set_dag_run(job_id, dag_run_id)
        return job_id
    problem: JobRejected | None = None
    paths = {"input_uri": run.input_uri, "output_uri": run.output_uri}
    try:
        check_resources(run.nodes_per_worker, run.gpu_type)
        if not run.job_input():
            raise JobRejected("no input: give input_uri, input_file_ids or input_requests")
        # The canonical spelling is what later steps read and write.
        paths = {name: uri and _user_path(name, uri, run.owner, settings, trusted) for name, uri in paths.items()}
    except JobRejected as exc:
        problem = exc
    job = store.create_job(
        id=job_id,
        dialect="airflow",
        endpoint=run.endpoint,
        model=run.model,
        owner=run.owner,
        input=run.model_copy(update={"input_uri": paths["input_uri"]}).job_input(),
        input_format=run.input_format,
        model_config={"model": run.model, **run.engine_config},
        scale_output_uri=paths["output_uri"],
        metadata=run.metadata,
        labels=run.labels,
        priority=settings.priority_weights[priority_band(settings, run.priority)],
        data_parallelism=run.data_parallelism,
        resources={"gpus": run.gpus, "gpu_type": run.gpu_type, "nodes_per_worker": run.nodes_per_worker},
        max_runtime_sec=run.max_runtime_sec or settings.default_max_runtime_sec,
        dag_run_id=dag_run_id,
    )
    if problem is not None:
        fail_job(store, job.id, str(problem))
        raise problem
    return job.id


def api_run_id(job_id: str) -> str:
    """The run id the batch API gives a job's run: deterministic, so a repeated trigger of
    the same job finds its run instead of a twin, and the run is known as the job's own."""
    return f"llm_batch__{job_id}"


def _run_may_drive(job: Job, owner: str, dag_run_id: str, trusted: bool) -> bool:
    """A run may take over an existing job only if it is that job's own run (the API's, a
    retry or a clear of it) or comes from the job's owner or an admin's schedule."""
    own_run = job.dag_run_id == dag_run_id or (job.dag_run_id is None and dag_run_id == api_run_id(job.id))
    return own_run or trusted or job.owner == owner


def _user_path(name: str, uri: str, owner: str, settings: Settings, trusted: bool) -> str:
    """A path of the run's conf as its owner may name it (llm_batch.user_paths)."""
    from llm_batch import user_paths

    try:
        return user_paths.check(uri, owner, settings, is_admin=trusted).uri
    except (user_paths.PathRefused, user_paths.PathUnavailable) as exc:
        raise JobRejected(f"{name}: {exc}") from None


# -- validate -----------------------------------------------------------------------------


def _input_source(store: JobStore, job: Job) -> tuple[Any, str]:
    """What validation reads (a URI, a list of URIs, or inline requests) and its format."""
    given = job.input or {}
    fmt = job.input_format or "jsonl"
    if given.get("requests") is not None:
        return list(given["requests"]), "inline" if fmt == "jsonl" else fmt
    if given.get("file_ids"):
        uris = []
        for file_id in given["file_ids"]:
            file = store.get_file(file_id)
            if file is None:
                raise JobRejected(f"input file {file_id!r} does not exist (or was deleted)")
            uris.append(file.uri)
        return uris if len(uris) > 1 else uris[0], fmt
    if given.get("uri"):
        return given["uri"], fmt
    raise JobRejected("the job names no input")


def validate(store: JobStore, settings: Settings, job_id: str) -> dict[str, int] | None:
    """Stream the input into the validated file and error records; set total and the
    invalid count. None when the job is already over (cancelled before it started)."""
    from llm_batch.validation import BatchRejected, ValidationLimits, validate_batch

    job = _job(store, job_id)
    if job.terminal or job.cancel_requested:
        return None
    store.transition(job_id, JobStatus.VALIDATING)
    layout = layout_of(settings, job_id)
    try:
        source, fmt = _input_source(store, job)
        report = validate_batch(
            source, fmt=fmt, endpoint=job.endpoint, layout=layout,
            limits=ValidationLimits.from_settings(settings),
        )  # fmt: skip
    except BatchRejected as exc:
        if exc.report is not None:  # read through, nothing valid: serve the error lines
            _set_counts(store, job_id, exc.report.total, exc.report.invalid)
            error_file = _record_file(store, job, layout.validation_errors, "error")
            store.set_outputs(job_id, error_file_id=error_file.id)
        fail_job(store, job_id, f"input rejected: {exc}")
        raise JobRejected(f"input rejected: {exc}") from exc
    except (JobRejected, storage.StorageError) as exc:
        fail_job(store, job_id, f"input rejected: {exc}")
        raise JobRejected(f"input rejected: {exc}") from exc
    _set_counts(store, job_id, report.total, report.invalid)
    return {"total": report.total, "valid": report.valid, "invalid": report.invalid}


def _set_counts(store: JobStore, job_id: str, total: int, invalid: int) -> None:
    """Counts after validation: invalid lines are already completed (as failures), and
    stay the base the shards' progress rows add to."""
    store.set_counts(job_id, total=total, completed=invalid, succeeded=0, failed=invalid, invalid=invalid)


# -- plan ---------------------------------------------------------------------------------


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
    gpus: int = 1
    gpu_type: str | None = None
    nodes_per_worker: int = 1
    priority: str = "normal"
    labels: dict[str, str] = Field(default_factory=dict)

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
        ]  # fmt: skip

    @property
    def deadline_at(self) -> datetime:
        return datetime.fromisoformat(self.deadline)


def job_deadline(job: Job) -> datetime:
    """When the job's workers must stop: expires_at, else created_at + max_runtime_sec.
    (The store hands back timezone-aware UTC datetimes, so they compare with now(UTC).)"""
    if job.expires_at is not None:
        return job.expires_at
    return job.created_at + timedelta(seconds=job.max_runtime_sec or DEFAULT_RUNTIME_SEC)


def plan(store: JobStore, settings: Settings, job_id: str) -> dict[str, list[dict[str, Any]]]:
    """Write the shard files and return the shard tasks grouped by lane (see Lane).

    Every lane of the DAG is a key (most with no task). The job moves to RUNNING; a job
    cancelled (or ended) before this point gets no shard task. Planning again (a retried
    task) writes the same shards and keeps their results.
    """
    from llm_batch.sharding import plan_shards

    grouped: dict[str, list[dict[str, Any]]] = {lane.name: [] for lane in lanes(settings)}
    job = _job(store, job_id)
    if job.status not in (JobStatus.VALIDATING, JobStatus.RUNNING, JobStatus.CANCELLING):
        return grouped
    layout = layout_of(settings, job_id)
    if job.cancel_requested and not storage.exists(layout.validation_report):
        return grouped  # cancelled before its input was read: no line to account for
    # Planned even when cancelled after validation: merge then reports every valid line
    # as never run, so no line of a job whose input was read goes unaccounted for.
    plans = plan_shards(layout, job.data_parallelism)
    if job.cancel_requested:
        return grouped
    store.transition(job_id, JobStatus.RUNNING)
    resources = job.resources or {}
    band = priority_band(settings, job.priority)
    lane = lane_for(settings, resources.get("gpu_type"), job.priority)
    for shard in plans:
        task = ShardTask(
            job_id=job_id,
            shard=shard.index,
            requests_uri=shard.requests_uri,
            results_uri=shard.results_uri,
            progress_uri=shard.progress_uri,
            cancel_marker=layout.cancel_marker,
            endpoint=job.endpoint,
            model_config_json=orjson.dumps({"model": job.model, **(job.model_config or {})}).decode(),
            deadline=job_deadline(job).isoformat(),
            gpus=int(resources.get("gpus") or 1),
            gpu_type=resources.get("gpu_type"),
            nodes_per_worker=int(resources.get("nodes_per_worker") or 1),
            priority=band,
            labels={str(k): str(v) for k, v in (job.labels or {}).items()},
        )
        grouped[lane].append(task.model_dump())
    return grouped


# -- while shards run ---------------------------------------------------------------------


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


def mirror_cancel(store: JobStore, job_id: str, cancel_marker: str) -> bool:
    """If the job's cancel flag is set, make sure its cancel marker exists. True when
    cancel was requested."""
    job = store.get_job(job_id)
    if job is None or not job.cancel_requested:
        return False
    write_cancel_marker(cancel_marker, job)
    return True


def shard_stop_cause(store: JobStore, job_id: str, cancel_marker: str, deadline: datetime,
                     now: datetime | None = None) -> str | None:
    """"cancelled" or "deadline" when a job's shard must stop (mirroring the cancel flag to
    the marker on the way), else None. Both shard runners ask this while a worker runs."""
    if mirror_cancel(store, job_id, cancel_marker):
        return "cancelled"
    if (now or datetime.now(UTC)) >= deadline:
        return "deadline"
    return None


def try_report_shard(store: JobStore, task: ShardTask, outcome: ShardOutcome | None = None) -> None:
    """``report_shard`` for the runners' watch loops: live counts are advisory, so a
    failure is logged and never fails the shard."""
    try:
        report_shard(store, task, outcome)
    except Exception as exc:  # noqa: BLE001
        log.warning("could not report shard %d of job %s: %s", task.shard, task.job_id, exc)


def report_shard(store: JobStore, task: ShardTask, outcome: ShardOutcome | None = None) -> Job | None:
    """Read this shard's own progress object (one storage read, whatever the number of
    shards) and record it in the shard's row of the store, which sets the job's live
    counts and usage from the sum of its rows (``JobStore.report_shard``). With `outcome`
    (the shard task's end), the row also keeps the state and why, which merge reads.
    None when there is nothing to report yet (no progress object and no outcome)."""
    from llm_batch.progress import read_progress

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


def shard_not_run_reasons(store: JobStore, job_id: str) -> dict[int, str]:
    """Why each shard that did not finish stopped, from its recorded outcome: what merge
    writes on the requests it never ran (e.g. "shard 3: the worker failed (exit status 1)
    on attempt 3 of 3")."""
    return {r.shard: f"shard {r.shard}: {r.reason}" for r in store.shard_records(job_id)
            if r.reason and r.state != "done"}


# -- merge and finalize -------------------------------------------------------------------


def _stop_cause(job: Job, now: datetime | None = None) -> tuple[JobStatus, str] | None:
    """Why the job's unfinished requests were not run, if it was stopped on purpose."""
    if job.cancel_requested:
        return JobStatus.CANCELLED, "the job was cancelled"
    if (now or datetime.now(UTC)) >= job_deadline(job):
        return JobStatus.TIMEOUT_EXCEEDED, "the job's deadline passed"
    return None


def _not_run_code(cause: tuple[JobStatus, str] | None) -> str:
    """The error code of requests that never ran, by why the job stopped."""
    from llm_batch.merge import BATCH_CANCELLED, BATCH_EXPIRED, SHARD_FAILED

    status = cause[0] if cause else None
    return {JobStatus.CANCELLED: BATCH_CANCELLED, JobStatus.TIMEOUT_EXCEEDED: BATCH_EXPIRED}.get(status, SHARD_FAILED)


def merge(store: JobStore, settings: Settings, job_id: str) -> dict[str, int] | None:
    """Merge the shards' results into the job's outputs (idempotent) and set the counts.

    None when the job never got shards (ended before planning) or is already terminal.
    """
    from llm_batch.merge import merge_job
    job = _job(store, job_id)
    layout = layout_of(settings, job_id)
    if job.terminal or not storage.exists(layout.shard_manifest):
        return None
    if job.status == JobStatus.RUNNING:
        store.transition(job_id, JobStatus.FINALIZING)
    cause = _stop_cause(job)
    if job.scale_output_uri:  # checked at submission; checked again right before writing
        from llm_batch import user_paths

        user_paths.refuse_internal(job.scale_output_uri, settings)
    counts = merge_job(
        layout,
        jsonl=True,
        scale_output_uri=job.scale_output_uri,
        scale_json=job.dialect == "scale",
        not_run_reason=f"{cause[1] if cause else 'its shard failed after its retries'} before this request ran",
        not_run_code=_not_run_code(cause),
        shard_not_run_reasons=shard_not_run_reasons(store, job_id),
    )
    # Every request has an outcome now, those never run included (counted failed).
    store.set_counts(
        job_id,
        total=counts.total,
        completed=counts.succeeded + counts.failed,
        succeeded=counts.succeeded,
        failed=counts.failed,
    )
    # The exact usage: the sum over the output lines (the live figure came from progress).
    store.set_usage(job_id, prompt_tokens=counts.prompt_tokens, completion_tokens=counts.completion_tokens,
                    cached_prompt_tokens=counts.cached_prompt_tokens, reasoning_tokens=counts.reasoning_tokens)
    report = dataclasses.asdict(counts)
    storage.write_bytes(layout.merge_report, orjson.dumps(report))
    return report


def _read_merge_report(layout: JobLayout) -> dict[str, int] | None:
    """The merge step's counts (a file, not an XCom: finalize must work whatever happened
    to the merge task)."""
    try:
        return orjson.loads(storage.read_bytes(layout.merge_report))
    except storage.ObjectNotFound:
        return None


def _record_file(store: JobStore, job: Job, uri: str, kind: str) -> FileObject:
    name = f"{job.id}_{kind}.jsonl"
    return store.create_file(
        owner=job.owner,
        purpose="batch_output" if kind == "output" else "batch_error",
        filename=name,
        bytes=storage.size(uri),
        uri=uri,
        kind=kind,
        job_id=job.id,
    )


def _error_summary(counts: dict[str, int]) -> list[dict[str, Any]]:
    summary = []
    if counts.get("invalid"):
        summary.append({"code": "invalid_request", "message": "input lines failed validation", "count": counts["invalid"]})
    if counts.get("not_run"):
        summary.append({"code": "not_run", "message": "requests were never run (cancel, deadline or a failed shard)",
                        "count": counts["not_run"]})
    engine = counts.get("failed", 0) - counts.get("invalid", 0) - counts.get("not_run", 0)
    if engine > 0:
        summary.append({"code": "request_failed", "message": "requests failed in the engine", "count": engine})
    return summary


def finalize(store: JobStore, settings: Settings, job_id: str) -> Job:
    """End the job: record its output/error files and move it to its terminal status.

    SUCCEEDED when every request has a result or error line from a finished shard;
    CANCELLED / TIMEOUT_EXCEEDED when it was stopped on purpose (partial results kept);
    FAILED when shards failed for good or the run ended before merging. A terminal job is
    returned unchanged (finalize is idempotent).
    """
    job = _job(store, job_id)
    if job.terminal:
        return job
    cause = _stop_cause(job)
    layout = layout_of(settings, job_id)
    counts = _read_merge_report(layout)
    if counts is None:
        if cause is not None and not storage.exists(layout.validation_report):
            return store.end_job(job_id, cause[0], f"{cause[1]} before its input was read: no request was run")
        status, reason = cause or (JobStatus.FAILED, "the run ended before the shards' results were merged")
        return store.end_job(job_id, status, reason)
    output = job.output_file_id and store.get_file(job.output_file_id)
    errors = job.error_file_id and store.get_file(job.error_file_id)
    store.set_outputs(
        job_id,
        output_uri=layout.output_jsonl,
        output_file_id=(output or _record_file(store, job, layout.output_jsonl, "output")).id,
        error_file_id=(errors or _record_file(store, job, layout.errors_jsonl, "error")).id,
        errors=_error_summary(counts),
    )
    not_run = counts["not_run"]
    if not_run:
        failed_shards = "; ".join(shard_not_run_reasons(store, job_id).values())
        status, why = cause or (JobStatus.FAILED, failed_shards or "a shard failed after its retries")
        reason = f"{why}; {not_run} requests were not run"
    elif job.cancel_requested:
        status, reason = JobStatus.CANCELLED, "the job was cancelled after every request had finished"
    else:
        status, reason = JobStatus.SUCCEEDED, f"{counts['succeeded']} succeeded, {counts['failed']} failed"
    return store.end_job(job_id, status, reason)


# -- housekeeping -------------------------------------------------------------------------


def live_jobs(store: JobStore, **filters: Any) -> Iterator[Job]:
    """Every job not yet terminal (paged through the store), oldest first."""
    live = [s for s in JobStatus if not s.terminal]
    while True:
        page, _ = store.list_jobs(statuses=live, order_by="created_at", limit=500, **filters)
        yield from page
        if len(page) < 500:
            return
        filters["after"] = page[-1].id


def expire(store: JobStore, settings: Settings, now: datetime | None = None) -> list[str]:
    """Jobs still live past their expires_at (+ the cancel grace, by which their workers
    have stopped or been killed) end as TIMEOUT_EXCEEDED, keeping what finished: their
    shards' results are merged first. Returns their ids."""
    now = now or datetime.now(UTC)
    cutoff = now - timedelta(seconds=settings.cancel_grace_seconds)
    expired = []
    for job in list(live_jobs(store, expires_before=cutoff)):
        _end(store, settings, job.id, f"expired: the job passed its expires_at ({job.expires_at})")
        expired.append(job.id)
    return expired


def _end(store: JobStore, settings: Settings, job_id: str, why: str) -> None:
    """Merge and finalize a job outside its run; if that fails, FAILED with `why`."""
    try:
        merge(store, settings, job_id)
        finalize(store, settings, job_id)
    except Exception as exc:  # noqa: BLE001 - whatever happens, the job must end
        log.warning("job %s: could not merge and finalize (%s)", job_id, exc)
        fail_job(store, job_id, f"{why}; its results could not be merged: {exc}")
        return
    fail_job(store, job_id, why)  # only if finalize left it live (it never should)


def reconcile(store: JobStore, settings: Settings, run_states: dict[str, str]) -> list[str]:
    """Live jobs whose DAG run has ended (``run_states``: dag_run_id -> Airflow state) were
    not finalized (a killed run, a scheduler crash): merge what exists and finalize them."""
    reconciled = []
    for job in list(live_jobs(store)):
        state = run_states.get(job.dag_run_id or "")
        if state not in ("success", "failed"):
            continue
        _end(store, settings, job.id, f"reconciled after its run ended ({state})")
        reconciled.append(job.id)
    return reconciled


def delete_expired_files(store: JobStore, settings: Settings, now: datetime | None = None) -> list[str]:
    """Delete the content of files older than the retention and mark them deleted; also
    drop the job's work folder once its files are gone. Returns the deleted file ids."""
    now = now or datetime.now(UTC)
    cutoff = now - timedelta(days=settings.retention_days)
    deleted = []
    while True:
        page, _ = store.list_files(created_before=cutoff, limit=500)
        if not page:
            return deleted
        for file in page:
            _remove_file(store, file)
            deleted.append(file.id)
            if file.job_id:
                _drop_work_dir(settings, file.job_id)


def delete_job(store: JobStore, settings: Settings, job: Job) -> None:
    """Remove an ended job and what it made: its output, error and inline-input files
    (records marked deleted, content removed), its work folder, then its record. Files the
    owner uploaded stay: they are the owner's objects, and other jobs may read them."""
    made = [job.output_file_id, job.error_file_id, (job.input or {}).get("inline_file_id")]
    for file_id in filter(None, made):
        if (file := store.get_file(file_id)) is not None:
            _remove_file(store, file)
    _drop_work_dir(settings, job.id)
    store.delete_job(job.id)


def _remove_file(store: JobStore, file: FileObject) -> None:
    """Delete a file object's content (already gone is fine) and mark its record deleted."""
    try:
        storage.delete(file.uri)
    except storage.ObjectNotFound:
        pass
    store.mark_file_deleted(file.id)


def _drop_work_dir(settings: Settings, job_id: str) -> None:
    prefix = join_uri(layout_of(settings, job_id).root, "")
    try:
        storage.delete_prefix(prefix.rstrip("/") + "/")
    except storage.ObjectNotFound:
        pass

