"""LoRA adapters: checking an adapter's files, unpacking an uploaded one (``unpack_adapter``),
preparing and fetching registered ones, and the names a job's lines may give (``model_choice``).

An adapter is a folder of exactly peft's ``adapter_config.json`` and
``adapter_model.safetensors`` (never a pickle, never code), admitted only if known good
(``check_adapter_dir``): a plain LoRA within ``max_lora_rank`` of allowed decoder linear
layers, whose tensors fit the base model's shapes and hold only finite values."""

from __future__ import annotations

import json
import re
import stat
import struct
import tarfile
import zipfile
import zlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llm_batch.core.config import Settings, get_settings
from llm_batch.core.model_choice import ModelChoice
from llm_batch.core.model_config import ModelError
from llm_batch.core.model_recipes import build_random_lora
from llm_batch.infra.model_cache import (
    READY_MARKER,
    build_once,
    cache_path,
    fetch_checkpoint,
    prepare_model,
    read_marker,
)
from llm_batch.infra.model_registry import AdapterSpec, ModelNotPrepared, Registry, load_registry

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_FILES = frozenset({ADAPTER_CONFIG, ADAPTER_WEIGHTS})
# The linear layers of a decoder an adapter may adapt (Llama/Mistral/Qwen names): no
# embeddings, no lm_head, no modules_to_save (vLLM's CPU kernels apply those to base lines too).
ALLOWED_TARGET_MODULES = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"})
# vLLM's max_lora_rank takes one of these; an engine gets the least that covers its adapters.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
_MAX_HEADER = 16 << 20  # a safetensors header bigger than this is not an adapter's
_TENSOR = re.compile(r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")


class AdapterRefused(ModelError, ValueError):
    """An adapter's files are not an adapter this deployment admits (the message says why)."""


class AdapterTooLarge(AdapterRefused):
    """An uploaded archive's files are larger than ``unpack_adapter``'s max_bytes."""


@dataclass(frozen=True)
class AdapterFacts:
    rank: int
    target_modules: tuple[str, ...]
    bytes: int  # of both files: what storing it costs its owner


@dataclass(frozen=True)
class ResolvedAdapter:
    """``LoRARequest(name, lora_int_id, str(path))``; ``source``: an owner's adapter's URI
    (two owners may give one name), None for the registry's."""

    name: str
    path: Path
    rank: int
    source: str | None = None

    @property
    def lora_int_id(self) -> int:
        return adapter_int_id(self.source or self.name)


def adapter_int_id(key: str) -> int:
    """A stable positive id per adapter: vLLM keys loaded adapters by it, so a warm engine
    reuses one only for the same files."""
    return (zlib.crc32(key.encode()) & 0x7FFFFFFF) or 1


def engine_rank(ranks: Iterable[int]) -> int:
    most = max(ranks, default=1)
    return next(r for r in VLLM_LORA_RANKS if r >= most)


def check_adapter_dir(path: Path, base: Path, max_rank: int) -> AdapterFacts:
    """Admit the adapter folder ``path`` for the base model folder ``base`` or raise
    ``AdapterRefused`` (shapes are read from the safetensors header: nothing is loaded)."""
    found = {p.name for p in path.iterdir()} - {READY_MARKER} if path.is_dir() else set()
    if found != ADAPTER_FILES:
        extra, missing = sorted(found - ADAPTER_FILES), sorted(ADAPTER_FILES - found)
        raise AdapterRefused("an adapter is exactly adapter_config.json and adapter_model.safetensors"
                             + (f"; missing {', '.join(missing)}" if missing else "")
                             + (f"; not admitted: {', '.join(extra[:5])}" if extra else ""))
    config = _adapter_config(path / ADAPTER_CONFIG, max_rank)
    base_config = _json(base / "config.json", "the base model's config.json")
    _check_tensors(_safetensors_header(path / ADAPTER_WEIGHTS)[0], config, base_config)
    check_adapter_data(path)
    stored = sum((path / name).stat().st_size for name in ADAPTER_FILES)
    return AdapterFacts(config["r"], tuple(config["target_modules"]), stored)


def _json(path: Path, what: str) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise AdapterRefused(f"{what} cannot be read as JSON ({exc.__class__.__name__})") from None
    if not isinstance(value, dict):
        raise AdapterRefused(f"{what} is not a JSON object")
    return value


def _adapter_config(path: Path, max_rank: int) -> dict[str, Any]:
    config = _json(path, ADAPTER_CONFIG)
    if config.get("peft_type") != "LORA":
        raise AdapterRefused(f"{ADAPTER_CONFIG}: peft_type must be \"LORA\", got {str(config.get('peft_type'))[:40]!r}")
    rank = config.get("r")
    if type(rank) is not int or not 1 <= rank <= max_rank:
        raise AdapterRefused(f"{ADAPTER_CONFIG}: r must be a whole number from 1 to {max_rank} "
                             f"(this deployment's max_lora_rank), got {str(rank)[:20]}")
    targets = config.get("target_modules")
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise AdapterRefused(f"{ADAPTER_CONFIG}: target_modules must be a list of module names "
                             f"(among {', '.join(sorted(ALLOWED_TARGET_MODULES))})")
    if bad := sorted(set(targets) - ALLOWED_TARGET_MODULES):
        raise AdapterRefused(f"{ADAPTER_CONFIG}: target_modules {', '.join(b[:40] for b in bad[:3])} are not admitted "
                             f"(admitted: {', '.join(sorted(ALLOWED_TARGET_MODULES))})")
    for key in ("modules_to_save", "layers_to_transform", "rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise AdapterRefused(f"{ADAPTER_CONFIG}: {key} is not admitted")
    if config.get("use_dora") or config.get("bias", "none") != "none":
        raise AdapterRefused(f"{ADAPTER_CONFIG}: only plain LoRA is admitted (no DoRA, bias \"none\")")
    alpha = config.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not 0 < alpha <= 4096:
        raise AdapterRefused(f"{ADAPTER_CONFIG}: lora_alpha must be a number from 0 to 4096")
    return config


def _safetensors_header(path: Path) -> tuple[dict[str, Any], int]:
    try:
        with path.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > _MAX_HEADER:
                raise AdapterRefused(f"{ADAPTER_WEIGHTS}: its header is {size} bytes, not an adapter's")
            header = json.loads(f.read(size))
    except (OSError, ValueError, struct.error):
        raise AdapterRefused(f"{ADAPTER_WEIGHTS} is not a safetensors file") from None
    if not isinstance(header, dict):
        raise AdapterRefused(f"{ADAPTER_WEIGHTS} is not a safetensors file")
    header.pop("__metadata__", None)
    return header, 8 + size


# Admitted dtypes: (bytes per value, the exponent bits that are all ones only in inf and NaN).
_DTYPES = {"F16": (2, 0x7C00), "BF16": (2, 0x7F80), "F32": (4, 0x7F800000)}


def check_adapter_data(adapter: Path) -> None:
    """The worker's check of every adapter it loads (shapes, which need the base, are checked at
    upload and prepare): admitted dtypes, data ranges that fill the file exactly, and every value
    finite: one NaN adapter in a shared batch would reach its neighbours' rows."""
    import numpy as np  # heavy

    path = adapter / ADAPTER_WEIGHTS
    header, data_start = _safetensors_header(path)
    spans = []
    for name, info in header.items():
        if not isinstance(info, dict) or not isinstance(shape := info.get("shape"), list) or len(shape) != 2 \
                or not all(type(n) is int and n >= 0 for n in shape):
            raise AdapterRefused(f"{ADAPTER_WEIGHTS}: tensor {name[:80]!r} is not a LoRA weight (a matrix)")
        dtype, offsets = info.get("dtype"), info.get("data_offsets")
        if dtype not in _DTYPES:
            raise AdapterRefused(f"{ADAPTER_WEIGHTS}: tensor {name[:80]!r} is {str(dtype)[:10]}; admitted: "
                                 f"{', '.join(_DTYPES)}")
        width = _DTYPES[dtype][0]
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
                or offsets[1] - offsets[0] != shape[0] * shape[1] * width):
            raise AdapterRefused(f"{ADAPTER_WEIGHTS}: tensor {name[:80]!r} has data_offsets that do not fit its shape")
        spans.append((offsets[0], offsets[1], name, dtype))
    spans.sort()
    data_size = path.stat().st_size - data_start
    ends = [0] + [end for _, end, *_ in spans]
    if any(begin != end for (begin, *_), end in zip(spans, ends, strict=False)) or ends[-1] != data_size:
        raise AdapterRefused(f"{ADAPTER_WEIGHTS}: the tensors' data must fill the file exactly "
                             "(no gap, overlap or bytes after them)")
    with path.open("rb") as f:
        f.seek(data_start)
        data = f.read(data_size)
    for begin, end, name, dtype in spans:
        width, exponent = _DTYPES[dtype]
        bits = np.frombuffer(data[begin:end], dtype="<u2" if width == 2 else "<u4")
        if bool(((bits & exponent) == exponent).any()):
            raise AdapterRefused(f"{ADAPTER_WEIGHTS}: tensor {name[:80]!r} holds values that are not finite "
                                 "(NaN or infinity)")


def _check_tensors(header: dict[str, Any], config: dict[str, Any], base: dict[str, Any]) -> None:
    """Every tensor a LoRA A (r, in) or B (out, r) of an admitted module of an existing
    layer, in and out among the base's widths."""
    layers = base.get("num_hidden_layers")
    hidden = base.get("hidden_size")
    if not isinstance(layers, int) or not isinstance(hidden, int):
        raise AdapterRefused("the base model's config.json has no num_hidden_layers / hidden_size: "
                             "adapters are admitted for decoder models only")
    heads = base.get("num_attention_heads") or 1
    head_dim = base.get("head_dim") or hidden // heads
    widths = {hidden, base.get("intermediate_size"), (base.get("num_key_value_heads") or heads) * head_dim,
              heads * head_dim}
    rank, targets = config["r"], set(config["target_modules"])
    if not header:
        raise AdapterRefused(f"{ADAPTER_WEIGHTS} holds no tensor")
    for name, info in header.items():
        match = _TENSOR.fullmatch(name)
        shape = info.get("shape") if isinstance(info, dict) else None
        if match is None or not isinstance(shape, list) or len(shape) != 2:
            raise AdapterRefused(f"{ADAPTER_WEIGHTS}: tensor {name[:80]!r} is not a LoRA weight of a decoder layer")
        layer, module, half = int(match[1]), match[2], match[3]
        if layer >= layers or module not in targets:
            raise AdapterRefused(f"{ADAPTER_WEIGHTS}: tensor {name[:80]!r} adapts a layer or module the base "
                                 f"({layers} layers) or the config's target_modules do not have")
        width, r = (shape[1], shape[0]) if half == "A" else (shape[0], shape[1])
        if r != rank or width not in widths:
            raise AdapterRefused(f"{ADAPTER_WEIGHTS}: tensor {name[:80]!r} has shape {shape}, not the base's "
                                 f"(rank {rank}, widths {sorted(w for w in widths if w)})")


# Members an archive may hold: the two files, and the one folder holding them (a "." entry too,
# as ``tar -C folder .`` writes it): a handful, whatever else it claims.
MAX_ARCHIVE_MEMBERS = 6
_COPY_CHUNK = 1 << 20


def unpack_adapter(archive: Path, dest: Path, max_bytes: int) -> None:
    """Unpack an uploaded ``.tar``, ``.tar.gz`` or ``.zip`` (known by its content) holding the
    two files, at its top level or in one top folder, flat into ``dest``; ``AdapterRefused``
    naming the member for anything else. Each file is copied from its member's stream (the
    archive modules extract nothing), so no member can write outside ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    try:
        if zipfile.is_zipfile(archive):
            with zipfile.ZipFile(archive) as zipped:
                _unpack_members(_zip_members(zipped), dest, max_bytes)
            return
        with archive.open("rb") as f:
            gzipped = f.read(2) == b"\x1f\x8b"
        try:
            tar = tarfile.open(archive, mode="r:gz" if gzipped else "r:")
        except tarfile.ReadError:
            raise AdapterRefused("the upload is not a .tar, .tar.gz or .zip archive") from None
        with tar:
            _unpack_members(_tar_members(tar, dest), dest, max_bytes)
    except (tarfile.TarError, zipfile.BadZipFile, zlib.error, EOFError, OSError, RuntimeError, ValueError) as exc:
        for name in ADAPTER_FILES:  # nothing half-unpacked stays
            (dest / name).unlink(missing_ok=True)
        if isinstance(exc, AdapterRefused):
            raise
        # RuntimeError: zipfile's encrypted member; the rest: a corrupt or truncated archive.
        raise AdapterRefused(f"the archive cannot be read ({exc.__class__.__name__}: {str(exc)[:120]})") from None


@dataclass(frozen=True)
class _Member:
    name: str  # as the archive spells it
    is_dir: bool
    size: int  # declared
    open: Any  # () -> a binary stream of its content (files only)


def _tar_members(tar: tarfile.TarFile, dest: Path) -> Iterator[_Member]:
    count = 0
    for member in tar:  # read lazily: a long archive is refused at its 7th member
        count += 1
        if count > MAX_ARCHIVE_MEMBERS:
            raise AdapterRefused(f"the archive holds more than {MAX_ARCHIVE_MEMBERS} members: an adapter is two files")
        _member_parts(member.name)
        shown = member.name[:80]
        if member.issym() or member.islnk():
            raise AdapterRefused(f"archive member {shown!r} is a link: links are not admitted")
        if not (member.isreg() or member.isdir()):
            raise AdapterRefused(f"archive member {shown!r} is not a regular file or folder")
        try:  # tarfile's own "data" filter (absolute paths, .., links, modes) as a second check
            tarfile.data_filter(member, str(dest))
        except tarfile.FilterError as exc:
            raise AdapterRefused(f"archive member {shown!r} is refused: {exc.__class__.__name__}") from None
        yield _Member(member.name, member.isdir(), member.size, lambda m=member: tar.extractfile(m))


def _zip_members(zipped: zipfile.ZipFile) -> Iterator[_Member]:
    infos = zipped.infolist()
    if len(infos) > MAX_ARCHIVE_MEMBERS:
        raise AdapterRefused(f"the archive holds {len(infos)} members: an adapter is two files")
    for info in infos:
        _member_parts(info.filename)
        shown = info.filename[:80]
        kind = stat.S_IFMT(info.external_attr >> 16)  # 0: no Unix mode recorded (a plain file or folder)
        if kind == stat.S_IFLNK:
            raise AdapterRefused(f"archive member {shown!r} is a link: links are not admitted")
        if kind not in (0, stat.S_IFREG, stat.S_IFDIR):
            raise AdapterRefused(f"archive member {shown!r} is not a regular file or folder")
        if info.flag_bits & 0x1:
            raise AdapterRefused(f"archive member {shown!r} is encrypted")
        yield _Member(info.filename, info.is_dir(), info.file_size, lambda i=info: zipped.open(i))


def _member_parts(name: str) -> list[str]:
    """The member's path as parts (``.`` and empty ones dropped); absolute or climbing refused."""
    shown = name[:80]
    if not name or "\0" in name or "\\" in name or name.startswith("/") or re.match(r"[A-Za-z]:", name):
        raise AdapterRefused(f"archive member {shown!r}: an absolute or unusual path is not admitted")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise AdapterRefused(f"archive member {shown!r}: a path with '..' is not admitted")
    return parts


def _unpack_members(members: Iterator[_Member], dest: Path, max_bytes: int) -> None:
    folder: str | None = None  # the one top folder, if the files are in one
    seen: set[str] = set()
    declared = written = 0
    for member in members:
        parts, shown = _member_parts(member.name), member.name[:80]
        if member.is_dir:
            if len(parts) > 1 or (parts and folder not in (None, parts[0])):
                raise AdapterRefused(f"archive member {shown!r}: only one top folder is admitted")
            folder = parts[0] if parts else folder
            continue
        if len(parts) == 2 and folder in (None, parts[0]) and not (seen and folder is None):
            folder = parts[0]
        elif len(parts) != 1 or folder is not None:
            raise AdapterRefused(f"archive member {shown!r}: the two files must be at the top level or "
                                 "in one top folder, side by side")
        name = parts[-1]
        if name not in ADAPTER_FILES:
            raise AdapterRefused(f"archive member {shown!r} is not admitted: an adapter is exactly "
                                 f"{ADAPTER_CONFIG} and {ADAPTER_WEIGHTS} (no pickles, no code, no other file)")
        if name in seen:
            raise AdapterRefused(f"archive member {shown!r}: {name} is in the archive twice")
        seen.add(name)
        declared += member.size
        if declared > max_bytes:
            raise AdapterTooLarge(f"the archive's files are larger than the limit of {max_bytes} bytes")
        with member.open() as source, (dest / name).open("xb") as out:
            while chunk := source.read(_COPY_CHUNK):
                written += len(chunk)
                if written > max_bytes:  # counted too, whatever the archive declares
                    raise AdapterTooLarge(f"the archive's files are larger than the limit of {max_bytes} bytes")
                out.write(chunk)
    if missing := sorted(ADAPTER_FILES - seen):
        raise AdapterRefused(f"the archive has no {' and no '.join(missing)}: an adapter is exactly "
                             f"{ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}")


def adapter_status(name: str, spec: AdapterSpec, settings: Settings | None = None) -> str:
    """``ready``, ``not prepared``, ``remote`` (s3://) or ``missing``."""
    settings = settings or get_settings()
    if spec.checkpoint.startswith("s3://"):
        return "remote"
    path = cache_path(spec.checkpoint, settings)
    if (path / READY_MARKER).is_file() or (spec.prepare is None and (path / ADAPTER_CONFIG).is_file()):
        return "ready"
    return "not prepared" if spec.prepare else "missing"


def prepare_adapter(name: str, *, registry: Registry | None = None, settings: Settings | None = None,
                    force: bool = False) -> Path:
    """The registered adapter ``name``'s folder, built or fetched into the model cache, checked."""
    settings = settings or get_settings()
    registry = registry or load_registry(settings=settings)
    spec = registry.adapter(name)
    base = prepare_model(spec.base, registry=registry, settings=settings) \
        if registry.models[spec.base].prepare else resolve_base_dir(spec.base, registry, settings)
    if spec.checkpoint.startswith("s3://"):
        path = fetch_checkpoint(spec.checkpoint, settings=settings, required=ADAPTER_CONFIG)
    elif spec.prepare:
        path = cache_path(spec.checkpoint, settings)
        marker = {"adapter": name, "recipe": spec.prepare, "base": spec.base, "rank": spec.rank, "seed": spec.seed}
        build_once(path, marker, lambda tmp: build_random_lora(tmp, base, spec.rank, spec.seed),
                   replace=lambda: force or read_marker(path) != marker)
    else:
        path = cache_path(spec.checkpoint, settings)
    facts = check_adapter_dir(path, base, settings.max_lora_rank)
    if facts.rank != spec.rank:
        raise AdapterRefused(f"adapter {name!r}: the registry says rank {spec.rank}, its files rank {facts.rank}")
    return path


def resolve_base_dir(base: str, registry: Registry, settings: Settings) -> Path:
    from llm_batch.infra.model_resolution import resolve_model  # cycle

    return resolve_model({"model": base}, registry=registry, settings=settings).path


def resolve_adapters(names: Iterable[str], owned: Mapping[str, str] | None = None, *,
                     registry: Registry | None = None, settings: Settings | None = None) -> list[ResolvedAdapter]:
    """The adapters ``names`` as the worker loads them, each one's data checked: registered
    ones from the model cache, an owner's from ``owned`` (name -> its folder's URI, fetched once)."""
    settings = settings or get_settings()
    registry = registry or load_registry(settings=settings)
    resolved = []
    for name in sorted(set(names)):
        source = owned.get(name) if owned else None
        if source:
            path = fetch_checkpoint(source, settings=settings, required=ADAPTER_CONFIG)
            rank = _json(path / ADAPTER_CONFIG, ADAPTER_CONFIG)["r"]
        else:
            spec = registry.adapter(name)
            if spec.checkpoint.startswith("s3://"):
                path = fetch_checkpoint(spec.checkpoint, settings=settings, required=ADAPTER_CONFIG)
            else:
                path = cache_path(spec.checkpoint, settings)
                if adapter_status(name, spec, settings) != "ready":
                    raise ModelNotPrepared(f"adapter {name!r} is not prepared in {settings.model_cache}: "
                                           f"run `llm-batch models prepare {name}`")
            rank = spec.rank
        try:
            check_adapter_data(path)
        except AdapterRefused as exc:
            raise AdapterRefused(f"adapter {name!r} is refused: {exc}") from None
        resolved.append(ResolvedAdapter(name, path, rank, source=source))
    return resolved


def model_choice(registry: Registry, model: str, served_model_name: str | None = None,
                 owned: Mapping[str, str] | None = None, locations: Mapping[str, str] | None = None) -> ModelChoice:
    """The names lines of a job of ``model`` may give: the job's model, its base, its served
    name, and every adapter of that base in the registry or among the owner's ``owned``
    (name -> base; ``locations``: name -> URI); a registry name wins over an owner's."""
    adapter = model if model in registry.adapters or (owned and model in owned) else None
    base = registry.base_of(model, owned) if adapter else model
    names: dict[str, str | None] = {base: None, model: adapter}
    if served_model_name:
        names[served_model_name] = None
    if base in registry.models and registry.models[base].task == "generate":
        for name, spec in registry.adapters.items():
            if spec.base == base:
                names[name] = name
        for name, its_base in (owned or {}).items():
            if its_base == base and name not in registry.models:
                names[name] = name
    mine = {name: uri for name, uri in (locations or {}).items() if names.get(name) == name
            and name not in registry.adapters}
    return ModelChoice(base=served_model_name or base, names=names, default=adapter, locations=mine)
