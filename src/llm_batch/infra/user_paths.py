"""Which paths a user may name: the API's and the DAG's one gate for user-supplied paths.

User paths are Scale's ``input_data_path`` / ``output_data_path``, a run's ``input_uri`` /
``output_uri`` and ``model_config.checkpoint_path``. Internal I/O (work files, uploads,
models) goes through ``llm_batch.infra.storage`` directly and is not held to these rules.

The rules, in order (docs/api.md, "Security model"):
1. Structure (the storage backend): a local path, ``file://`` or ``s3://``; no ``..``, no
   NUL, no ``~``; S3 keys without empty, ``.`` or ``..`` segments or control characters.
2. Roots: local paths under ``Settings.local_roots`` (default ``$LLM_BATCH_HOME/data``,
   which holds no internal state), ``s3://`` only in ``Settings.allowed_buckets``.
3. Never internal state, whatever the spelling (case, trailing dots, symlinks, hard
   links): the job database and its ``-wal`` / ``-shm`` / ``-journal`` files, key files,
   Airflow's home, the work, files and model areas (their ``s3://`` prefixes too), even
   when an admin makes ``$LLM_BATCH_HOME`` itself a root.
4. The owner's namespace: a non-admin names only ``<root>/<owner>/...`` and
   ``s3://<bucket>/<owner>/...``, compared exactly, as spelled (``Settings.owner_namespaces=False``
   turns this off for a single-tenant deployment). The folder is the owner name itself:
   owner names are canonical (``llm_batch.core.owners``: one spelling per owner, no two folding
   together), and a name that is not has no folder. A relative path is taken from the
   owner's namespace in the first root, so ``out/results.json`` is a fine output path for anyone.

Refusals that do not depend on what exists (1, 2, 4 on the spelling) say precisely why:
``PathRefused``. Refusals that would tell whether something exists (a symlink or hard link
leading elsewhere, a missing input) all read the same: ``PathUnavailable``, so the API
answers them alike and is no existence oracle.
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
    """No object the caller may use is there (missing, or hidden by a link): one message."""


@dataclass(frozen=True)
class UserPath:
    """A checked user path: ``uri`` canonical (local: absolute, symlinks resolved)."""

    uri: str
    given: str


def owner_dirname(owner: str) -> str:
    """The owner's folder name: the owner name itself (PathRefused if it is not one, so no
    spelling can be ``..``, hold a slash or be read as another owner's folder)."""
    try:
        return owners.check(owner)
    except owners.OwnerNameRefused as exc:
        raise PathRefused(f"no storage namespace: {exc}") from None


def namespaces(owner: str, settings: Settings) -> list[str]:
    """Where `owner` may name paths: one folder per local root, one prefix per bucket."""
    name = owner_dirname(owner)
    return [str(root / name) for root in settings.local_roots] + [
        f"s3://{bucket}/{name}/" for bucket in settings.allowed_buckets
    ]


def check(uri: str, owner: str, settings: Settings, *, is_admin: bool = False) -> UserPath:
    """`uri` as the user `owner` may name it, canonical; raises PathRefused or PathUnavailable."""
    if not isinstance(uri, str) or not uri.strip():
        raise PathRefused("an empty path")
    if storage.is_s3(uri):
        return UserPath(_check_s3(uri, owner, settings, is_admin), uri)
    return UserPath(_check_local(uri, owner, settings, is_admin), uri)


def refuse_internal(uri: str, settings: Settings) -> None:
    """PathRefused if `uri` is internal state (rule 3 alone): the merge step's last check
    before it writes a user's output, whoever submitted it."""
    if storage.is_s3(uri):
        bucket, _, key = uri[5:].partition("/")
        if _internal_s3(bucket, key, settings):
            raise PathRefused(f"{uri} is llm-batch's own storage")
        return
    path = Path(uri)
    for candidate in {path, path.resolve()}:
        if _internal_local(candidate, settings):
            raise PathRefused(f"{uri} is llm-batch's own state")


# -- local ---------------------------------------------------------------------------------


