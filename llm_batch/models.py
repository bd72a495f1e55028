"""The model registry, and turning a job's ``model_config`` into vLLM engine arguments.

    load_registry(path=None) -> Registry          the YAML registry (Settings.model_registry
                                                  or the packaged models.yaml)
    resolve_model(model_config) -> ResolvedModel  a local checkpoint dir + vllm.LLM kwargs
    validate_model_config(model_config)           the fields only (for the API, at submit)
    prepare_model(name) -> Path                   build a registered model in the model cache
    build_tiny_llama(dest) -> Path                the tiny random Llama of the tests

``model_config`` uses Scale's field names (model, checkpoint_path, num_shards,
max_context_length, seed, response_role) plus ``dtype`` and ``engine_args`` (extra vLLM
arguments, merged last). Everything that can be wrong with it (an unknown model, a model
not prepared, a missing checkpoint) is raised as a ``ModelError`` before any engine loads.

A checkpoint directory is ready when it holds the marker file ``READY_MARKER``; the marker
is written into a temporary directory that is then renamed into place, so a crash never
leaves a half-built directory that looks ready. A file lock beside each directory makes
concurrent shards on one machine fetch or build it once.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml
from filelock import FileLock
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from llm_batch.config import Settings, get_settings
from llm_batch.model_recipes import RECIPES, MissingSource, build_tiny_llama

__all__ = [
    "ModelError",
    "UnknownModel",
    "ModelNotPrepared",
    "CheckpointNotFound",
    "CheckpointNotAllowed",
    "InvalidModelConfig",
    "ModelSpec",
    "Registry",
    "ModelConfig",
    "ResolvedModel",
    "load_registry",
    "validate_model_config",
    "resolve_model",
    "prepare_model",
    "model_status",
    "fetch_checkpoint",
    "build_tiny_llama",
    "READY_MARKER",
    "JOB_FORBIDDEN_ENGINE_ARGS",
]

READY_MARKER = ".llm-batch-ready.json"
# Engine args a job may not set: they name files or code to load, or credentials. The
# registry (written by the operator) may set any of them.
JOB_FORBIDDEN_ENGINE_ARGS = frozenset({
    "model", "tokenizer", "trust_remote_code", "download_dir", "load_format",
    "model_loader_extra_config", "hf_token", "allowed_local_media_path",
    "allowed_media_domains", "speculative_config", "worker_cls", "worker_extension_cls",
    "distributed_executor_backend", "kv_transfer_config", "kv_events_config",
})
PACKAGED_REGISTRY = "models.yaml"


class ModelError(Exception):
    """The model of a job cannot be used; the message says why and what to do."""


class UnknownModel(ModelError, LookupError):
    """The name is not in the registry and no checkpoint_path was given."""


class ModelNotPrepared(ModelError):
    """A registered model whose offline recipe has not run on this machine yet."""


class CheckpointNotFound(ModelError):
    """A checkpoint location that holds no model directory."""


class CheckpointNotAllowed(ModelError):
    """A checkpoint outside the allowed local roots or buckets, or one we may not read."""


class InvalidModelConfig(ModelError, ValueError):
    """A model_config (or registry file) that does not validate."""


# --- the registry ---------------------------------------------------------------------


class ModelSpec(BaseModel):
    """One registry entry."""

    model_config = ConfigDict(extra="forbid")

    checkpoint: str = Field(min_length=1)
    task: Literal["generate", "embed"]
    engine_args: dict[str, Any] = Field(default_factory=dict)
    prepare: Literal["smollm2-gguf", "minilm-package", "tiny-random-llama"] | None = None
    description: str = ""


class Registry(BaseModel):
    """The whole registry file: the models and which of them are the defaults."""

    model_config = ConfigDict(extra="forbid")

    default_chat_model: str
    default_embedding_model: str
    models: dict[str, ModelSpec]

    @model_validator(mode="after")
    def _defaults_are_registered(self) -> Registry:
        for default in (self.default_chat_model, self.default_embedding_model):
            if default not in self.models:
                raise ValueError(f"default model {default!r} is not among the models")
        return self

    @property
    def default_models(self) -> list[str]:
        return [self.default_chat_model, self.default_embedding_model]

    def get(self, name: str) -> ModelSpec:
        """The entry for ``name``; ``UnknownModel`` listing the known names otherwise."""
        try:
            return self.models[name]
        except KeyError:
            raise UnknownModel(
                f"unknown model {name!r}: known models are {', '.join(sorted(self.models))}"
                " (or give model_config.checkpoint_path)"
            ) from None


def load_registry(path: Path | None = None, settings: Settings | None = None) -> Registry:
    """Read the registry from ``path``, else Settings.model_registry, else the packaged file."""
    path = path or (settings or get_settings()).model_registry
    if path is None:
        text = resources.files("llm_batch").joinpath(PACKAGED_REGISTRY).read_text()
        where = f"<package llm_batch>/{PACKAGED_REGISTRY}"
    else:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise InvalidModelConfig(f"model registry {path}: {exc.strerror}") from None
        where = str(path)
    try:
        return Registry.model_validate(yaml.safe_load(text))
    except yaml.YAMLError as exc:
        raise InvalidModelConfig(f"model registry {where}: not valid YAML: {exc}") from None
    except ValidationError as exc:
        raise InvalidModelConfig(f"model registry {where}: {_describe(exc)}") from None


# --- a job's model_config -------------------------------------------------------------


class ModelConfig(BaseModel):
    """A job's model_config: Scale's field names, plus dtype and extra engine args."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    checkpoint_path: str | None = None
    num_shards: int | None = Field(default=None, ge=1)
    max_context_length: int | None = Field(default=None, ge=1)
    seed: int | None = None
    response_role: str | None = None
    dtype: str | None = None
    # Scale's v1 client always sends it (usually null); vLLM calls it quantization.
    quantize: Literal["bitsandbytes", "awq"] | None = None
    engine_args: dict[str, Any] = Field(default_factory=dict)
    # Scale v1 puts job labels here; they describe the job, not the engine.
    labels: dict[str, str] = Field(default_factory=dict)

    @field_validator("engine_args", "labels", mode="before")
    @classmethod
    def _null_is_empty(cls, value: Any) -> Any:
        return {} if value is None else value

    @field_validator("engine_args")
    @classmethod
    def _only_safe_engine_args(cls, value: dict[str, Any]) -> dict[str, Any]:
        forbidden = sorted(JOB_FORBIDDEN_ENGINE_ARGS.intersection(value))
        if forbidden:
            hint = " (use checkpoint_path)" if "model" in forbidden else ""
            raise ValueError(
                f"{', '.join(forbidden)} may not be set by a job{hint}; "
                "the model registry may set it"
            )
        return value


