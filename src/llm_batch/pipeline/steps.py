"""The steps of one batch job (``register -> validate -> plan -> run shards -> merge ->
finalize``) as plain functions of the store, the settings and a job id: no Airflow, no vLLM.
Each is idempotent and leaves a terminal job alone, so a cut-short run can be finished later.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from importlib import resources
from typing import TYPE_CHECKING, Any

import orjson
import yaml

from llm_batch.core import owners
from llm_batch.core.config import Settings
from llm_batch.core.endpoints import SUPPORTED_ENDPOINTS
from llm_batch.core.job_request import JobRequest
from llm_batch.core.job_spec import JobInput, JobOptions, OutputFormat
from llm_batch.core.jobs import InvalidTransition, JobRejected, JobStatus
from llm_batch.core.layout import JobLayout
from llm_batch.core.model_choice import ModelChoice
from llm_batch.core.placement import priority_band
from llm_batch.core.run_conf import DEFAULT_MODEL, DEFAULT_OWNER, DEFAULT_RUNTIME_SEC, api_run_id, run_job_id
from llm_batch.infra import storage, user_paths
from llm_batch.pipeline.recurring import output_asset_uri
from llm_batch.pipeline.shard_task import ShardTask, shard_not_run_reasons

if TYPE_CHECKING:  # the store pulls in SQLAlchemy: DAG files must parse without it
    from llm_batch.infra.jobstore import AdapterRepository, FileObject, FileRepository, Job, JobRepository, JobStore

__all__ = ["JobRejected", "fail_job", "finalize", "job_deadline", "layout_of", "merge", "plan",
           "register", "registry_model_names", "shard_ref", "shard_task", "validate"]


def registry_model_names(settings: Settings) -> list[str]:
    """The registry's model and adapter names, from its YAML alone (cheap enough for DAG
    parsing); empty if it cannot be read."""
    try:
        source = settings.model_registry or resources.files("llm_batch").joinpath("models.yaml")
        registry = yaml.safe_load(source.read_text()) or {}
        return sorted([*(registry.get("models") or {}), *(registry.get("adapters") or {})])
    except (OSError, yaml.YAMLError, AttributeError):
        return []


def layout_of(settings: Settings, job_id: str) -> JobLayout:
    return JobLayout(settings.work_uri, job_id)


def _job(store: JobRepository, job_id: str) -> Job:
    job = store.get_job(job_id)
    if job is None:
        raise JobRejected(f"job {job_id!r} is not in the job store")
    return job


def fail_job(store: JobRepository, job_id: str, reason: str, *, dag_run_id: str | None = None) -> Job | None:
    """End a live job as FAILED; with `dag_run_id`, only if the job is that run's."""
    job = store.get_job(job_id)
    if job is None or job.terminal:
        return job
    if dag_run_id is not None and job.dag_run_id not in (None, dag_run_id):
        return job
    return store.end_job(job_id, JobStatus.FAILED, reason)


# -- register -----------------------------------------------------------------------------


def run_owner(user: str | None, conf: dict[str, Any], is_admin: Callable[[str], bool]) -> tuple[str, bool]:
    """(owner, trusted) of a run: its triggering user's (trusted if an admin); an untriggered
    run is the admin's and trusted, unless its conf names an owner (a recurring spec's)."""
    if user is not None:
        return user, is_admin(user)
    named = conf.get("owner")
    if named is None:
        return DEFAULT_OWNER, True
    return named, False


