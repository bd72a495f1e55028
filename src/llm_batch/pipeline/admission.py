"""Admission: the checks a new job passes whichever way it comes in, so every way in refuses
the same things with the same words (``Refused``: a status, the caller's name of the field,
a stable code).
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from pydantic import BaseModel, ValidationError

from llm_batch.core.config import Settings
from llm_batch.core.endpoints import (
    FEATURE_OF_ENDPOINT,
    SUPPORTED_ENDPOINTS,
    UnsupportedEndpointError,
    parse_endpoint,
    serving_problem,
)
from llm_batch.core.job_request import JobRequest
from llm_batch.core.job_spec import JobInput, JobOptions, JobSpec, spec_problem
from llm_batch.core.jobs import JobRejected, Refused
from llm_batch.core.model_config import ModelConfig, ModelError, job_model_config, validate_model_config
from llm_batch.core.placement import multi_node_refusal, priority_band
from llm_batch.core.run_conf import RunConf
from llm_batch.infra import input_files, storage, user_paths
from llm_batch.infra.model_cache import check_local_checkpoint, local_tokenizer_dir
from llm_batch.infra.model_registry import ModelNotPrepared, Registry, load_registry
from llm_batch.infra.model_resolution import check_model_config, submission_problems

if TYPE_CHECKING:
    from llm_batch.infra.jobstore import AdapterRepository, FileRepository, JobRepository, JobStore, UsageRepository


class Principal(Protocol):
    """Who a job is admitted for: its owner, and whether it may name anyone's paths and files."""

    @property
    def name(self) -> str: ...

    @property
    def is_admin(self) -> bool: ...


class Owner:
    """A run's owner as a Principal (``is_admin``: a trusted run)."""

    def __init__(self, name: str, is_admin: bool = False):
        self.name, self.is_admin = name, is_admin


def priority_weight(settings: Settings, priority: str | int | None) -> int:
    """A priority (a band's name, or a number: the band at or below it) -> the stored weight."""
    if priority is None:
        return 0
    if priority in settings.priority_weights:
        return settings.priority_weights[priority]
    if isinstance(priority, int):
        return settings.priority_weights[priority_band(settings, priority)]
    known = ", ".join(sorted(settings.priority_weights))
    raise Refused(400, f"priority {priority!r} is unknown; use one of: {known}", param="priority",
                  code="invalid_priority")


Spec = TypeVar("Spec", bound=BaseModel)


def parse_spec(model: type[Spec], given: dict[str, Any]) -> Spec:
    """`given` as `model`, or Refused naming the first problem (``spec_problem``)."""
    try:
        return model.model_validate(given)
    except ValidationError as exc:
        where, why = spec_problem(exc)
        raise Refused(400, why, param=where or None, code="invalid_spec") from None


def one_input(given: dict[str, Any], param: str | None = None) -> str:
    """The name of the one input given (None, "" and [] are not given), else Refused."""
    named = [name for name, value in given.items() if value not in (None, "", [])]
    if len(named) != 1:
        raise Refused(400, f"give exactly one of {', '.join(given)} (got {', '.join(named) or 'none'})",
                      param=param or next(iter(given)), code="invalid_input")
    return named[0]