@dataclass(frozen=True)
class ResolvedModel:
    """What the worker needs to start an engine: ``vllm.LLM(**engine_args)``."""

    name: str
    path: Path
    task: Literal["generate", "embed"]
    engine_args: dict[str, Any] = field(default_factory=dict)
    response_role: str = "assistant"


def resolve_model(
    model_config: dict[str, Any] | ModelConfig,
    *,
    registry: Registry | None = None,
    settings: Settings | None = None,
) -> ResolvedModel:
    """Turn a job's model_config into a local checkpoint directory and engine arguments.

    Engine args are merged in this order (later wins): seed=0, the registry's defaults, the
    Scale fields (num_shards -> tensor_parallel_size, max_context_length -> max_model_len,
    seed, dtype, quantize -> quantization), enforce_eager=True when Settings or
    LLM_BATCH_ENFORCE_EAGER say so, then ``engine_args``; ``model`` is always the local
    checkpoint directory. An ``s3://``
    checkpoint is downloaded once into the model cache. Raises ``ModelError`` subclasses for
    anything wrong with the job's model (not worth a retry); only a storage failure while
    downloading (``StorageError``) escapes as itself.
    """
    settings = settings or get_settings()
    config = validate_model_config(model_config)
    spec = _spec_for(config, registry or load_registry(settings=settings))

    if config.checkpoint_path:
        path = _checkpoint_dir(config.checkpoint_path, settings, user_given=True)
    else:
        path = _registered_checkpoint_dir(config.model, spec, settings)

    engine_args: dict[str, Any] = {"seed": 0, **(spec.engine_args if spec else {})}
    engine_args.update(_scale_engine_args(config))
    if _enforce_eager(settings):
        engine_args["enforce_eager"] = True
    engine_args.update(config.engine_args)
    engine_args["model"] = str(path)

    return ResolvedModel(
        name=config.model,
        path=path,
        task=spec.task if spec else _task_of(engine_args),
        engine_args=engine_args,
        response_role=config.response_role or "assistant",
    )


def validate_model_config(model_config: dict[str, Any] | ModelConfig) -> ModelConfig:
    """The parsed model_config, or ``InvalidModelConfig`` naming each bad field.

    Touches no file and no registry: cheap enough for the API to call at submission, so a
    bad model_config is refused there rather than failing the job's first shard.
    """
    if isinstance(model_config, ModelConfig):
        return model_config
    try:
        return ModelConfig.model_validate(model_config)
    except ValidationError as exc:
        message = _describe(exc, "model_config")
        raise InvalidModelConfig(f"invalid model_config: {message}") from None


