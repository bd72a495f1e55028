"""Which paths a user may name (Scale's data paths, a run's ``input_uri`` / ``output_uri``,
``model_config.checkpoint_path``): the API's and the DAG's one gate; internal I/O goes
through ``llm_batch.infra.storage`` directly. The rules, in order (docs/api.md, "Security model"):

1. Structure: a local path, ``file://`` or ``s3://``; no ``..``, NUL or ``~``; S3 keys
   without empty, ``.`` or ``..`` segments or control characters.
2. Roots: local paths under ``Settings.local_roots``, ``s3://`` only in ``Settings.allowed_buckets``.
3. Never internal state, whatever the spelling (case, trailing dots, symlinks, hard links).
4. The owner's namespace: a non-admin names only ``<root>/<owner>/...`` and
   ``s3://<bucket>/<owner>/...``, compared exactly as spelled (owner names are canonical);
   a relative path is taken from it in the first root.

What does not depend on what exists is refused precisely (``PathRefused``); what would tell
whether something exists reads the same every way (``PathUnavailable``): no existence oracle.
"""
from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from pathlib import Path

from llm_batch.core import owners
from llm_batch.core.config import API_KEY_FILE, Settings
from llm_batch.infra import storage

_SQLITE = "sqlite:///"
_BAD_KEY_CHARS = re.compile(r"[\x00-\x1f\x7f\\]")


class PathRefused(ValueError):
    """A user path breaks a rule that does not depend on what exists; the message says which."""


class PathUnavailable(ValueError):
    """Missing, or hidden by a link: one message."""


@dataclass(frozen=True)
class UserPath:
    """A checked user path: ``uri`` canonical (local: absolute, symlinks resolved)."""

    uri: str


def owner_dirname(owner: str) -> str:
    """The owner name itself; PathRefused if it is not one (no ``..``, slash or other spelling)."""
    try:
        return owners.check(owner)
    except owners.OwnerNameRefused as exc:
        raise PathRefused(f"no storage namespace: {exc}") from None


def namespaces(owner: str, settings: Settings) -> list[str]:
    name = owner_dirname(owner)
    return [str(root / name) for root in settings.local_roots] + [f"s3://{b}/{name}/" for b in settings.allowed_buckets]


def check(uri: str, owner: str, settings: Settings, *, is_admin: bool = False) -> UserPath:
    """`uri` as `owner` may name it, canonical; PathRefused or PathUnavailable otherwise."""
    if not isinstance(uri, str) or not uri.strip():
        raise PathRefused("an empty path")
    checked = _check_s3 if storage.is_s3(uri) else _check_local
    return UserPath(checked(uri, owner, settings, is_admin))


def refuse_internal(uri: str, settings: Settings) -> None:
    """Rule 3 alone: the merge step's last check before it writes a user's output."""
    if storage.is_s3(uri):
        bucket, _, key = uri[5:].partition("/")
        if _internal_s3(bucket, key, settings):
            raise PathRefused(f"{uri} is llm-batch's own storage")
        return
    path = Path(uri)
    for candidate in {path, path.resolve()}:
        if _internal_local(candidate, settings):
            raise PathRefused(f"{uri} is llm-batch's own state")


def _check_local(uri: str, owner: str, settings: Settings, is_admin: bool) -> str:
    if not settings.local_roots:
        raise PathRefused(f"{uri}: local paths are not allowed: no local roots are configured (LLM_BATCH_LOCAL_ROOTS)")
    if not uri.startswith("/") and "://" not in uri:  # relative: from the owner's own folder
        if problem := storage.spelling_problem(uri):
            raise PathRefused(f"{uri}: {problem}")
        base = settings.local_roots[0]
        uri = str((base / owner_dirname(owner) if settings.owner_namespaces else base) / uri)
    own = not is_admin and settings.owner_namespaces
    allowed = [root / owner_dirname(owner) for root in settings.local_roots] if own else None  # None: anywhere
    try:
        resolved = storage.LocalStorage(settings.local_roots).path(uri)
    except storage.SymlinkEscape:  # spelled inside the roots: what it hides is not told
        raise PathUnavailable(unavailable(uri, owner, settings)) from None
    except storage.PathNotAllowed as exc:
        raise PathRefused(_why(exc)) from None
    lexical = Path(os.path.normpath(storage.file_uri_path(uri) if uri[:7].lower() == "file://" else uri))
    if _internal_local(lexical, settings):
        raise PathRefused(f"{uri} is llm-batch's own state (database, keys, Airflow, work, uploads, models)")
    if allowed is not None and not _inside_exactly(lexical, allowed):
        raise PathRefused(f"{uri} is outside your storage namespace ({', '.join(map(str, allowed))})")
    # From here on what exists decides: one answer for every way to be hidden (a hard link may be anyone's file).
    if (_internal_local(resolved, settings) or (allowed is not None and not _inside_exactly(resolved, allowed))
            or (resolved.is_file() and resolved.stat().st_nlink > 1)):
        raise PathUnavailable(unavailable(uri, owner, settings))
    return str(resolved)


