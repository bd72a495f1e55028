"""Lines in and large writes out over any binary stream (``read(n)``, ``write(b)``), with
memory bounded by one chunk."""

from __future__ import annotations

from collections.abc import Iterator
from typing import BinaryIO

from llm_batch.infra import storage

CHUNK_BYTES = 1 << 16  # per open stream: merge holds 2 per shard, so keep it small


def iter_lines(stream: BinaryIO, chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
    """The lines of ``stream`` without their newline; a last line without one is kept. A
    long line is gathered in pieces and joined once: linear time, not quadratic."""
    pending: list[bytes] = []
    while chunk := stream.read(chunk_bytes):
        if b"\n" not in chunk:
            pending.append(chunk)
            continue
        lines = chunk.split(b"\n")
        if pending:
            pending.append(lines[0])
            lines[0] = b"".join(pending)
            pending.clear()
        tail = lines.pop()
        if tail:
            pending.append(tail)
        yield from lines
    if pending:
        yield b"".join(pending)


def stored_lines(uri: str) -> Iterator[bytes]:
    """The non-blank lines of the stored file ``uri``, streamed."""
    with storage.open_read(uri) as stream:
        for line in iter_lines(stream):
            if line.strip():
                yield line


class ChunkedWriter:
    """Small writes in, chunks of about ``chunk_bytes`` out (an S3 writer may send each write)."""

    def __init__(self, stream: BinaryIO, chunk_bytes: int = CHUNK_BYTES):
        self._stream = stream
        self._chunk_bytes = chunk_bytes
        self._parts: list[bytes] = []
        self._size = 0

    def write(self, data: bytes) -> None:
        self._parts.append(data)
        self._size += len(data)
        if self._size >= self._chunk_bytes:
            self.flush()

    def flush(self) -> None:
        if self._parts:
            self._stream.write(b"".join(self._parts))
            self._parts.clear()
            self._size = 0