def admit(spec: JobSpec, given: JobInput, principal: Principal, store: JobStore, settings: Settings, *,
          job_id: str | None = None, words: Mapping[str, str] | None = None,
          resources: dict[str, Any] | None = None) -> JobRequest:
    """The job `principal` asks for, as the store creates it, or Refused naming the first
    problem. `words`: the way in's names of fields, where they differ, for a refusal's param.
    `resources`: as the caller named them (Scale's); the model's parallel sizes are checked
    against named GPUs only (None: the spec's, whose default of one GPU says nothing)."""
    words = words or {}
    named = resources or {}
    if resources is None:
        resources = {"gpus": spec.gpus, "gpu_type": spec.gpu_type, "nodes_per_worker": spec.nodes_per_worker}
    check_owner_limits(store, settings, principal, new_jobs=1, new_requests=len(given.requests or []))
    try:
        endpoint = parse_endpoint(spec.endpoint).value
    except UnsupportedEndpointError as exc:
        raise Refused(400, str(exc), param="endpoint", code="unsupported_endpoint") from None
    config = parse_model_config({**spec.engine_config, "model": spec.model})
    runs_on = check_model(spec.model, config, settings, words.get("model", "model"), endpoint, principal, store)
    if config.tokenizer:
        config = config.model_copy(update={"tokenizer": _check_tokenizer(config.tokenizer, settings, principal)})
    try:
        # An owner's own adapter is checked as its base (the registry has its entry).
        check_model_config(config.model_copy(update={"model": runs_on}), model_registry(settings),
                           gpus=named.get("gpus"), nodes=named.get("nodes_per_worker"))
    except ModelError as exc:
        raise _model_config_refusal(exc) from None
    weight = priority_weight(settings, spec.priority)
    if (refusal := multi_node_refusal(spec.nodes_per_worker, settings.shard_runner)) is not None:
        raise Refused(400, refusal, param="nodes_per_worker", code="unsupported_resources")
    if given.file_ids:
        check_input_files(store, principal, given.file_ids, words.get("input_file_ids", "input_file_ids"))
    input_uri, output_uri = check_paths(store, settings, principal, given.uri, spec.output_uri, spec.labels, words)
    return JobRequest(
        id=job_id,
        endpoint=endpoint,
        model=spec.model,
        input=given.model_copy(update={"uri": input_uri, **dict(spec.part(JobOptions))}),
        input_format=spec.input_format,
        model_config=job_model_config(config),
        output_uri=output_uri,
        metadata=spec.metadata,
        labels=spec.labels,
        priority=weight,
        priority_name=None if spec.priority is None else priority_band(settings, spec.priority),
        data_parallelism=spec.data_parallelism,
        resources=resources,
        max_runtime_sec=spec.max_runtime_sec or settings.default_max_runtime_sec,
    )


def parse_model_config(model_config: dict[str, Any] | ModelConfig) -> ModelConfig:
    """The typed model_config (once per way in), or Refused naming its first bad field."""
    try:
        return validate_model_config(model_config)
    except ModelError as exc:
        raise _model_config_refusal(exc) from None


def _model_config_refusal(exc: ModelError) -> Refused:
    fields = getattr(exc, "fields", ())
    param = "gpus" if fields[:1] == ("gpus",) else f"model_config.{fields[0]}" if fields else "model_config"
    return Refused(400, str(exc), param=param, code="invalid_model_config")


def admit_run(conf: Mapping[str, Any], owner: str, trusted: bool, store: JobStore, settings: Settings, *,
              job_id: str | None = None) -> JobRequest:
    """A batch DAG run's conf (the trigger form's, ``/api/v2``'s, a schedule's) as the job it
    asks for: its one input, its spec, then ``admit``. The API server asks it before Airflow
    makes the run (the form's error), the register step again (every run passes there)."""
    one_input({name: conf.get(name) for name in ("input_uri", "input_file_ids", "input_requests")})
    run = parse_spec(RunConf, dict(conf))
    return admit(run.part(JobSpec), run.job_input(), Owner(owner, trusted), store, settings, job_id=job_id)


def refusal_text(exc: JobRejected) -> str:
    """A refusal as one line that says where (``param: why``), as a run's note and the form show it."""
    reason = str(exc)
    if isinstance(exc, Refused) and exc.param and not reason.startswith(exc.param):
        reason = f"{exc.param}: {reason}"
    return reason


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
    model_config: dict[str, Any] | ModelConfig,
    settings: Settings,
    param: str = "model",
    endpoint: str | None = None,
    principal: Principal | None = None,
    store: AdapterRepository | None = None,
    owner: str | None = None,
) -> str:
    """The model checked as the worker will check it (its model_config, its checkpoint_path,
    registered or the owner's adapter, able to serve `endpoint`), so a bad one fails here and
    not in the first shard. Returns the model the job runs on (an adapter's base)."""
    if not model:
        raise Refused(400, "a model is required", param=param, code="missing_model")
    given = model_config if isinstance(model_config, ModelConfig) else {**model_config, "model": model}
    config = parse_model_config(given)
    if checkpoint := config.checkpoint_path:
        _check_checkpoint(str(checkpoint), settings, principal)
        # The task of a checkpoint outside the registry is known only when it loads; an
        # endpoint that needs a registry feature (a FIM template) needs a registered name.
        if endpoint in _FEATURE_ENDPOINTS:
            spec = model_registry(settings).models.get(model)
            _check_serves(endpoint, model, spec.task if spec else "generate", spec.features if spec else [], param)
        check_engine_would_start(config, settings, param)
        return model
    registry = model_registry(settings)
    try:
        spec = registry.get(model)
    except ModelError as exc:
        owner = owner or (principal.name if principal is not None else None)
        own = store.get_adapter(owner, model) if store is not None and owner else None
        if own is None:
            raise Refused(400, str(exc), param=param, code="unknown_model") from None
        if own.base not in registry.models:
            raise Refused(400, f"your adapter {model!r} adapts {own.base!r}, which the model registry no longer "
                           "has: upload it again on a registered model", param=param, code="unknown_model") from None
        model, spec = own.base, registry.models[own.base]
    if endpoint in SUPPORTED_ENDPOINTS:
        _check_serves(endpoint, model, spec.task, spec.features, param)
    check_engine_would_start(config.model_copy(update={"model": model}), settings, param)
    return model


