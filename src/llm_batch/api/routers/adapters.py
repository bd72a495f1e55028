"""An owner's own LoRA adapters: ``/v1/adapters`` (upload, list, get, delete). Nobody else sees or
can name one: another owner's adapter is as unknown as a made-up name."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Annotated, BinaryIO, Literal

from fastapi import APIRouter, File, Form, Request, UploadFile
from fastapi import Path as PathParam
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel, Field

from llm_batch.api.auth import Caller, CallerDep
from llm_batch.api.errors import ApiError
from llm_batch.api.file_models import epoch
from llm_batch.api.state import SettingsDep, StoreDep
from llm_batch.api.uploads import some_ids
from llm_batch.core.config import Settings
from llm_batch.core.layout import join_uri
from llm_batch.core.model_choice import ADAPTER_NAME
from llm_batch.core.model_config import ModelError
from llm_batch.infra import storage
from llm_batch.infra.adapters import (
    ADAPTER_FILES,
    AdapterRefused,
    AdapterTooLarge,
    check_adapter_dir,
    resolve_base_dir,
    unpack_adapter,
)
from llm_batch.infra.jobstore import AdapterExists, AdapterNotFound, AdapterRepository, JobStore, OwnerAdapter
from llm_batch.infra.model_cache import model_status
from llm_batch.infra.model_registry import Registry
from llm_batch.pipeline.admission import check_owner_limits, model_registry
from llm_batch.pipeline.housekeeping import live_jobs

router = APIRouter(prefix="/v1/adapters", tags=["adapters"])

MAX_ADAPTERS_PER_OWNER = 100  # each up to Settings.max_adapter_bytes of storage
_CHUNK = 1 << 20
_NAME_RULE = "1 to 64 letters, digits, '.', '_' or '-', starting with a letter or digit"
AdapterName = Annotated[str, PathParam(min_length=1, max_length=64, pattern=f"^{ADAPTER_NAME.pattern}$",
                                       description=f"The adapter's name ({_NAME_RULE})")]


class AdapterOut(BaseModel):
    """A LoRA adapter the caller uploaded: a batch line names it as its model (``body.model``),
    as does a job's ``model``; seen and used by its owner only."""

    object: Literal["adapter"] = Field(default="adapter", description="Always `adapter`")
    name: str = Field(description="Its name, unique among the owner's adapters: what a line's `body.model` gives")
    base: str = Field(description="The registered generate model it adapts: its lines run on that model")
    rank: int = Field(description="Its LoRA rank `r`, at most the deployment's LLM_BATCH_MAX_LORA_RANK")
    bytes: int = Field(description="Bytes its two files store, counted in the owner's stored bytes "
                       "(the max_file_bytes limit)")
    created_at: int = Field(description="When it was uploaded, Unix time in seconds")

    @classmethod
    def of(cls, adapter: OwnerAdapter) -> AdapterOut:
        return cls(name=adapter.name, base=adapter.base, rank=adapter.rank, bytes=adapter.bytes,
                   created_at=epoch(adapter.created_at) or 0)


class AdapterList(BaseModel):
    """The caller's own adapters, by name."""

    object: Literal["list"] = Field(default="list", description="Always `list`")
    data: list[AdapterOut] = Field(description="Every adapter of the caller (at most a hundred), by name")


class AdapterDeleted(BaseModel):
    """What ``DELETE /v1/adapters/{name}`` answers."""

    name: str = Field(description="The name of the deleted adapter (free to upload again)")
    object: Literal["adapter"] = Field(default="adapter", description="Always `adapter`")
    deleted: Literal[True] = Field(default=True, description="Always true")


def _adapter_not_found(name: str) -> ApiError:
    """The one answer for an unknown name and another owner's (no existence leak)."""
    return ApiError(404, f"you have no adapter named {name!r} (GET /v1/adapters lists yours)", param="name",
                    code="not_found")


def _owned(store: AdapterRepository, caller: Caller, name: str) -> OwnerAdapter:
    if (found := store.get_adapter(caller.name, name)) is None:
        raise _adapter_not_found(name)
    return found