def internal_areas(settings: Settings) -> list[Path]:
    # The embedded stack's own files (llm_batch.devstack) among them.
    areas = [settings.home / name for name in ("airflow", API_KEY_FILE, "stack.json", "postgres", "celery")]
    areas.append(Path(settings.model_cache))
    areas += [Path(u) for u in _own_prefixes(settings) if not storage.is_s3(u)]
    if airflow_home := os.environ.get("AIRFLOW_HOME"):
        areas.append(Path(airflow_home))
    return [a.expanduser().resolve() for a in areas]


def _fold(path: Path) -> str:
    """As a case-insensitive or Windows-style filesystem reads it."""
    return "/".join(part.rstrip(". ").casefold() for part in path.parts).replace("//", "/")


def _within(path: Path, area: Path) -> bool:
    folded, base = _fold(path), _fold(area)
    return folded == base or folded.startswith(base.rstrip("/") + "/")


def _internal_local(path: Path, settings: Settings) -> bool:
    if any(_within(path, area) for area in internal_areas(settings)):
        return True
    if not settings.database_url.startswith(_SQLITE):
        return False
    db = Path(settings.database_url.removeprefix(_SQLITE)).expanduser().resolve()  # and its -wal/-shm/-journal
    return _fold(path.parent) == _fold(db.parent) and _fold(Path(path.name)).startswith(_fold(Path(db.name)))


def _inside_exactly(path: Path, areas: list[Path]) -> bool:
    """As spelled: folding would let ``alice3`` name ``Alice3/``."""
    return any(path.is_relative_to(area) for area in areas)


def unavailable(uri: str, owner: str, settings: Settings) -> str:
    return f"{uri}: no such file that you may use (yours live under {', '.join(namespaces(owner, settings))})"


def _why(exc: storage.StorageError) -> str:
    return str(exc).replace(" (LLM_BATCH_LOCAL_ROOTS)", "")


def _check_s3(uri: str, owner: str, settings: Settings, is_admin: bool) -> str:
    if not settings.allowed_buckets:
        raise PathRefused(f"{uri}: s3 paths are not allowed: no buckets are configured (LLM_BATCH_ALLOWED_BUCKETS)")
    try:
        bucket, key = dataclasses.astuple(storage.s3_location(uri, settings.allowed_buckets))
    except storage.PathNotAllowed as exc:
        raise PathRefused(_why(exc)) from None
    parts = key.split("/")
    if _BAD_KEY_CHARS.search(key) or any(p in ("", ".", "..") for p in parts[:-1]) or parts[-1] in (".", ".."):
        raise PathRefused(f"{uri}: S3 keys here may not hold empty, '.' or '..' segments, backslashes or control characters")
    if _internal_s3(bucket, key, settings):
        raise PathRefused(f"{uri} is llm-batch's own storage (work files, uploads)")
    if not is_admin and settings.owner_namespaces:
        own = f"{owner_dirname(owner)}/"
        if not key.startswith(own):
            raise PathRefused(f"{uri} is outside your storage namespace (s3://{bucket}/{own})")
    return uri


def _own_prefixes(settings: Settings) -> tuple[str, ...]:
    return settings.work_uri, settings.files_uri, settings.result_cache_uri


def _internal_s3(bucket: str, key: str, settings: Settings) -> bool:
    for prefix in _own_prefixes(settings):
        if not storage.is_s3(prefix):
            continue
        own_bucket, _, own_key = prefix[5:].partition("/")
        base = own_key.strip("/").casefold()
        if bucket == own_bucket and (not base or key.casefold() == base or key.casefold().startswith(base + "/")):
            return True
    return False
