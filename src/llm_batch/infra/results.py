"""A shard's results: its checkpoint, as ordered part objects under ``ShardLayout.results``.

    {results}/part-000000.jsonl   ResultRecord lines, in the shard's request order
    {results}/part-000250.jsonl   the number in a part's name is the shard position of its
    {results}/part-000731.jsonl   first record (how many records come before it)

Each part is published whole with ``storage.open_write`` (atomic on disk and S3), so a
kill -9 leaves either the part or nothing, never a torn line. Naming parts by their start
position makes resuming cheap however many parts a long shard makes: ``done`` is the last
part's start plus its line count, so only one listing and one small read are needed.

Records must be written in the shard's request order (the worker reorders what the engine
finishes out of order); the writer refuses an index that does not increase.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import orjson

from llm_batch.core.layout import join_uri
from llm_batch.core.records import ResultRecord, dumps_line
from llm_batch.infra import storage
from llm_batch.infra.streams import stored_lines

log = logging.getLogger(__name__)

# While storage fails, a checkpoint's records stay buffered and are offered again this long
# after the failure (each publish already retries briefly, storage.RETRY_ATTEMPTS).
_RETRY_PUBLISH_AFTER_S = 5.0

_PART_NAME = re.compile(r"part-(\d+)\.jsonl")


class ResultsError(ValueError):
    """A results part is unreadable or a record arrived out of order; the message says where."""


@dataclass(frozen=True)
class ResultPart:
    uri: str
    start: int  # shard position of the part's first record


def part_uri(results_uri: str, start: int) -> str:
    return join_uri(results_uri, f"part-{start:06d}.jsonl")


def list_parts(results_uri: str) -> list[ResultPart]:
    """The published parts under ``results_uri``, in shard order (one listing call)."""
    parts = []
    for uri in storage.list_uris(results_uri.rstrip("/") + "/"):
        # By name only: storage may normalise the prefix part of the URIs it returns.
        match = _PART_NAME.fullmatch(uri.rsplit("/", 1)[-1])
        if match:
            parts.append(ResultPart(uri, int(match.group(1))))
    # Numeric, not lexical: a shard past 999,999 records gets 7-digit names.
    return sorted(parts, key=lambda p: p.start)


def _parse(line: bytes, part: ResultPart, number: int) -> ResultRecord:
    try:
        return ResultRecord.model_validate_json(line)
    except ValueError as exc:
        raise ResultsError(f"{part.uri}: line {number} is not a result record: {exc}") from None


def read_results(results_uri: str) -> Iterator[ResultRecord]:
    """Every result of a shard, in order, across parts (streamed: one line in memory).

    Parts that overlap (two writers resumed from the same checkpoint) are read once: records
    at a position already yielded are skipped.
    """
    position = 0
    for part in list_parts(results_uri):
        for number, line in enumerate(stored_lines(part.uri), start=1):
            if part.start + number - 1 < position:
                continue
            yield _parse(line, part, number)
            position = part.start + number


def paired_results(requests_uri: str, results_uri: str) -> Iterator[tuple[dict[str, Any], ResultRecord | None]]:
    """Each request of a shard (its stored ``BatchRequest`` as a dict: the merge's hot loop
    reads three fields of millions), in order, with its result (None while it has none).

    Results at indices the requests file does not hold (a stale checkpoint) are passed over.
    """
    results = read_results(results_uri)
    pending = next(results, None)
    for line in stored_lines(requests_uri):
        request = orjson.loads(line)
        index = request["index"]
        while pending is not None and pending.index < index:
            pending = next(results, None)
        if pending is not None and pending.index == index:
            yield request, pending
            pending = next(results, None)
        else:
            yield request, None


def _last_record(part: ResultPart) -> tuple[int, ResultRecord | None]:
    """(line count, last record) of one part."""
    count, last = 0, None
    for count, last in enumerate(stored_lines(part.uri), start=1):
        pass
    return count, (_parse(last, part, count) if last is not None else None)


def count_results(results_uri: str) -> int:
    """How many results the shard has (a prefix of its requests); reads only the last part."""
    parts = list_parts(results_uri)
    if not parts:
        return 0
    count, _ = _last_record(parts[-1])
    return parts[-1].start + count


class ResultsWriter:
    """Appends a shard's results as parts; ``done`` results were already there at open.

    ``write`` buffers and publishes a part when ``flush_every_records`` records are buffered
    or ``flush_every_s`` seconds passed since the first buffered one (checked on write; call
    ``flush`` at your own checkpoints, e.g. before checking for cancel). ``close`` flushes;
    so does leaving a ``with`` block, even on error, since buffered results are complete.

    A storage outage does not stop the shard: unpublished records stay buffered and are
    offered again at later checkpoints, for up to ``outage_s`` after the first failure;
    ``close`` keeps trying that long too. Past it the ``StorageError`` propagates (the shard
    fails; its retry resumes after the last published part). A part is published whole or
    not at all, so a repeated attempt at one part only ever adds records to it.
    """

    def __init__(self, results_uri: str, done: int, last_index: int | None, *,
                 flush_every_s: float, flush_every_records: int, outage_s: float = 300.0):
        self.results_uri = results_uri
        self.done = done
        self._published = done
        self._last_index = last_index
        self._flush_every_s = flush_every_s
        self._flush_every_records = flush_every_records
        self._outage_s = outage_s
        self._buffer: list[bytes] = []
        self._buffer_since = 0.0
        self._failing_since: float | None = None
        self._retry_at = 0.0

    @classmethod
    def open(cls, results_uri: str, *, flush_every_s: float = 2.0,
             flush_every_records: int = 1000, outage_s: float = 300.0) -> ResultsWriter:
        parts = list_parts(results_uri)
        done, last_index = 0, None
        if parts:
            count, last = _last_record(parts[-1])
            done = parts[-1].start + count
            last_index = last.index if last is not None else None
        return cls(results_uri, done, last_index, flush_every_s=flush_every_s,
                   flush_every_records=flush_every_records, outage_s=outage_s)

    def write(self, record: ResultRecord) -> None:
        if self._last_index is not None and record.index <= self._last_index:
            raise ResultsError(
                f"{self.results_uri}: result for request {record.index} written after "
                f"request {self._last_index}; results must follow the shard's request order"
            )
        if not self._buffer:
            self._buffer_since = time.monotonic()
        self._buffer.append(dumps_line(record))
        self._last_index = record.index
        self.done += 1
        if (len(self._buffer) >= self._flush_every_records
                or time.monotonic() - self._buffer_since >= self._flush_every_s):
            self.flush()

    def flush(self) -> None:
        """Publish the buffered records as the next part (nothing to do when empty); while
        storage fails they stay buffered for a later checkpoint (see the class)."""
        if not self._buffer or time.monotonic() < self._retry_at:
            return
        try:
            self._publish()
        except storage.StorageError as exc:
            self._failed(exc)

    def close(self) -> None:
        """The last publish, tried again every few seconds while storage fails (see the class)."""
        while self._buffer:
            try:
                self._publish()
            except storage.StorageError as exc:
                self._failed(exc)
                time.sleep(max(self._retry_at - time.monotonic(), 0.0))

    def _publish(self) -> None:
        with storage.open_write(part_uri(self.results_uri, self._published)) as stream:
            stream.write(b"".join(self._buffer))
        self._published += len(self._buffer)
        self._buffer.clear()
        if self._failing_since is not None:
            log.warning("results published again after %.0f s of storage failures",
                        time.monotonic() - self._failing_since)
        self._failing_since = None

    def _failed(self, exc: storage.StorageError) -> None:
        now = time.monotonic()
        if self._failing_since is None:
            self._failing_since = now
        if now - self._failing_since >= self._outage_s:
            raise exc
        self._retry_at = now + _RETRY_PUBLISH_AFTER_S
        log.warning("%d results not published yet (kept; tried again in %.0f s): %s",
                    len(self._buffer), _RETRY_PUBLISH_AFTER_S, exc)

    def __enter__(self) -> ResultsWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