def _check_name(name: str, registry: Registry) -> None:
    if not ADAPTER_NAME.fullmatch(name):
        raise ApiError(400, f"adapter name {name[:80]!r} is not admitted: {_NAME_RULE}", param="name",
                       code="invalid_name")
    if name in registry.models or name in registry.adapters:
        kind = "model" if name in registry.models else "adapter"
        raise ApiError(409, f"{name!r} is a {kind} of the model registry: give your adapter another name",
                       param="name", code="name_taken")


def _check_base(base: str, registry: Registry, settings: Settings) -> Path:
    """The base model's local folder (its config.json is what the adapter's shapes are
    checked against): a registered generate model, prepared where the API runs."""
    spec = registry.models.get(base)
    if spec is None:
        if base in registry.adapters:
            raise ApiError(400, f"base {base!r} is an adapter: give the registered model it adapts "
                           f"({registry.adapters[base].base!r})", param="base", code="invalid_base")
        raise ApiError(400, f"base {base[:80]!r} is not a registered model: known models are "
                       f"{', '.join(sorted(registry.models))}", param="base", code="unknown_model")
    if spec.task != "generate":
        raise ApiError(400, f"base {base!r} is a {spec.task} model: adapters apply to generate models only",
                       param="base", code="invalid_base")
    not_prepared = (f"base {base!r} is not prepared on the API server, where an upload is checked against it "
                    f"(an admin runs `llm-batch models prepare {base}` there)")
    if model_status(base, spec, settings) not in ("ready", "stale"):
        raise ApiError(400, not_prepared, param="base", code="base_not_prepared")
    try:
        return resolve_base_dir(base, registry, settings)
    except ModelError as exc:
        raise ApiError(400, f"{not_prepared}: {exc}", param="base", code="base_not_prepared") from None


def _too_large(settings: Settings) -> ApiError:
    return ApiError(413, f"the adapter archive is larger than the limit of {settings.max_adapter_bytes} bytes "
                    "(LLM_BATCH_MAX_ADAPTER_BYTES)", param="file", code="file_too_large")


def _save(stream: BinaryIO, target: Path, settings: Settings) -> None:
    written = 0
    with target.open("wb") as out:
        while chunk := stream.read(_CHUNK):
            written += len(chunk)
            if written > settings.max_adapter_bytes:
                raise _too_large(settings)
            out.write(chunk)
    if not written:
        raise ApiError(400, "the uploaded file is empty: send a .tar, .tar.gz or .zip of the adapter", param="file",
                       code="invalid_adapter")


def _publish(folder: Path, prefix: str) -> None:
    """Copy the two files under ``prefix``; nothing is left there if one fails."""
    try:
        for name in sorted(ADAPTER_FILES):
            with (folder / name).open("rb") as source, storage.open_write(join_uri(prefix, name)) as out:
                shutil.copyfileobj(source, out, _CHUNK)
    except BaseException:
        _remove_files(prefix)
        raise


def _remove_files(prefix: str) -> None:
    with contextlib.suppress(storage.StorageError):  # no record names these files any more
        storage.delete_prefix(prefix)