def _check_local(uri: str, owner: str, settings: Settings, is_admin: bool) -> str:
    if not settings.local_roots:
        raise PathRefused(f"{uri}: local paths are not allowed: no local roots are configured (LLM_BATCH_LOCAL_ROOTS)")
    if not uri.startswith("/") and "://" not in uri:  # relative: from the owner's own folder
        if problem := storage.spelling_problem(uri):
            raise PathRefused(f"{uri}: {problem}")
        base = settings.local_roots[0]
        uri = str((base / owner_dirname(owner) if settings.owner_namespaces else base) / uri)
    allowed = _own_areas(owner, settings, is_admin)
    try:
        resolved = storage.LocalStorage(settings.local_roots).path(uri)
    except storage.SymlinkEscape:  # spelled inside the roots: what it hides is not told
        raise PathUnavailable(unavailable(uri, owner, settings)) from None
    except storage.PathNotAllowed as exc:
        raise PathRefused(_why(exc)) from None
    lexical = _lexical(uri)
    if _internal_local(lexical, settings):
        raise PathRefused(f"{uri} is llm-batch's own state (database, keys, Airflow, work, uploads, models)")
    if allowed is not None and not _inside_exactly(lexical, allowed):
        raise PathRefused(f"{uri} is outside your storage namespace ({', '.join(map(str, allowed))})")
    # From here on what exists decides: one answer for every way to be hidden.
    if _internal_local(resolved, settings) or (allowed is not None and not _inside_exactly(resolved, allowed)):
        raise PathUnavailable(unavailable(uri, owner, settings))
    if resolved.is_file() and resolved.stat().st_nlink > 1:  # a hard link may be anyone's file
        raise PathUnavailable(unavailable(uri, owner, settings))
    return str(resolved)


def _lexical(uri: str) -> Path:
    """The absolute path `uri` spells, before any symlink is followed (an accepted one)."""
    return Path(os.path.normpath(storage.file_uri_path(uri) if uri[:7].lower() == "file://" else uri))


def _own_areas(owner: str, settings: Settings, is_admin: bool) -> list[Path] | None:
    """The folders a caller may name (None: anything under the roots, for admins)."""
    if is_admin or not settings.owner_namespaces:
        return None
    return [root / owner_dirname(owner) for root in settings.local_roots]


def internal_areas(settings: Settings) -> list[Path]:
    """Folders and files that are llm-batch's own state, never a user path."""
    # The embedded stack's own files (llm_batch.devstack): Airflow's home, the CLI's key, the
    # database state and server folder, the Celery shape's services.
    areas = [settings.home / name for name in ("airflow", API_KEY_FILE, "stack.json", "postgres", "celery")]
    areas.append(Path(settings.model_cache))
    areas += [Path(u) for u in _own_prefixes(settings) if not storage.is_s3(u)]
    if airflow_home := os.environ.get("AIRFLOW_HOME"):
        areas.append(Path(airflow_home))
    return [a.expanduser().resolve() for a in areas]


def _fold(path: Path) -> str:
    """A spelling-blind form: case folded, trailing dots and spaces of each part dropped
    (as case-insensitive or Windows-style filesystems would read it)."""
    return "/".join(part.rstrip(". ").casefold() for part in path.parts).replace("//", "/")


def _within(path: Path, area: Path) -> bool:
    folded, base = _fold(path), _fold(area)
    return folded == base or folded.startswith(base.rstrip("/") + "/")


def _internal_local(path: Path, settings: Settings) -> bool:
    if any(_within(path, area) for area in internal_areas(settings)):
        return True
    if settings.database_url.startswith(_SQLITE):  # the database and its -wal/-shm/-journal
        db = Path(settings.database_url.removeprefix(_SQLITE)).expanduser().resolve()
        if _fold(path.parent) == _fold(db.parent) and _fold(Path(path.name)).startswith(_fold(Path(db.name))):
            return True
    return False


def _inside_exactly(path: Path, areas: list[Path]) -> bool:
    """Inside one of `areas` as spelled: an owner's folder has one spelling (no folding,
    which would let ``alice3`` name ``Alice3/``)."""
    return any(path.is_relative_to(area) for area in areas)


def unavailable(uri: str, owner: str, settings: Settings) -> str:
    """The one message for a path that is missing or hidden from `owner`."""
    return f"{uri}: no such file that you may use (yours live under {', '.join(namespaces(owner, settings))})"


def _why(exc: storage.StorageError) -> str:
    return str(exc).replace(" (LLM_BATCH_LOCAL_ROOTS)", "")


# -- s3 ------------------------------------------------------------------------------------


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
    """Where llm-batch keeps its data: jobs' work, uploaded files, the result cache."""
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
