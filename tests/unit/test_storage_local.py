"""llm_batch.infra.storage over local paths: confinement, atomic writes, streaming, listing."""

from __future__ import annotations

import functools
import os
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from llm_batch.core.config import Settings, get_settings
from llm_batch.infra import storage
from llm_batch.infra.storage import AccessDenied, ObjectNotFound, PathNotAllowed, StorageError

MIB = 1024**2


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """An allowed root (``store``'s local_roots) beside a directory outside it."""
    allowed = tmp_path / "root"
    allowed.mkdir()
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret.txt").write_text("secret")
    return allowed.resolve()


class Confined:
    """storage's functions, each given ``settings`` (the roots under test)."""

    def __init__(self, settings: Settings):
        self.settings = settings

    def __getattr__(self, name: str) -> Any:
        return functools.partial(getattr(storage, name), settings=self.settings)


@pytest.fixture
def store(root: Path) -> Confined:
    """storage confined to ``root`` (and llm-batch's own areas of the session's home)."""
    return Confined(get_settings().model_copy(update={"local_roots": [root]}))


# -- confinement

def test_paths_inside_the_root_are_allowed(root: Path, store: Confined) -> None:
    store.write_bytes(str(root / "a" / "b.txt"), b"hello")
    assert store.read_bytes(str(root / "a" / "b.txt")) == b"hello"
    assert store.read_bytes(f"file://{root}/a/b.txt") == b"hello"
    assert store.read_bytes(f"file://localhost{root}/a/b.txt") == b"hello"
    assert store.check(f"file://{root}/a/%62.txt") == str(root / "a" / "b.txt")


def test_dotdot_is_refused_even_when_it_stays_inside(root: Path, store: Confined) -> None:
    (root / "a").mkdir()
    for uri in (f"{root}/a/../../outside/secret.txt", f"{root}/a/../x.txt",
                f"file://{root}/a/../../outside/secret.txt", f"file://{root}/a/%2e%2e/x.txt"):
        with pytest.raises(PathNotAllowed, match=r"'\.\.' is not allowed") as info:
            store.check(uri)
        assert info.value.uri == uri


def test_absolute_path_outside_is_refused_with_the_roots_named(root: Path, store: Confined) -> None:
    outside = root.parent / "outside" / "secret.txt"
    for operation in (store.check, store.read_bytes, store.exists, store.size):
        with pytest.raises(PathNotAllowed, match=f"outside the allowed roots {root}"):
            operation(str(outside))
    with pytest.raises(PathNotAllowed):
        store.read_bytes(f"file://{outside}")
    with pytest.raises(PathNotAllowed):
        store.write_bytes("/etc/llm-batch-should-not-exist", b"x")
    assert not Path("/etc/llm-batch-should-not-exist").exists()


def test_relative_path_resolves_from_cwd(root: Path, store: Confined, monkeypatch: pytest.MonkeyPatch) -> None:
    (root / "in.jsonl").write_bytes(b"{}\n")
    monkeypatch.chdir(root)
    assert store.read_bytes("in.jsonl") == b"{}\n"
    monkeypatch.chdir(root.parent)
    with pytest.raises(PathNotAllowed, match="outside the allowed roots"):
        store.check("outside/secret.txt")


def test_symlink_escaping_the_root_is_refused(root: Path, store: Confined) -> None:
    (root / "link-file").symlink_to(root.parent / "outside" / "secret.txt")
    (root / "link-dir").symlink_to(root.parent / "outside")
    for uri in (str(root / "link-file"), str(root / "link-dir" / "secret.txt"),
                str(root / "link-dir" / "new.txt")):
        with pytest.raises(PathNotAllowed, match="symlink leads outside"):
            store.check(uri)
    with pytest.raises(PathNotAllowed):
        store.write_bytes(str(root / "link-dir" / "new.txt"), b"x")
    assert not (root.parent / "outside" / "new.txt").exists()


