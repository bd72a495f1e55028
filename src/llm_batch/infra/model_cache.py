"""Where checkpoints live: the model cache (``Settings.model_cache``), registered models prepared
offline into it, ``s3://`` checkpoints fetched into it once, and the local directories a job may
name. A directory is built in a temporary one renamed into place with ``READY_MARKER`` (a crash
never leaves a half-built one that looks ready), under a file lock (concurrent shards build it once)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from filelock import FileLock

from llm_batch.core.config import Settings, get_settings
from llm_batch.core.model_config import ModelError
from llm_batch.core.model_recipes import RECIPES, MissingSource
from llm_batch.infra import storage
from llm_batch.infra.model_registry import (
    CheckpointNotAllowed,
    CheckpointNotFound,
    ModelNotPrepared,
    ModelSpec,
    Registry,
    load_registry,
)

READY_MARKER = ".llm-batch-ready.json"


def registered_checkpoint_dir(name: str, spec: ModelSpec, settings: Settings) -> Path:
    if spec.prepare is not None:
        path = cache_path(spec.checkpoint, settings)
        if not (path / READY_MARKER).is_file():
            raise ModelNotPrepared(f"model {name!r} is not prepared in {settings.model_cache}: "
                                   f"run `llm-batch models prepare {name}`")
        return path
    return checkpoint_dir(spec.checkpoint, settings, user_given=False)


def check_local_checkpoint(checkpoint: str, settings: Settings | None = None) -> Path:
    """A user's local ``checkpoint_path`` checked as the worker will (the API's check at
    submission; user_paths covers s3:// ones)."""
    if checkpoint.startswith("s3://"):
        raise ValueError("check_local_checkpoint takes local paths only")
    return checkpoint_dir(checkpoint, settings or get_settings(), user_given=True)


def checkpoint_dir(checkpoint: str, settings: Settings, *, user_given: bool) -> Path:
    """A local model directory for ``checkpoint`` (s3:// prefix, absolute or cache-relative)."""
    if checkpoint.startswith("s3://"):
        return fetch_checkpoint(checkpoint, settings=settings)
    if "://" in checkpoint:
        raise CheckpointNotFound(f"checkpoint {checkpoint}: only local paths and s3:// are supported")
    path = (user_local_dir(checkpoint, settings, "checkpoint") if user_given
            else cache_path(checkpoint, settings).resolve())
    if not (path / "config.json").is_file():
        raise CheckpointNotFound(f"checkpoint {checkpoint}: no model directory (config.json) at {path}")
    return path


def local_tokenizer_dir(tokenizer: str, settings: Settings | None = None) -> Path:
    """A job's ``model_config.tokenizer`` as a local directory, under a checkpoint_path's rules."""
    settings = settings or get_settings()
    if "://" in tokenizer:
        raise CheckpointNotAllowed(f"tokenizer {tokenizer}: only a local directory is supported")
    path = user_local_dir(tokenizer, settings, "tokenizer")
    if not path.is_dir():
        raise CheckpointNotFound(f"tokenizer {tokenizer}: no directory at {path}")
    return path


def cache_path(checkpoint: str, settings: Settings) -> Path:
    path = Path(checkpoint).expanduser()
    return path if path.is_absolute() else Path(settings.model_cache) / path


def user_local_dir(given: str, settings: Settings, what: str) -> Path:
    """A path a job gave, resolved (relative: in the model cache), within the local roots or
    the model cache; ``CheckpointNotAllowed`` naming ``what`` otherwise."""
    path = cache_path(given, settings).resolve()
    roots = [*settings.local_roots, Path(settings.model_cache).resolve()]
    if not any(path.is_relative_to(root) for root in roots):
        raise CheckpointNotAllowed(f"{what} {given}: outside the allowed local roots ({', '.join(map(str, roots))})")
    return path


def fetch_checkpoint(uri: str, *, settings: Settings | None = None, required: str = "config.json") -> Path:
    """Download the ``s3://`` prefix ``uri`` once into the model cache; return the directory.
    Other ``StorageError``s than a missing or forbidden prefix propagate: worth a retry."""
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
        if not (tmp / required).is_file():
            raise CheckpointNotFound(f"checkpoint {uri}: no {required} under this prefix")

    build_once(dest, {"source": uri}, download)
    return dest


def _s3_cache_dir(uri: str, settings: Settings) -> Path:
    parts = [p for p in uri.removeprefix("s3://").split("/") if p]
    if not parts or any(p in (".", "..") for p in parts):
        raise CheckpointNotFound(f"checkpoint {uri}: not a usable s3:// prefix")
    return Path(settings.model_cache, "s3", *parts)


def model_status(name: str, spec: ModelSpec, settings: Settings | None = None) -> str:
    """``ready``, ``not prepared``, ``stale`` (older source), ``remote`` or ``missing``."""
    settings = settings or get_settings()
    if spec.checkpoint.startswith("s3://"):
        ready = (_s3_cache_dir(spec.checkpoint, settings) / READY_MARKER).is_file()
        return "ready" if ready else "remote"
    path = cache_path(spec.checkpoint, settings)
    if spec.prepare is None:
        return "ready" if (path / "config.json").is_file() else "missing"
    marker = read_marker(path)
    if marker is None:
        return "not prepared"
    return "ready" if marker.get("source") == RECIPES[spec.prepare].source() else "stale"


def prepare_model(name: str, *, force: bool = False, registry: Registry | None = None,
                  settings: Settings | None = None) -> Path:
    """Build the registered model ``name`` with its offline recipe, unless built from the same source."""
    settings = settings or get_settings()
    spec = (registry or load_registry(settings=settings)).get(name)
    if spec.prepare is None:
        raise ModelError(f"model {name!r} has no offline recipe (its checkpoint is {spec.checkpoint})")
    if "://" in spec.checkpoint:
        raise ModelError(f"model {name!r}: a prepared model's checkpoint must be a local path")
    recipe = RECIPES[spec.prepare]
    dest = cache_path(spec.checkpoint, settings)
    marker = {"model": name, "recipe": spec.prepare, "source": recipe.source()}
    if not force and read_marker(dest) == marker:
        return dest
    try:
        build_once(dest, marker, recipe.build, replace=lambda: force or read_marker(dest) != marker)
    except MissingSource as exc:
        raise ModelError(f"model {name!r} cannot be prepared: {exc}") from None
    return dest


def read_marker(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads((path / READY_MARKER).read_text())
    except (OSError, ValueError):
        return None


def build_once(dest: Path, marker: dict[str, Any], build: Callable[[Path], object],
               replace: Callable[[], bool] | None = None) -> None:
    """Build ``dest`` with ``build(tmp_dir)`` under a file lock, then swap it into place.
    ``replace()`` (default: "dest is not ready") is checked once the lock is held, so a
    caller that waited on another's build does not build again."""
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