def register(
    store: JobStore, settings: Settings, conf: dict[str, Any], dag_run_id: str, *, trusted: bool = False
) -> str:
    """The run's job id: the job its conf names, or a new QUEUED job admitted from the conf.
    A refused conf leaves a FAILED job holding the reason (shown by the page, the API and the
    run's note) and raises JobRejected."""
    from llm_batch.pipeline.admission import admit_run, refusal_text  # heavy

    owner = str(conf.get("owner") or DEFAULT_OWNER)
    try:
        owners.check(owner)
    except owners.OwnerNameRefused as exc:
        raise JobRejected(f"the run's user cannot own a job: {exc}") from None
    job_id = run_job_id(conf, dag_run_id)
    existing = store.get_job(job_id)
    if existing is not None:
        # Only the job's own run, its owner's or a trusted one may take over an existing job.
        own_run = existing.dag_run_id == dag_run_id or (
            existing.dag_run_id is None and dag_run_id == api_run_id(job_id))
        if not (own_run or trusted or existing.owner == owner):
            raise JobRejected(f"job {job_id!r} belongs to another run; give a new job_id (or none)")
        if existing.status == JobStatus.FAILED and (existing.status_reason or "").startswith(REFUSED):
            # A cleared refused run, or another run naming its job id: refused the same way.
            raise JobRejected(existing.status_reason.removeprefix(REFUSED))
        if existing.dag_run_id != dag_run_id:
            store.set_dag_run(job_id, dag_run_id)
        return job_id
    try:
        request = admit_run(conf, owner, trusted, store, settings, job_id=job_id)
    except JobRejected as exc:
        reason = refusal_text(exc)
        _record_refusal(store, settings, conf, owner, job_id, dag_run_id, reason)
        raise JobRejected(reason) from None
    return store.create_requested_job(request, owner, dag_run_id=dag_run_id).id


REFUSED = "the run was refused: "  # how a refused run's job reason starts


def _record_refusal(store: JobRepository, settings: Settings, conf: dict[str, Any], owner: str, job_id: str,
                    dag_run_id: str, reason: str) -> None:
    """A FAILED job holding a refused run's reason; it keeps no input, paths or figures."""
    model = conf.get("model")
    endpoint = conf.get("endpoint")
    request = JobRequest(id=job_id, endpoint=endpoint if endpoint in SUPPORTED_ENDPOINTS else "/v1/chat/completions",
                         model=model if isinstance(model, str) and model else DEFAULT_MODEL, input=JobInput(),
                         input_format="jsonl", max_runtime_sec=settings.default_max_runtime_sec)
    store.create_requested_job(request, owner, dag_run_id=dag_run_id)
    store.end_job(job_id, JobStatus.FAILED, REFUSED + reason)


# -- validate -----------------------------------------------------------------------------


def input_source(store: FileRepository, job: Job) -> tuple[Any, str]:
    """What validation reads (a URI, a list of URIs, or inline requests) and its format."""
    given = job.input
    fmt = job.input_format or "jsonl"
    if given.requests is not None:
        return list(given.requests), "inline" if fmt == "jsonl" else fmt
    if given.file_ids:
        uris = []
        for file_id in given.file_ids:
            file = store.get_file(file_id)
            if file is None:
                raise JobRejected(f"input file {file_id!r} does not exist (or was deleted)")
            uris.append(file.uri)
        return uris if len(uris) > 1 else uris[0], fmt
    if given.uri:
        return given.uri, fmt
    raise JobRejected("the job names no input")


def validate(store: JobStore, settings: Settings, job_id: str) -> dict[str, int] | None:
    """Validate the input and set the counts; None when the job is already over."""
    from llm_batch.infra.media import MediaResolver  # heavy
    from llm_batch.pipeline.validation import (  # heavy
        BatchRejected,
        ValidationLimits,
        ValidationStopped,
        validate_batch,
    )

    job = _job(store, job_id)
    if job.terminal or job.cancel_requested:
        return None
    try:
        store.transition(job_id, JobStatus.VALIDATING)
    except InvalidTransition:
        return None  # cancelled (ended) since it was read
    layout = layout_of(settings, job_id)
    try:
        source, fmt = input_source(store, job)
        report = validate_batch(
            source, fmt=fmt, endpoint=job.endpoint, layout=layout,
            limits=ValidationLimits.from_settings(settings),
            media=MediaResolver(job.owner, store, settings),
            models=job_model_choice(store, job, settings),
            unique_custom_ids=job.input.unique_custom_ids,
            stopped=lambda: _job(store, job_id).cancel_requested,
        )  # fmt: skip
    except ValidationStopped:
        return None  # cancelled while its input was read: as if before (plan maps no shard)
    except (BatchRejected, JobRejected, storage.StorageError) as exc:
        if isinstance(exc, BatchRejected) and exc.report is not None:  # read through, nothing valid: serve the error lines
            _set_counts(store, job_id, exc.report.total, exc.report.invalid)
            error_file = _record_file(store, job, layout.validation_errors, "error")
            store.set_outputs(job_id, error_file_id=error_file.id)
        fail_job(store, job_id, f"input rejected: {exc}")
        raise JobRejected(f"input rejected: {exc}") from exc
    _set_counts(store, job_id, report.total, report.invalid)
    _keep_estimate(store, settings, job, report, layout.validated)
    return {"total": report.total, "valid": report.valid, "invalid": report.invalid}