def _create(store: JobStore, settings: Settings, caller: Caller, name: str, base: str, stream: BinaryIO) -> OwnerAdapter:
    registry = model_registry(settings)
    _check_name(name, registry)
    base_dir = _check_base(base, registry, settings)
    mine = store.list_adapters(caller.name)
    if any(a.name == name for a in mine):
        raise ApiError(409, f"you already have an adapter named {name!r}: delete it first, or choose another name",
                       param="name", code="adapter_exists")
    if len(mine) >= MAX_ADAPTERS_PER_OWNER:
        raise ApiError(429, f"you hold {len(mine)} adapters, the most one owner may: delete one first",
                       param="name", code="limit_exceeded")
    with tempfile.TemporaryDirectory(prefix="llm-batch-adapter-") as tmp:
        archive, folder = Path(tmp, "upload"), Path(tmp, "adapter")
        _save(stream, archive, settings)
        try:
            unpack_adapter(archive, folder, settings.max_adapter_bytes)
            archive.unlink()
            facts = check_adapter_dir(folder, base_dir, settings.max_lora_rank)
        except AdapterTooLarge as exc:
            raise ApiError(413, f"adapter refused: {exc} (LLM_BATCH_MAX_ADAPTER_BYTES)", param="file",
                           code="file_too_large") from None
        except AdapterRefused as exc:
            raise ApiError(400, f"adapter refused: {exc}", param="file", code="invalid_adapter") from None
        check_owner_limits(store, settings, caller, new_bytes=facts.bytes)  # what it stores, as a file upload
        prefix = join_uri(settings.work_uri, "adapters", caller.name, f"{name}-{uuid.uuid4().hex}") + "/"
        _publish(folder, prefix)
    try:
        return store.create_adapter(owner=caller.name, name=name, base=base, uri=prefix, rank=facts.rank,
                                    bytes=facts.bytes)
    except AdapterExists:  # a concurrent upload of the same name won
        _remove_files(prefix)
        raise ApiError(409, f"you already have an adapter named {name!r}", param="name",
                       code="adapter_exists") from None
    except BaseException:
        _remove_files(prefix)
        raise


@router.post("", response_model=AdapterOut, summary="Upload a LoRA adapter of your own")
async def upload_adapter(
    request: Request, caller: CallerDep, store: StoreDep, settings: SettingsDep,
    file: Annotated[UploadFile, File(description="A .tar, .tar.gz or .zip holding exactly adapter_config.json and "
                                     "adapter_model.safetensors (at its top level or in one top folder); at most "
                                     "LLM_BATCH_MAX_ADAPTER_BYTES (413 above)")],
    name: Annotated[str, Form(max_length=256, description=f"Its name, what batch lines give as their model: "
                              f"{_NAME_RULE}; not a name of the model registry (409), not one of yours (409)")],
    base: Annotated[str, Form(max_length=256, description="The registered generate model it adapts (400 otherwise), "
                              "prepared on the API server (400 `base_not_prepared` otherwise)")],
) -> AdapterOut:
    caller.require_submit()
    if (parts := len((await request.form()).getlist("file"))) > 1:
        raise ApiError(400, f"upload one archive per request: got {parts} 'file' parts", param="file",
                       code="invalid_adapter")
    if file.size is not None and file.size > settings.max_adapter_bytes:
        raise _too_large(settings)
    created = await run_in_threadpool(_create, store, settings, caller, name, base, file.file)
    return AdapterOut.of(created)


@router.get("", response_model=AdapterList, summary="List your LoRA adapters")
def list_adapters(caller: CallerDep, store: StoreDep) -> AdapterList:
    return AdapterList(data=[AdapterOut.of(a) for a in store.list_adapters(caller.name)])


@router.get("/{name}", response_model=AdapterOut, summary="Get one of your LoRA adapters")
def get_adapter(name: AdapterName, caller: CallerDep, store: StoreDep) -> AdapterOut:
    return AdapterOut.of(_owned(store, caller, name))


@router.delete("/{name}", response_model=AdapterDeleted, summary="Delete one of your LoRA adapters")
def delete_adapter(name: AdapterName, caller: CallerDep, store: StoreDep, settings: SettingsDep) -> AdapterDeleted:
    caller.require_submit()
    found = _owned(store, caller, name)
    # The owner's live jobs on its base: their lines may name it, their workers fetch its files.
    registry, owned = model_registry(settings), {a.name: a.base for a in store.list_adapters(caller.name)}
    if jobs := [j.id for j in live_jobs(store, owner=caller.name) if registry.base_of(j.model, owned) == found.base]:
        raise ApiError(409, f"adapter {name!r} may be named by your jobs on {found.base!r} that have not ended "
                       f"({some_ids(jobs)}): cancel them or wait, then delete", param="name", code="adapter_in_use")
    try:
        removed = store.delete_adapter(caller.name, name)
    except AdapterNotFound:  # deleted meanwhile
        raise _adapter_not_found(name) from None
    _remove_files(removed.uri)
    return AdapterDeleted(name=name)
