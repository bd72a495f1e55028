"""The submit use case: a dialect-neutral ``JobRequest`` (``llm_batch.core.job_request``) becomes a
job row and a DAG run.

Routers translate their dialect's body into a ``JobRequest`` (and may first store inline
requests as a file with ``save_inline_requests``, or check uploaded ones with
``check_input_files``); ``submit`` then
1. creates the QUEUED job in the store (owner = the caller),
2. triggers the ``batch_inference`` run through ``dag_trigger`` with ``dag_conf(job)``,
3. records the run id, or, if the trigger failed, marks the job FAILED with the reason,
so a job is never left queued without a run.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any, NamedTuple

import orjson
from fastapi import Depends

from llm_batch.api.auth import Caller, CallerDep
from llm_batch.api.dag_trigger import Trigger, TriggerDep, TriggerError
from llm_batch.api.errors import ApiError
from llm_batch.api.idempotency import IdempotencyDep
from llm_batch.api.state import SettingsDep, StoreDep
from llm_batch.core.config import Settings
from llm_batch.core.endpoints import (
    FEATURE_OF_ENDPOINT,
    SUPPORTED_ENDPOINTS,
    UnsupportedEndpointError,
    parse_endpoint,
    serving_problem,
)
from llm_batch.core.formats import not_json
from llm_batch.core.job_input import JobInput
from llm_batch.core.job_request import JobRequest
from llm_batch.core.jobs import JobStatus
from llm_batch.core.layout import join_uri
from llm_batch.infra import input_files, storage, user_paths
from llm_batch.infra.jobstore import Adapters, Job, JobStore, new_file_id
from llm_batch.infra.log_context import bind_job
from llm_batch.infra.model_registry import (
    ModelError,
    ModelNotPrepared,
    Registry,
    check_local_checkpoint,
    load_registry,
    submission_problems,
    validate_model_config,
)


class Submitting(NamedTuple):
    """What a create route works with (``SubmittingDep``); depending on it also makes the
    route take an ``Idempotency-Key`` (on a router with ``route_class=IdempotentRoute``)."""

    caller: Caller
    store: JobStore
    settings: Settings
    trigger: Trigger


async def _submitting(caller: CallerDep, store: StoreDep, settings: SettingsDep, trigger: TriggerDep,
                      _idempotency: IdempotencyDep = None) -> Submitting:
    return Submitting(caller, store, settings, trigger)


SubmittingDep = Annotated[Submitting, Depends(_submitting)]


def priority_weight(settings: Settings, name: str | None) -> int:
    """A named priority (Scale's free string, the native route's field) -> the stored weight; unknown names are refused."""
    if name is None:
        return 0
    if name in settings.priority_weights:
        return settings.priority_weights[name]
    known = ", ".join(sorted(settings.priority_weights))
    raise ApiError(400, f"priority {name!r} is unknown; use one of: {known}", param="priority", code="invalid_priority")


def check_endpoint(endpoint: str, param: str = "endpoint") -> str:
    try:
        return parse_endpoint(endpoint).value
    except UnsupportedEndpointError as exc:
        raise ApiError(400, str(exc), param=param, code="unsupported_endpoint") from None


@lru_cache(maxsize=4)
def _registry(path: Path | None, _modified_ns: int | None) -> Registry:
    return load_registry(path)


def model_registry(settings: Settings) -> Registry:
    """The model registry, parsed once per version of its file (~10 ms a parse)."""
    path = settings.model_registry
    modified = path.stat().st_mtime_ns if path is not None and path.exists() else None
    return _registry(path, modified)


def check_model(
    model: str | None,
    model_config: dict[str, Any],
    settings: Settings,
    param: str = "model",
    endpoint: str | None = None,
    caller: Caller | None = None,
    store: Adapters | None = None,
    owner: str | None = None,
) -> str:
    """A model must be named, its model_config well formed (the worker's own check, so a bad
    field is refused here rather than failing the first shard), its checkpoint_path (if
    given) allowed, and otherwise the model registered (or, given the ``store``, a LoRA
    adapter the job's ``owner``, by default the caller, uploaded) and able to serve
    `endpoint`. Returns the model whose registry entry the job runs on: `model`, or an
    owner's adapter's base (a registry name wins over an owner's adapter)."""
    if not model:
        raise ApiError(400, "a model is required", param=param, code="missing_model")
    try:
        validate_model_config({**model_config, "model": model})
    except ModelError as exc:
        raise ApiError(400, str(exc), param="model_config", code="invalid_model_config") from None
    if checkpoint := model_config.get("checkpoint_path"):
        _check_checkpoint(str(checkpoint), settings, caller)
        # The task of a checkpoint outside the registry is known only when it loads; an
        # endpoint that needs a registry feature (a FIM template) needs a registered name.
        if endpoint in _FEATURE_ENDPOINTS:
            spec = model_registry(settings).models.get(model)
            _check_serves(endpoint, model, spec.task if spec else "generate", spec.features if spec else [], param)
        check_engine_would_start(model, model_config, settings, param)
        return model
    registry = model_registry(settings)
    try:
        spec = registry.get(model)
    except ModelError as exc:
        owner = owner or (caller.name if caller is not None else None)
        own = store.get_adapter(owner, model) if store is not None and owner else None
        if own is None:
            raise ApiError(400, str(exc), param=param, code="unknown_model") from None
        if own.base not in registry.models:
            raise ApiError(400, f"your adapter {model!r} adapts {own.base!r}, which the model registry no longer "
                           "has: upload it again on a registered model", param=param, code="unknown_model") from None
        model, spec = own.base, registry.models[own.base]
    if endpoint in SUPPORTED_ENDPOINTS:
        _check_serves(endpoint, model, spec.task, spec.features, param)
    check_engine_would_start(model, model_config, settings, param)
    return model


def check_engine_would_start(model: str, model_config: dict[str, Any], settings: Settings, param: str = "model") -> None:
    """A 400 now for what the engine would refuse minutes later: a model not prepared, engine
    arguments its checkpoint rules out (``submission_problems``); only where the api-server
    sees the workers' model cache (``check_models_at_submit``)."""
    if not settings.check_models_at_submit:
        return
    config = validate_model_config({**model_config, "model": model})
    try:
        problems = submission_problems(config, model_registry(settings), settings)
    except ModelNotPrepared as exc:
        raise ApiError(400, str(exc), param=param, code="model_not_ready") from None
    except ModelError:
        return  # the checks above name registry problems; the rest is the worker's
    if problems:
        field, why = problems[0]
        raise ApiError(400, f"model_config.{field}: {why}", param=f"model_config.{field}", code="invalid_model_config")


_FEATURE_ENDPOINTS = frozenset(e.value for e in FEATURE_OF_ENDPOINT)


def _check_serves(endpoint: str, model: str, task: str, features: list[str], param: str) -> None:
    if (problem := serving_problem(endpoint, model, task, features)) is not None:
        raise ApiError(400, problem, param=param, code="model_endpoint_mismatch")


def _check_checkpoint(checkpoint: str, settings: Settings, caller: Caller | None) -> None:
    """A user's checkpoint_path: an s3:// prefix or an absolute local model directory the
    caller may name (llm_batch.infra.user_paths), or a folder of the shared model cache (relative),
    checked as the worker will check it, so a bad path fails here and not in the first shard."""
    param = "model_config.checkpoint_path"
    if storage.is_s3(checkpoint) or (caller is not None and checkpoint.startswith("/")):
        if caller is not None:
            checkpoint = check_user_path(checkpoint, param, settings, caller)
        if storage.is_s3(checkpoint):
            return
    try:
        check_local_checkpoint(checkpoint, settings)
    except ModelError as exc:
        raise ApiError(400, f"{param}: {exc}", param=param, code="invalid_checkpoint") from None


def check_user_path(uri: str, param: str, settings: Settings, caller: Caller) -> str:
    """A path the caller names, canonical (llm_batch.infra.user_paths), or 400 naming the rule it
    breaks; a path that is missing or hidden from the caller gets one answer for both."""
    try:
        return user_paths.check(uri, caller.name, settings, is_admin=caller.is_admin).uri
    except user_paths.PathRefused as exc:
        raise ApiError(400, f"{param}: {exc}", param=param, code="path_not_allowed") from None
    except user_paths.PathUnavailable as exc:
        raise path_unavailable(param, exc) from None


def check_input_readable(uri: str, given: str, param: str, settings: Settings, caller: Caller) -> None:
    """An input file a job names must exist and be readable now, not when its run validates
    it minutes later; a missing one gets the answer of a path hidden from the caller."""
    try:
        with storage.open_read(uri) as stream:
            stream.read(1)
    except storage.ObjectNotFound:
        raise path_unavailable(param, user_paths.unavailable(given, caller.name, settings)) from None
    except (storage.StorageError, OSError) as exc:
        raise ApiError(400, f"{param}: {given} cannot be read: {exc}", param=param, code="input_unreadable") from None


def path_unavailable(param: str, why: object) -> ApiError:
    """The answer for a path that is missing or that the caller may not see: the same."""
    return ApiError(400, f"{param}: {why}", param=param, code="path_unavailable")


# The label that lets a job replace an output file an earlier job of the same owner wrote.
OVERWRITE_LABEL = "llm-batch.io/overwrite-output"


def check_output_target(store: JobStore, caller: Caller, output_uri: str, labels: dict[str, Any],
                        param: str = "output_data_path") -> None:
    """An output never replaces a file its owner's jobs did not write, nor one that a job
    not yet ended will write: 409 naming the conflict (`param`: the route's field). An owner's
    own earlier output may be replaced only when the create says so (label OVERWRITE_LABEL = "true")."""
    writers = store.jobs_writing(output_uri)
    if busy := [j.id for j in writers if not j.terminal]:
        raise ApiError(409, f"{param}: {output_uri} is the output of a job not yet ended ({busy[0]})", param=param, code="output_in_use")
    if not storage.exists(output_uri):
        return
    if not any(j.owner == caller.name for j in writers):
        raise ApiError(409, f"{param}: {output_uri} already exists and no job of yours wrote it: name a new file",
                       param=param, code="output_exists")
    if str(labels.get(OVERWRITE_LABEL, "")).lower() != "true":
        raise ApiError(409, f"{param}: {output_uri} holds an earlier job's results: name a new file, or set the "
                       f"label {OVERWRITE_LABEL}=true to replace them", param=param, code="output_exists")


def check_input_files(store: JobStore, caller: Caller, file_ids: list[str], param: str) -> list[str]:
    """The ids of the caller's uploaded input files, in order; each named once (a repeated
    file would run its requests twice under the same custom_ids). `param`: the route's field."""
    first_position: dict[str, int] = {}
    for position, file_id in enumerate(file_ids):
        where = f"{param}[{position}]"
        if file_id in first_position:
            message = f"{where}: file {file_id!r} is already {param}[{first_position[file_id]}]; name each file once"
            raise ApiError(400, message, param=where, code="duplicate_input_file")
        first_position[file_id] = position
        found = store.get_file(file_id, owner=caller.owner_filter)
        if found is None:
            raise ApiError(404, f"No file found with id {file_id!r}.", param=where, code="not_found")
        if (why := input_files.refusal(found)) is not None:
            raise ApiError(400, f"{where}: {why}", param=where, code="invalid_input_file")
    return list(file_ids)


def inline_json(value: Any, param: str) -> bytes:
    """Inline content as JSON bytes, or 400 naming where it holds what JSON cannot carry:
    Python's JSON parser lets through lone surrogates, integers past 64 bits and NaN, which
    the pipeline's JSON (orjson) refuses, so they are caught here rather than as a 500."""
    problem = not_json(value, param)
    if problem is not None:
        code, message = problem
        raise ApiError(400, message, param=param, code=code.value)
    return orjson.dumps(value)


def inline_request_lines(requests: Iterable[Any]) -> Iterator[bytes]:
    """Inline requests (items with ``custom_id`` and ``body``) as batch JSONL lines; a missing
    custom_id is the item's 0-based position."""
    for index, item in enumerate(requests):
        custom_id = item.custom_id if item.custom_id is not None else str(index)
        yield inline_json({"custom_id": custom_id, "body": item.body}, f"requests[{index}]") + b"\n"


def save_inline_requests(
    store: JobStore, settings: Settings, owner: str, lines: Iterable[bytes], filename: str, **input_fields: Any
) -> JobInput:
    """Write inline requests (already serialised, one per item) to the files area, record
    them as an input file object of `owner`, and return the job's input reading it."""
    file_id = new_file_id()
    uri = join_uri(settings.files_uri, file_id)
    written = 0
    with storage.open_write(uri) as out:
        for line in lines:
            out.write(line)
            written += len(line)
    store.create_file(id=file_id, owner=owner, purpose="batch", filename=filename, bytes=written, uri=uri, kind="input")
    return JobInput(uri=uri, inline=True, inline_file_id=file_id, **input_fields)


def dag_conf(job: Job, request: JobRequest) -> dict[str, Any]:
    """The run's conf: the job id (the pipeline takes the job from the store) plus what its
    lane is chosen by and what the run does, as ids and counts under the DAG's Param names.
    Every Airflow viewer reads a run's conf: paths, labels and model configs stay in the store."""
    conf: dict[str, Any] = {
        "job_id": job.id,
        "input_file_ids": job.input.file_ids,
        "input_format": job.input_format,
        "endpoint": job.endpoint,
        "model": job.model,
        "data_parallelism": job.data_parallelism,
        "max_runtime_sec": job.max_runtime_sec,
        "priority": request.priority_name,
        "gpus": job.resources.get("gpus"),
        "gpu_type": job.resources.get("gpu_type"),
        "nodes_per_worker": job.resources.get("nodes_per_worker"),
    }
    return {key: value for key, value in conf.items() if value is not None}


def submit(store: JobStore, owner: str, request: JobRequest, trigger: Trigger) -> Job:
    """Create the job and start its run; returns the job (FAILED, with the reason, if the
    run could not be started)."""
    job = store.create_requested_job(request, owner)
    bind_job(job.id)  # this request's log lines from here on carry it
    try:
        run_id = trigger(job.id, dag_conf(job, request), job.created_at)
    except TriggerError as exc:
        return store.transition(job.id, JobStatus.FAILED, reason=str(exc))
    # The run may already have moved the job on; only the run id is ours to set.
    return store.set_dag_run(job.id, run_id)