def _keep_estimate(store: JobStore, settings: Settings, job: Job, report: Any, validated_uri: str) -> None:
    """Keep the job's estimate; a failure to make it is only logged."""
    from llm_batch.pipeline.estimate import estimate_validated  # heavy

    try:
        estimate = estimate_validated(store, settings, job, report, validated_uri, now=datetime.now(UTC))
        store.set_estimate(job.id, estimate.model_dump(mode="json"))
    except Exception:  # an estimate must never fail the job it estimates
        logging.getLogger(__name__).warning("job %s: no estimate kept", job.id, exc_info=True)


def job_model_choice(store: AdapterRepository, job: Job, settings: Settings) -> ModelChoice:
    """The names the job's lines may give as their model: its model and its base's adapters."""
    from llm_batch.core.model_config import ModelError  # heavy
    from llm_batch.infra.adapters import model_choice  # heavy
    from llm_batch.infra.model_registry import load_registry  # heavy

    served = (job.model_config or {}).get("served_model_name")
    if (job.model_config or {}).get("checkpoint_path"):
        return ModelChoice(base=served or job.model, names={job.model: None, **({served: None} if served else {})})
    try:
        registry = load_registry(settings=settings)
    except ModelError as exc:
        raise JobRejected(str(exc)) from None
    own = store.list_adapters(job.owner)
    return model_choice(registry, job.model, served, owned={a.name: a.base for a in own},
                        locations={a.name: a.uri for a in own})


def _set_counts(store: JobRepository, job_id: str, total: int, invalid: int) -> None:
    """Invalid lines count as completed failures: the base the shards' progress adds to."""
    store.set_counts(job_id, total=total, completed=invalid, succeeded=0, failed=invalid, invalid=invalid)

# -- plan ---------------------------------------------------------------------------------


def job_deadline(job: Job) -> datetime:
    """When the job's workers must stop (timezone-aware UTC)."""
    if job.expires_at is not None:
        return job.expires_at
    return job.created_at + timedelta(seconds=job.max_runtime_sec or DEFAULT_RUNTIME_SEC)


def plan(store: JobStore, settings: Settings, job_id: str) -> list[ShardTask]:
    """Write the shard files and return the job's shard tasks (none if it was cancelled)."""
    from llm_batch.pipeline.result_cache import answer_from_cache  # heavy
    from llm_batch.pipeline.sharding import plan_shards  # heavy

    job = _job(store, job_id)
    if job.status not in (JobStatus.VALIDATING, JobStatus.RUNNING, JobStatus.CANCELLING):
        return []
    layout = layout_of(settings, job_id)
    if job.cancel_requested and not storage.exists(layout.validation_report):
        return []  # cancelled before its input was read: no line to account for
    # Planned even when cancelled after validation, so merge accounts for every valid line.
    source = layout.validated if job.cancel_requested else answer_from_cache(store, settings, job, layout)
    plans = plan_shards(layout, job.data_parallelism, source=source, settings=settings)
    if job.cancel_requested:
        return []
    store.transition(job_id, JobStatus.RUNNING)
    return [_shard_task(store, settings, job, shard.index, shard.count, bool(shard.adapters)) for shard in plans]


def shard_ref(task: ShardTask) -> dict[str, Any]:
    """A shard's XCom: ids and counts only, since every Airflow viewer reads XComs."""
    return {"job_id": task.job_id, "shard": task.shard, "requests": task.requests}


