"""TEMPORARY local stand-in for llm_batch.storage until the real module lands (then deleted)."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from llm_batch import storage


@contextlib.contextmanager
def open_read(uri):
    try:
        f = open(uri, "rb")
    except FileNotFoundError:
        raise storage.ObjectNotFound(uri, "not found") from None
    with f:
        yield f


@contextlib.contextmanager
def open_write(uri):
    Path(uri).parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=Path(uri).parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
        os.replace(tmp, uri)
    except BaseException:
        os.unlink(tmp)
        raise


def read_bytes(uri):
    with open_read(uri) as f:
        return f.read()


def write_bytes(uri, data):
    with open_write(uri) as f:
        f.write(data)


def exists(uri):
    return Path(uri).is_file()


def list_uris(prefix):
    base = Path(prefix.rstrip("/"))
    root = base if base.is_dir() else base.parent
    out = [str(p) for p in root.rglob("*") if p.is_file() and not p.name.startswith(".tmp-")]
    return sorted(u for u in out if u.startswith(prefix))


def delete(uri):
    Path(uri).unlink(missing_ok=True)


def delete_prefix(prefix):
    base = Path(prefix.rstrip("/"))
    if base.is_dir():
        shutil.rmtree(base)


@pytest.fixture(autouse=True)
def local_storage(monkeypatch):
    if hasattr(storage, "open_write"):
        yield
        return
    for fn in (open_read, open_write, read_bytes, write_bytes, exists, list_uris, delete, delete_prefix):
        monkeypatch.setattr(storage, fn.__name__, fn, raising=False)
    yield