def test_paths_with_spaces_plain_or_percent_encoded(root: Path, store: Confined) -> None:
    (root / "my dir").mkdir()
    (root / "my dir" / "a b.jsonl").write_text("x")
    for uri in (f"{root}/my dir/a b.jsonl", f"file://{root}/my%20dir/a%20b.jsonl",
                f"file://{root}/my dir/a b.jsonl"):
        assert store.read_bytes(uri) == b"x"


def test_symlink_inside_the_root_is_followed(root: Path, store: Confined) -> None:
    (root / "data").mkdir()
    (root / "data" / "x.txt").write_bytes(b"x")
    (root / "alias").symlink_to(root / "data")
    assert store.check(str(root / "alias" / "x.txt")) == str(root / "data" / "x.txt")
    assert store.read_bytes(str(root / "alias" / "x.txt")) == b"x"


def test_malformed_uris_are_refused(root: Path, store: Confined) -> None:
    for uri, reason in [("", "empty"), ("gs://bucket/key", "unsupported scheme 'gs'"),
                        ("http://host/x", "unsupported scheme"), ("file://host/x", "file:///"),
                        (f"{root}/a\0b", "NUL"), ("s3://Bad_Bucket/x", "invalid bucket name"),
                        # typos a user makes: a home-relative path, a URI with one slash
                        ("~/batch.jsonl", "'~' is not expanded"),
                        ("s3:/bucket/key.jsonl", "write s3://")]:
        with pytest.raises(PathNotAllowed, match=reason):
            store.check(uri)


def test_internal_default_uris_are_under_the_default_root(llm_batch_home: Path) -> None:
    settings = Settings()  # the session's environment: LLM_BATCH_HOME only
    assert settings.work_uri == str(llm_batch_home.resolve() / "work")
    assert settings.files_uri == str(llm_batch_home.resolve() / "files")
    for uri in (settings.work_uri, settings.files_uri):  # internal I/O is confined to the root
        storage.write_bytes(f"{uri}/probe", b"x", settings=settings)
        assert storage.read_bytes(f"{uri}/probe", settings=settings) == b"x"


# -- atomic writes

def test_write_appears_only_on_clean_exit(root: Path, store: Confined) -> None:
    target = root / "jobs" / "out.jsonl"
    with store.open_write(str(target)) as out:
        out.write(b"line 1\n")
        assert not target.exists()  # not published while the block runs
    assert target.read_bytes() == b"line 1\n"


def test_exception_inside_the_block_leaves_no_object(root: Path, store: Confined) -> None:
    target = root / "out.jsonl"
    with pytest.raises(RuntimeError):
        with store.open_write(str(target)) as out:
            out.write(b"partial\n")
            raise RuntimeError("boom")
    assert not target.exists()
    assert list(root.iterdir()) == []  # no temp file left behind either


def test_failed_rewrite_keeps_the_old_object(root: Path, store: Confined) -> None:
    target = root / "progress.json"
    store.write_bytes(str(target), b'{"done": 1}')
    with pytest.raises(RuntimeError):
        with store.open_write(str(target)) as out:
            out.write(b'{"done": 2')
            raise RuntimeError("killed mid-write")
    assert target.read_bytes() == b'{"done": 1}'


def test_written_files_get_normal_permissions(root: Path, store: Confined) -> None:
    store.write_bytes(str(root / "f"), b"x")
    mask = os.umask(0)
    os.umask(mask)
    assert (root / "f").stat().st_mode & 0o777 == 0o666 & ~mask


# -- reads