def shard_task(given: dict[str, Any], settings: Settings, store: JobStore | None = None) -> ShardTask:
    """The shard task a ``shard_ref`` (or a whole ``ShardTask`` dict) names."""
    if "requests_uri" in given:
        return ShardTask.model_validate(given)
    if store is None:
        from llm_batch.infra.jobstore import get_job_store  # heavy

        store = get_job_store(settings.database_url)
    return _shard_task(store, settings, _job(store, str(given["job_id"])), int(given["shard"]), given.get("requests"))


def engine_model_config(store: AdapterRepository, job: Job, settings: Settings) -> dict[str, Any]:
    """The model_config the job's shards load: a job of an adapter (the registry's or its
    owner's) loads the adapter's base, so the jobs of all adapters of one base share engines
    (each line names its adapter)."""
    from llm_batch.infra.model_registry import load_registry  # heavy

    own = {a.name: a.base for a in store.list_adapters(job.owner)}
    if (job.model_config or {}).get("checkpoint_path"):
        base = own.get(job.model, job.model)
    else:
        base = load_registry(settings=settings).base_of(job.model, own)
    return {**(job.model_config or {}), "model": base}


def engine_to_warm(store: JobStore, settings: Settings, job_id: str) -> tuple[dict[str, Any], bool] | None:
    """What the job's shards will load, and whether with LoRA on (a job of an adapter: its
    first shard's lines name it), to start loading while it is planned; None if its lines may
    all be answered from the result cache (then no engine may be needed at all)."""
    from llm_batch.pipeline.result_cache import may_answer  # heavy

    job = _job(store, job_id)
    if may_answer(store, settings, job):
        return None
    model_config = engine_model_config(store, job, settings)
    return model_config, model_config["model"] != job.model


def _shard_task(store: AdapterRepository, settings: Settings, job: Job, index: int, count: int | None,
                lora: bool | None = None) -> ShardTask:
    layout = layout_of(settings, job.id)
    shard = layout.shard(index)
    if lora is None:  # a shard_ref: the plan says whether its lines name adapters
        from llm_batch.pipeline.sharding import read_manifest  # heavy

        shards = read_manifest(layout).shards if storage.exists(layout.shard_manifest) else []
        lora = index < len(shards) and bool(shards[index].adapters)
    resources = job.resources or {}
    return ShardTask(
        job_id=job.id,
        shard=index,
        requests_uri=shard.requests,
        results_uri=shard.results,
        progress_uri=shard.progress,
        cancel_marker=layout.cancel_marker,
        endpoint=job.endpoint,
        model_config_json=orjson.dumps(engine_model_config(store, job, settings)).decode(),
        deadline=job_deadline(job).isoformat(),
        options_json=job.input.part(JobOptions).model_dump_json(exclude_defaults=True),
        cache_salt=owners.cache_salt(job.owner),
        gpus=int(resources.get("gpus") or 1),
        gpu_type=resources.get("gpu_type"),
        nodes_per_worker=int(resources.get("nodes_per_worker") or 1),
        priority=priority_band(settings, job.priority),
        labels={str(k): str(v) for k, v in (job.labels or {}).items()},
        requests=count,
        lora=lora,
    )


# -- merge and finalize -------------------------------------------------------------------


def _stop_cause(job: Job) -> tuple[JobStatus, str] | None:
    """Why the job's unfinished requests were not run, if it was stopped on purpose."""
    if job.cancel_requested:
        return JobStatus.CANCELLED, "the job was cancelled"
    if datetime.now(UTC) >= job_deadline(job):
        return JobStatus.TIMEOUT_EXCEEDED, "the job's deadline passed"
    return None


