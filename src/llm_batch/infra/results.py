"""A shard's results: its checkpoint, as ordered part objects ``{results}/part-<start>.jsonl`` of
``ResultRecord`` lines, each published whole, so a kill leaves the part or nothing and resuming
reads one listing and the last part. Records must be written in the shard's request order."""
from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import orjson

from llm_batch.core.layout import join_uri
from llm_batch.core.records import ResultRecord, dumps_line
from llm_batch.infra import storage

log = logging.getLogger(__name__)

# While storage fails, buffered records are offered again this long after a failure.
_RETRY_PUBLISH_AFTER_S = 5.0

_PART_NAME = re.compile(r"part-(\d+)\.jsonl")


class ResultsError(ValueError):
    """A results part is unreadable or a record arrived out of order."""


@dataclass(frozen=True)
class ResultPart:
    uri: str
    start: int  # shard position of the part's first record


def part_uri(results_uri: str, start: int) -> str:
    return join_uri(results_uri, f"part-{start:06d}.jsonl")


def list_parts(results_uri: str) -> list[ResultPart]:
    uris = storage.list_uris(results_uri.rstrip("/") + "/")
    # By name only: storage may normalise the prefix part of the URIs it returns.
    named = ((uri, _PART_NAME.fullmatch(uri.rsplit("/", 1)[-1])) for uri in uris)
    # Numeric, not lexical: a shard past 999,999 records gets 7-digit names.
    return sorted((ResultPart(uri, int(match.group(1))) for uri, match in named if match), key=lambda p: p.start)


def _parse(line: bytes, part: ResultPart, number: int) -> ResultRecord:
    try:
        return ResultRecord.model_validate_json(line)
    except ValueError as exc:
        raise ResultsError(f"{part.uri}: line {number} is not a result record: {exc}") from None


def read_results(results_uri: str) -> Iterator[ResultRecord]:
    """Every result of a shard, in order, streamed; overlapping parts (two writers resumed
    from one checkpoint) are read once."""
    position = 0
    for part in list_parts(results_uri):
        for number, line in enumerate(storage.stored_lines(part.uri), start=1):
            if part.start + number - 1 < position:
                continue
            yield _parse(line, part, number)
            position = part.start + number


def paired_results(requests_uri: str, results_uri: str) -> Iterator[tuple[dict[str, Any], ResultRecord | None]]:
    """Each request of a shard (a dict: the merge's hot loop reads three fields of millions),
    in order, with its result or None; results of no request (stale) are passed over."""
    results = read_results(results_uri)
    pending = next(results, None)
    for line in storage.stored_lines(requests_uri):
        request = orjson.loads(line)
        index = request["index"]
        while pending is not None and pending.index < index:
            pending = next(results, None)
        if pending is not None and pending.index == index:
            yield request, pending
            pending = next(results, None)
        else:
            yield request, None


def _resume_point(results_uri: str) -> tuple[int, ResultRecord | None]:
    """(how many results the shard has, the last one): one listing, the last part read."""
    parts = list_parts(results_uri)
    if not parts:
        return 0, None
    count, last = 0, None
    for count, last in enumerate(storage.stored_lines(parts[-1].uri), start=1):
        pass
    return parts[-1].start + count, (_parse(last, parts[-1], count) if last is not None else None)


def count_results(results_uri: str) -> int:
    return _resume_point(results_uri)[0]


class ResultsWriter:
    """Appends a shard's results as parts, one per ``flush_every_records`` records or ``flush_every_s``
    seconds (and at ``flush``, ``close``). While storage fails, records stay buffered and are offered
    again for up to ``outage_s``, then the ``StorageError`` propagates (the retry resumes after the last part)."""

    def __init__(self, results_uri: str, done: int, last_index: int | None, *,
                 flush_every_s: float = 2.0, flush_every_records: int = 1000, outage_s: float = 300.0):
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
    def open(cls, results_uri: str, **options: Any) -> ResultsWriter:
        done, last = _resume_point(results_uri)
        return cls(results_uri, done, last.index if last is not None else None, **options)

    def write(self, record: ResultRecord) -> None:
        if self._last_index is not None and record.index <= self._last_index:
            raise ResultsError(f"{self.results_uri}: result for request {record.index} written after request "
                               f"{self._last_index}; results must follow the shard's request order")
        if not self._buffer:
            self._buffer_since = time.monotonic()
        self._buffer.append(dumps_line(record))
        self._last_index = record.index
        self.done += 1
        if (len(self._buffer) >= self._flush_every_records
                or time.monotonic() - self._buffer_since >= self._flush_every_s):
            self.flush()

    def flush(self) -> None:
        if not self._buffer or time.monotonic() < self._retry_at:
            return
        try:
            self._publish()
        except storage.StorageError as exc:
            self._failed(exc)

    def close(self) -> None:
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

    def __exit__(self, *exc: object) -> None:
        self.close()