def _spec_for(config: ModelConfig, registry: Registry) -> ModelSpec | None:
    """The registry entry; a model outside the registry is fine only with a checkpoint."""
    if config.model in registry.models:
        return registry.models[config.model]
    if config.checkpoint_path:
        return None
    return registry.get(config.model)  # raises UnknownModel with the known names


def _scale_engine_args(config: ModelConfig) -> dict[str, Any]:
    mapped = {
        "tensor_parallel_size": config.num_shards,
        "max_model_len": config.max_context_length,
        "seed": config.seed,
        "dtype": config.dtype,
        "quantization": config.quantize,
    }
    return {key: value for key, value in mapped.items() if value is not None}


def _enforce_eager(settings: Settings) -> bool:
    return settings.enforce_eager


def _task_of(engine_args: dict[str, Any]) -> Literal["generate", "embed"]:
    return "embed" if engine_args.get("runner") == "pooling" else "generate"


# --- where checkpoints live -----------------------------------------------------------


def _registered_checkpoint_dir(name: str, spec: ModelSpec, settings: Settings) -> Path:
    if spec.prepare is not None:
        path = _cache_path(spec.checkpoint, settings)
        if not (path / READY_MARKER).is_file():
            raise ModelNotPrepared(
                f"model {name!r} is not prepared in {settings.model_cache}: "
                f"run `llm-batch models prepare {name}`"
            )
        return path
    return _checkpoint_dir(spec.checkpoint, settings, user_given=False)


def check_local_checkpoint(checkpoint: str, settings: Settings | None = None) -> Path:
    """A user's local ``checkpoint_path`` checked as the worker will check it (confined to
    the roots or the model cache, a model directory): the API calls it at submission.
    s3:// checkpoints are not fetched here; storage.check_user_uri covers them."""
    if checkpoint.startswith("s3://"):
        raise ValueError("check_local_checkpoint takes local paths only")
    return _checkpoint_dir(checkpoint, settings or get_settings(), user_given=True)


def _checkpoint_dir(checkpoint: str, settings: Settings, *, user_given: bool) -> Path:
    """A local model directory for ``checkpoint`` (s3:// prefix, absolute or cache-relative)."""
    if checkpoint.startswith("s3://"):
        return fetch_checkpoint(checkpoint, settings=settings)
    if "://" in checkpoint:
        raise CheckpointNotFound(
            f"checkpoint {checkpoint}: only local paths and s3:// are supported"
        )
    path = _cache_path(checkpoint, settings).resolve()
    if user_given:
        _confine(path, [*settings.local_roots, Path(settings.model_cache).resolve()], checkpoint)
    if not (path / "config.json").is_file():
        raise CheckpointNotFound(
            f"checkpoint {checkpoint}: no model directory (config.json) at {path}"
        )
    return path


def _cache_path(checkpoint: str, settings: Settings) -> Path:
    path = Path(checkpoint).expanduser()
    return path if path.is_absolute() else Path(settings.model_cache) / path


def _confine(path: Path, roots: list[Path], shown: str) -> None:
    if not any(path.is_relative_to(root) for root in roots):
        raise CheckpointNotAllowed(
            f"checkpoint {shown}: outside the allowed local roots "
            f"({', '.join(str(root) for root in roots)})"
        )


def fetch_checkpoint(uri: str, *, settings: Settings | None = None) -> Path:
    """Download the ``s3://`` prefix ``uri`` once into the model cache; return the directory.

    Concurrent callers on one machine (shards) wait on a file lock; the first downloads into
    a temporary directory, marks it ready and renames it into place, the others reuse it.
    A missing prefix is ``CheckpointNotFound``, a forbidden one ``CheckpointNotAllowed``;
    other ``StorageError``s (the server failing after retries) propagate: worth a retry.
    """
    from llm_batch import storage  # the implementation, imported when a download is needed

    dest = _s3_cache_dir(uri, settings or get_settings())
    if (dest / READY_MARKER).is_file():
        return dest

    def download(tmp: Path) -> None:
        try:
            storage.download_dir(uri.rstrip("/") + "/", tmp)
        except storage.ObjectNotFound as exc:
            raise CheckpointNotFound(f"checkpoint {uri}: {exc}") from None
        except (storage.PathNotAllowed, storage.AccessDenied) as exc:
            raise CheckpointNotAllowed(f"checkpoint {uri}: {exc}") from None
        if not (tmp / "config.json").is_file():
            raise CheckpointNotFound(f"checkpoint {uri}: no config.json under this prefix")

    _build_once(dest, {"source": uri}, download)
    return dest