def merge(store: JobStore, settings: Settings, job_id: str) -> dict[str, int] | None:
    """Merge the shards' results into the job's outputs and set the counts (None: no shards)."""
    from llm_batch.core.scale_output import success_element  # heavy
    from llm_batch.pipeline.merge import BATCH_CANCELLED, BATCH_EXPIRED, SHARD_FAILED, merge_job  # heavy
    from llm_batch.pipeline.result_cache import fill_cache  # heavy
    job = _job(store, job_id)
    layout = layout_of(settings, job_id)
    if job.terminal or not storage.exists(layout.shard_manifest):
        return None
    if job.status == JobStatus.RUNNING:
        store.transition(job_id, JobStatus.FINALIZING)
    cause = _stop_cause(job)
    if job.array_output_uri:  # checked at submission; checked again right before writing
        user_paths.refuse_internal(job.array_output_uri, settings)
    counts = merge_job(
        layout,
        jsonl=True,
        array_output_uri=job.array_output_uri,
        json_array=job.input.output_format == OutputFormat.JSON_ARRAY,
        array_element=success_element(job.input_format),
        not_run_reason=f"{cause[1] if cause else 'its shard failed after its retries'} before this request ran",
        not_run_code={JobStatus.CANCELLED: BATCH_CANCELLED, JobStatus.TIMEOUT_EXCEEDED: BATCH_EXPIRED}.get(
            cause and cause[0], SHARD_FAILED),
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
                    cached_prompt_tokens=counts.cached_prompt_tokens, reasoning_tokens=counts.reasoning_tokens,
                    model_usage=counts.by_model or None, result_cache_hits=counts.result_cache_hits,
                    result_cache_tokens=counts.result_cache_tokens, invalid_output=counts.invalid_output,
                    output_retries=counts.output_retries, retry_tokens=counts.retry_tokens,
                    tokens_per_s=engine_rate(store.shard_records(job_id)))
    fill_cache(store, settings, job, layout)  # after the outputs: a failure here loses no line
    report = dataclasses.asdict(counts)
    storage.write_bytes(layout.merge_report, orjson.dumps(report))
    return report


def engine_rate(shards: list[Any]) -> float:
    """Output tokens per engine second (engine start, queueing and cached lines left out)."""
    seconds = sum(shard.engine_seconds for shard in shards)
    return round(sum(shard.completion_tokens for shard in shards) / seconds, 1) if seconds > 0 else 0.0


def _record_file(store: FileRepository, job: Job, uri: str, kind: str) -> FileObject:
    name = f"{job.id}_{kind}.jsonl"
    expiry = job.input.output_expires_after_s
    return store.create_file(
        owner=job.owner,
        purpose="batch_output" if kind == "output" else "batch_error",
        filename=name,
        bytes=storage.size(uri),
        uri=uri,
        kind=kind,
        job_id=job.id,
        expires_after=timedelta(seconds=expiry) if expiry else None,
    )


# An ended job's error summary: why its requests failed -> the code of its entry (the
# metrics' reasons read the summaries with the same keys).
ERROR_SUMMARY_CODES = {"invalid": "invalid_request", "not_run": "not_run", "engine": "request_failed"}


def _error_summary(counts: dict[str, int]) -> list[dict[str, Any]]:
    engine = counts.get("failed", 0) - counts.get("invalid", 0) - counts.get("not_run", 0)
    entries = (("invalid", "input lines failed validation", counts.get("invalid", 0)),
               ("not_run", "requests were never run (cancel, deadline or a failed shard)", counts.get("not_run", 0)),
               ("engine", "requests failed in the engine", engine))
    return [{"code": ERROR_SUMMARY_CODES[why], "message": message, "count": count}
            for why, message, count in entries if count > 0]


def finalize(store: JobStore, settings: Settings, job_id: str) -> Job:
    """End the job: record its output and error files and set its terminal status."""
    job = _job(store, job_id)
    if job.terminal:
        return job
    cause = _stop_cause(job)
    layout = layout_of(settings, job_id)
    try:  # the merge step's counts: a file, not an XCom, so finalize works after any try
        counts = orjson.loads(storage.read_bytes(layout.merge_report))
    except storage.ObjectNotFound:
        counts = None
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


# -- what a finished job tells Airflow -----------------------------------------------------


def job_summary(job: Job) -> str:
    """One line: status, counts, reason."""
    return (f"{job.status.value}: {job.succeeded} succeeded, {job.failed} failed of {job.total}"
            f" ({job.status_reason or 'no reason recorded'})")


def result_asset_uris(job: Job) -> list[str]:
    """The assets a job with results updates: its outputs (a local path as file://...) and a
    recurring spec's own."""
    uris = [u if "://" in u else "file://" + u for u in (job.output_uri, job.array_output_uri) if u]
    if recurring := (job.metadata or {}).get("recurring"):
        uris.append(output_asset_uri(str(recurring)))
    return list(dict.fromkeys(uris))