def check_engine_would_start(config: ModelConfig, settings: Settings, param: str = "model") -> None:
    """A 400 now for what the engine would refuse later (where the server sees the model cache)."""
    if not settings.check_models_at_submit:
        return
    try:
        problems = submission_problems(config, model_registry(settings), settings)
    except ModelNotPrepared as exc:
        raise Refused(400, str(exc), param=param, code="model_not_ready") from None
    except ModelError:
        return  # the checks above name registry problems; the rest is the worker's
    if problems:
        field, why = problems[0]
        raise Refused(400, f"model_config.{field}: {why}", param=f"model_config.{field}", code="invalid_model_config")


_FEATURE_ENDPOINTS = frozenset(e.value for e in FEATURE_OF_ENDPOINT)


def _check_serves(endpoint: str, model: str, task: str, features: list[str], param: str) -> None:
    if (problem := serving_problem(endpoint, model, task, features)) is not None:
        raise Refused(400, problem, param=param, code="model_endpoint_mismatch")


def _check_checkpoint(checkpoint: str, settings: Settings, principal: Principal | None) -> None:
    """A checkpoint_path: s3:// or absolute under the user's paths, or relative in the model cache."""
    param = "model_config.checkpoint_path"
    if storage.is_s3(checkpoint) or (principal is not None and checkpoint.startswith("/")):
        if principal is not None:
            checkpoint = check_user_path(checkpoint, param, settings, principal)
        if storage.is_s3(checkpoint):
            return
    try:
        check_local_checkpoint(checkpoint, settings)
    except ModelError as exc:
        raise Refused(400, f"{param}: {exc}", param=param, code="invalid_checkpoint") from None


def _check_tokenizer(tokenizer: str, settings: Settings, principal: Principal) -> str:
    """model_config.tokenizer under checkpoint_path's rules, canonical."""
    param = "model_config.tokenizer"
    if tokenizer.startswith("/"):
        tokenizer = check_user_path(tokenizer, param, settings, principal)
    try:
        local_tokenizer_dir(tokenizer, settings)
    except ModelError as exc:
        raise Refused(400, f"{param}: {exc}", param=param, code="invalid_tokenizer") from None
    return tokenizer


def check_user_path(uri: str, param: str, settings: Settings, principal: Principal) -> str:
    """A path the principal names, canonical, or 400 naming the rule it breaks."""
    try:
        return user_paths.check(uri, principal.name, settings, is_admin=principal.is_admin).uri
    except user_paths.PathRefused as exc:
        raise Refused(400, f"{param}: {exc}", param=param, code="path_not_allowed") from None
    except user_paths.PathUnavailable as exc:
        raise path_unavailable(param, exc) from None


def check_input_readable(uri: str, given: str, param: str, settings: Settings, principal: Principal,
                         head: int = 1) -> bytes:
    """An input file must be readable now, not only when its run validates it: its first `head` bytes."""
    try:
        with storage.open_read(uri) as stream:
            return stream.read(head)
    except storage.ObjectNotFound:
        raise path_unavailable(param, user_paths.unavailable(given, principal.name, settings)) from None
    except (storage.StorageError, OSError) as exc:
        raise Refused(400, f"{param}: {given} cannot be read: {exc}", param=param, code="input_unreadable") from None


def path_unavailable(param: str, why: object) -> Refused:
    """The answer for a path that is missing or that the principal may not see: the same."""
    return Refused(400, f"{param}: {why}", param=param, code="path_unavailable")


# The label that lets a job replace an output file an earlier job of the same owner wrote.
OVERWRITE_LABEL = "llm-batch.io/overwrite-output"


def check_output_target(store: JobRepository, principal: Principal, output_uri: str, labels: dict[str, Any],
                        param: str = "output_data_path") -> None:
    """409 unless the output is new, or the owner's ended job's and labelled OVERWRITE_LABEL=true."""
    writers = store.jobs_writing(output_uri)
    if busy := [j.id for j in writers if not j.terminal]:
        raise Refused(409, f"{param}: {output_uri} is the output of a job not yet ended ({busy[0]})", param=param, code="output_in_use")
    if not storage.exists(output_uri):
        return
    if not any(j.owner == principal.name for j in writers):
        raise Refused(409, f"{param}: {output_uri} already exists and no job of yours wrote it: name a new file",
                       param=param, code="output_exists")
    if str(labels.get(OVERWRITE_LABEL, "")).lower() != "true":
        raise Refused(409, f"{param}: {output_uri} holds an earlier job's results: name a new file, or set the "
                       f"label {OVERWRITE_LABEL}=true to replace them", param=param, code="output_exists")