def _s3_cache_dir(uri: str, settings: Settings) -> Path:
    """Where the s3:// prefix ``uri`` lives in the model cache: models/s3/<bucket>/<key>."""
    parts = [p for p in uri.removeprefix("s3://").split("/") if p]
    if not parts or any(p in (".", "..") for p in parts):
        raise CheckpointNotFound(f"checkpoint {uri}: not a usable s3:// prefix")
    return Path(settings.model_cache, "s3", *parts)


# --- offline preparation --------------------------------------------------------------


def model_status(name: str, spec: ModelSpec, settings: Settings | None = None) -> str:
    """``ready``, ``not prepared``, ``stale`` (older source), ``remote`` or ``missing``."""
    settings = settings or get_settings()
    if spec.checkpoint.startswith("s3://"):
        ready = (_s3_cache_dir(spec.checkpoint, settings) / READY_MARKER).is_file()
        return "ready" if ready else "remote"
    path = _cache_path(spec.checkpoint, settings)
    if spec.prepare is None:
        return "ready" if (path / "config.json").is_file() else "missing"
    marker = _read_marker(path)
    if marker is None:
        return "not prepared"
    return "ready" if marker.get("source") == RECIPES[spec.prepare].source() else "stale"


def prepare_model(
    name: str,
    *,
    force: bool = False,
    registry: Registry | None = None,
    settings: Settings | None = None,
) -> Path:
    """Build the registered model ``name`` in the model cache with its offline recipe.

    Idempotent: a directory whose marker names the same source is left alone (this check
    imports nothing heavy, so it is fast). Otherwise the recipe builds into a temporary
    directory that replaces the old one in one rename. Returns the model directory.
    """
    settings = settings or get_settings()
    spec = (registry or load_registry(settings=settings)).get(name)
    if spec.prepare is None:
        raise ModelError(
            f"model {name!r} has no offline recipe (its checkpoint is {spec.checkpoint})"
        )
    if "://" in spec.checkpoint:
        raise ModelError(f"model {name!r}: a prepared model's checkpoint must be a local path")
    recipe = RECIPES[spec.prepare]
    dest = _cache_path(spec.checkpoint, settings)
    marker = {"model": name, "recipe": spec.prepare, "source": recipe.source()}
    if not force and _marker_matches(dest, marker):
        return dest
    try:
        _build_once(
            dest, marker, recipe.build, replace=lambda: force or not _marker_matches(dest, marker)
        )
    except MissingSource as exc:
        raise ModelError(f"model {name!r} cannot be prepared: {exc}") from None
    return dest


def _read_marker(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads((path / READY_MARKER).read_text())
    except (OSError, ValueError):
        return None


def _marker_matches(path: Path, marker: dict[str, Any]) -> bool:
    return _read_marker(path) == marker


def _build_once(
    dest: Path,
    marker: dict[str, Any],
    build: Callable[[Path], object],
    replace: Callable[[], bool] | None = None,
) -> None:
    """Build ``dest`` with ``build(tmp_dir)`` under a file lock, then swap it into place.

    ``replace()`` (default: "dest is not ready") is re-checked once the lock is held, so a
    caller that waited on another's build does not build again.
    """
    replace = replace or (lambda: not (dest / READY_MARKER).is_file())
    dest.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(dest.parent / f".{dest.name}.lock")):
        if not replace():
            return
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{dest.name}-", dir=dest.parent))
        try:
            build(tmp)
            (tmp / READY_MARKER).write_text(json.dumps(marker, sort_keys=True) + "\n")
            _readable_by_all(tmp)
            _swap_into_place(tmp, dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def _readable_by_all(root: Path) -> None:
    """mkdtemp and safetensors make private files; a shared cache is read by other users."""
    for path in [root, *root.rglob("*")]:
        if not path.is_symlink():
            extra = 0o555 if path.is_dir() else 0o444
            path.chmod(path.stat().st_mode | extra)


def _swap_into_place(new: Path, dest: Path) -> None:
    old = None
    if dest.exists() or dest.is_symlink():
        old = dest.with_name(f".old-{dest.name}-{os.getpid()}")
        dest.rename(old)
    new.rename(dest)
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)


def _describe(exc: ValidationError, prefix: str = "") -> str:
    """Pydantic errors as ``prefix.field.path: message; ...`` for people."""
    return "; ".join(
        f"{'.'.join([prefix, *(str(p) for p in err['loc'])]).strip('.') or '(top level)'}: "
        f"{'unknown field' if err['type'] == 'extra_forbidden' else err['msg']}"
        for err in exc.errors()
    )