def test_streaming_read_of_a_big_file_stays_small(root: Path, store: Confined) -> None:
    big = root / "big.jsonl"
    line = b'{"custom_id": "x", "body": {}}\n'
    with open(big, "wb") as out:
        for _ in range(40):
            out.write(line * (MIB // len(line)))
    tracemalloc.start()
    try:
        with store.open_read(str(big)) as stream:
            count = sum(1 for _ in stream)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert count == 40 * (MIB // len(line))
    assert peak < 4 * MIB  # ~40 MiB file, never held whole


def test_missing_file_and_directory_errors_name_the_uri(root: Path, store: Confined) -> None:
    missing = str(root / "nope.jsonl")
    with pytest.raises(ObjectNotFound) as info:
        store.read_bytes(missing)
    assert info.value.uri == missing and missing in str(info.value)
    with pytest.raises(ObjectNotFound):
        store.size(missing)
    assert not store.exists(missing)
    (root / "dir").mkdir()
    with pytest.raises(StorageError, match="is a directory"):
        store.read_bytes(str(root / "dir"))
    assert not store.exists(str(root / "dir"))


def test_os_errors_map_to_storage_errors() -> None:
    # Root (as in CI) reads files whatever their mode, so the mapping is checked directly.
    with pytest.raises(AccessDenied, match="x.txt: permission denied"):
        with storage._os_errors("x.txt"):
            raise PermissionError(13, "Permission denied")
    with pytest.raises(StorageError, match="x.txt: No space left on device"):
        with storage._os_errors("x.txt"):
            raise OSError(28, "No space left on device")


# -- listing and deleting

def test_list_uris_is_recursive_sorted_and_keeps_the_spelling(root: Path, store: Confined) -> None:
    job = root / "work" / "job-1"
    for name in ("shards/00001/requests.jsonl", "shards/00000/requests.jsonl", "validated.jsonl"):
        store.write_bytes(str(job / name), b"x")
    store.write_bytes(str(root / "work" / "job-10" / "validated.jsonl"), b"x")
    expected = ["shards/00000/requests.jsonl", "shards/00001/requests.jsonl", "validated.jsonl"]

    assert store.list_uris(str(job)) == [f"{job}/{n}" for n in expected]
    assert store.list_uris(f"file://{job}/") == [f"file://{job}/{n}" for n in expected]
    assert store.list_uris(str(root / "work" / "absent")) == []
    assert store.list_uris(str(job / "validated.jsonl")) == []  # a file is not a prefix


def test_delete_and_delete_prefix(root: Path, store: Confined) -> None:
    job = root / "work" / "job-1"
    store.write_bytes(str(job / "a" / "b.txt"), b"x")
    store.write_bytes(str(job / "cancel"), b"")
    store.write_bytes(str(root / "work" / "job-2" / "keep.txt"), b"x")

    store.delete(str(job / "cancel"))
    assert not store.exists(str(job / "cancel"))
    store.delete(str(job / "cancel"))  # idempotent

    store.delete_prefix(str(job))
    assert not job.exists()
    assert store.list_uris(str(root)) == [f"{root}/work/job-2/keep.txt"]
    store.delete_prefix(str(job))  # missing prefix: nothing to do
    with pytest.raises(PathNotAllowed, match="whole storage root"):
        store.delete_prefix(str(root))
    with pytest.raises(PathNotAllowed):
        store.delete_prefix(str(root.parent / "outside"))
    assert (root.parent / "outside" / "secret.txt").exists()


def test_download_dir_copies_a_local_directory(root: Path, store: Confined, tmp_path: Path) -> None:
    model = root / "models" / "tiny"
    store.write_bytes(str(model / "config.json"), b"{}")
    store.write_bytes(str(model / "tokenizer" / "tokenizer.json"), b"[]")
    dest = store.download_dir(str(model), tmp_path / "cache")
    assert dest == (tmp_path / "cache").resolve()
    assert sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file()) == [
        "config.json", "tokenizer/tokenizer.json"]
    assert (dest / "tokenizer" / "tokenizer.json").read_bytes() == b"[]"
    with pytest.raises(ObjectNotFound):
        store.download_dir(str(root / "models" / "absent"), tmp_path / "cache")


def test_download_dir_refuses_a_symlink_out_of_the_root(root: Path, store: Confined, tmp_path: Path) -> None:
    model = root / "models" / "tiny"
    store.write_bytes(str(model / "config.json"), b"{}")
    (model / "stolen.txt").symlink_to(root.parent / "outside" / "secret.txt")
    with pytest.raises(PathNotAllowed, match="symlink"):
        store.download_dir(str(model), tmp_path / "cache")
    assert not (tmp_path / "cache" / "stolen.txt").exists()