def check_input_files(store: FileRepository, principal: Principal, file_ids: list[str], param: str) -> list[str]:
    """The principal's input file ids, each named once (a repeat would run its lines twice)."""
    first_position: dict[str, int] = {}
    for position, file_id in enumerate(file_ids):
        where = f"{param}[{position}]"
        if file_id in first_position:
            message = f"{where}: file {file_id!r} is already {param}[{first_position[file_id]}]; name each file once"
            raise Refused(400, message, param=where, code="duplicate_input_file")
        first_position[file_id] = position
        found = store.get_file(file_id, owner=None if principal.is_admin else principal.name)
        if found is None:
            raise Refused(404, f"No file found with id {file_id!r}.", param=where, code="not_found")
        if (why := input_files.refusal(found)) is not None:
            raise Refused(400, f"{where}: {why}", param=where, code="invalid_input_file")
    return list(file_ids)


def check_paths(store: JobStore, settings: Settings, principal: Principal, input_uri: str | None,
                output_uri: str | None, labels: dict[str, Any],
                words: Mapping[str, str] | None = None) -> tuple[str | None, str | None]:
    """A job's input_uri and output_uri, canonical and checked (`words`: as in ``admit``)."""
    input_param, output_param = ((words or {}).get(name, name) for name in ("input_uri", "output_uri"))
    canonical_input = check_user_path(input_uri, input_param, settings, principal) if input_uri else None
    if canonical_input is not None:
        check_input_readable(canonical_input, input_uri, input_param, settings, principal)
    if output_uri is None:
        return canonical_input, None
    canonical_output = check_user_path(output_uri, output_param, settings, principal)
    if canonical_output == canonical_input:
        raise Refused(400, f"{output_param} is the {input_param}: the results would overwrite the requests",
                      param=output_param, code="invalid_output")
    check_output_object(canonical_output, output_param)
    check_output_target(store, principal, canonical_output, labels, param=output_param)
    return canonical_input, canonical_output


def check_output_object(output_uri: str, param: str) -> None:
    """The output must name an object the job can write at its end, not a bucket or a folder."""
    def refuse(why: str) -> Refused:
        return Refused(400, f"{param} {output_uri!r} {why}", param=param, code="invalid_output")

    if storage.is_s3(output_uri):
        key = output_uri[5:].partition("/")[2]
        if not key or key.endswith("/"):
            raise refuse("names a bucket or folder, not an object: name the file to write")
        return
    path = Path(output_uri)
    if path.is_dir():
        raise refuse("is a directory; name the file to write")
    existing = next(parent for parent in path.parents if parent.exists())
    if not existing.is_dir():
        raise refuse(f"lies below {str(existing)!r}, which is a file, not a directory")


# Per-owner limits (0: none; admins are not held to them): name -> (usage measure, its words)
_LIMITS = {
    "max_live_jobs": ("live_jobs", "jobs not yet ended"),
    "max_requests_in_flight": ("requests_in_flight", "requests in jobs not yet ended"),
    "max_file_bytes": ("file_bytes", "bytes of stored files and adapters"),
}


def check_owner_limits(
    store: UsageRepository, settings: Settings, principal: Principal, *, new_jobs: int = 0, new_requests: int = 0,
    new_bytes: int = 0,
) -> None:
    """429 if what the owner holds plus what this call adds passes one of their limits."""
    if principal.is_admin:
        return
    usage = store.owner_usage(principal.name)
    adding = {"live_jobs": new_jobs, "requests_in_flight": new_requests, "file_bytes": new_bytes}
    for name, (measure, words) in _LIMITS.items():
        limit = int(settings.owner_limits.get(principal.name, {}).get(name, getattr(settings, f"owner_{name}")))
        if limit and adding[measure] and usage[measure] + adding[measure] > limit:
            raise Refused(
                429,
                f"limit {name} of owner {principal.name!r} exceeded: {usage[measure]} {words} held, "
                f"{adding[measure]} more asked, limit {limit} (set by an admin: LLM_BATCH_OWNER_LIMITS)",
                param=name,
                code="limit_exceeded",
            )
