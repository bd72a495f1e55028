"""Validate a whole batch, streaming: one pass over the input, valid requests and error records
written as they come, counts and the first errors in the report (docs/validation.md). One bad
line never fails a batch: ``BatchRejected`` refuses only the input as a whole."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, closing, contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Any, BinaryIO

import orjson
from pydantic import BaseModel, Field

from llm_batch.core.config import Settings, get_settings
from llm_batch.core.endpoints import Endpoint, UnsupportedEndpointError, parse_endpoint
from llm_batch.core.formats import (
    ErrorCode,
    InputUnreadable,
    Item,
    RequestChecker,
    read_inline,
    read_jsonl,
    read_scale_v1,
    read_scale_v2,
    scale_v1_params,
    scale_v1_prompts,
    scan_scale_v1_params,
)
from llm_batch.core.input_formats import InputFormat
from llm_batch.core.layout import JobLayout
from llm_batch.core.model_choice import ModelChoice
from llm_batch.core.records import BatchRequest, ErrorRecord
from llm_batch.infra import storage
from llm_batch.infra.media import MediaResolver
from llm_batch.infra.storage import StorageError

OpenInput = Callable[[str], AbstractContextManager[BinaryIO]]


@dataclass(frozen=True)
class ValidationLimits:
    """The limits of one batch (defaults from Settings: LLM_BATCH_MAX_*)."""

    max_requests: int
    max_input_bytes: int
    max_line_bytes: int
    max_reported_errors: int

    @classmethod
    def from_settings(cls, settings: Settings | None = None) -> ValidationLimits:
        s = settings or get_settings()
        return cls(s.max_requests, s.max_input_bytes, s.max_line_bytes, s.max_reported_errors)


class ValidationReport(BaseModel):
    """Counts of one validation (never capped) and its first errors (capped)."""

    format: str
    endpoint: str | None = None
    total: int = 0
    valid: int = 0
    invalid: int = 0
    input_bytes: int = 0
    estimated_prompt_tokens: int = 0  # about 4 characters a token, summed over valid requests
    errors: list[ErrorRecord] = Field(default_factory=list)  # the first max_reported_errors

    def summary(self) -> dict[str, Any]:
        """What ``llm-batch validate`` prints."""
        return self.model_dump(include={"total": True, "valid": True, "invalid": True, "errors": {
            "__all__": {"line", "custom_id", "code", "message"}}})


class ValidationStopped(Exception):
    """``stopped()`` said so before the input was read through; nothing is published."""


# How often validation asks ``stopped()`` (a store read), in items.
STOP_CHECK_ITEMS = 2000
# A valid line's fields written only when set.
_OPTIONAL_FIELDS = ("media", "adapter", "adapter_uri")


class BatchRejected(Exception):
    """The whole batch is refused. ``reason``: unreadable, no_valid_requests, too_many_requests,
    input_too_large, unsupported_endpoint or duplicate_custom_id; ``report``: the counts when the
    input was read through."""

    def __init__(self, reason: str, message: str, report: ValidationReport | None = None):
        super().__init__(message)
        self.reason = reason
        self.report = report


def check_format(value: str) -> InputFormat:
    """The InputFormat for ``value``, or ValueError naming the known ones."""
    try:
        return InputFormat(value)
    except ValueError:
        known = ", ".join(f.value for f in InputFormat)
        raise ValueError(f"input format {value!r} is unknown; known formats: {known}") from None


def validate_batch(source: Any, *, fmt: InputFormat | str, endpoint: Endpoint | str | None = None,
                   layout: JobLayout | None = None, limits: ValidationLimits | None = None,
                   validated_out: BinaryIO | None = None, errors_out: BinaryIO | None = None,
                   open_input: OpenInput | None = None, media: MediaResolver | None = None,
                   models: ModelChoice | None = None, unique_custom_ids: bool = False,
                   stopped: Callable[[], bool] | None = None) -> ValidationReport:
    """Validate ``source`` and return the report; raise BatchRejected for a whole-batch refusal.

    ``source``: a URI or a list of URIs (read with ``open_input``, default ``storage.open_read``;
    indexes continue across files, messages name the file), a binary stream, or inline content
    (a list of dicts for ``inline``/``scale-v2``, a dict for ``scale-v1``). ``endpoint`` None:
    from the input, else /v1/chat/completions (/v1/completions for scale-v1).

    Valid requests go to ``validated_out`` and errors to ``errors_out``, in input order; with
    ``layout``, to its validated and validation_errors files (published even with no valid
    request, so the errors can be served) and the report. ``media`` resolves the files media
    lines name (without it: their form only); ``models``: the names a body.model may give
    (without it: any). ``unique_custom_ids``: a repeated custom_id refuses the batch.
    ``stopped``: asked every ``STOP_CHECK_ITEMS`` items; True raises ValidationStopped.
    """
    fmt = check_format(fmt)
    if layout is not None and (validated_out is not None or errors_out is not None):
        raise ValueError("give either a layout or output streams, not both")
    limits = limits or ValidationLimits.from_settings()
    try:
        checker = RequestChecker(parse_endpoint(endpoint) if endpoint else None, media or MediaResolver.offline(), models)
    except UnsupportedEndpointError as exc:
        raise BatchRejected("unsupported_endpoint", str(exc)) from None
    report = ValidationReport(format=fmt.value)
    budget = _ByteBudget(limits.max_input_bytes)
    items = _items(source, fmt, checker, limits, budget, open_input or storage.open_read)

    with ExitStack() as stack:
        stack.enter_context(closing(items))  # closes the input even when a limit stops us
        if layout is not None:
            validated_out = stack.enter_context(storage.open_write(layout.validated))
            errors_out = stack.enter_context(storage.open_write(layout.validation_errors))
        _consume(items, report, limits, validated_out, errors_out, unique_custom_ids, stopped)

    default = Endpoint.COMPLETIONS if fmt is InputFormat.SCALE_V1 else Endpoint.CHAT_COMPLETIONS
    report.endpoint = checker.settle(default).value
    report.input_bytes = budget.used
    report.estimated_prompt_tokens = (checker.prompt_chars + 3) // 4
    if layout is not None:
        storage.write_bytes(layout.validation_report, report.model_dump_json().encode())
    if report.valid == 0:
        raise BatchRejected("no_valid_requests", _no_valid_message(report), report)
    return report


def _consume(items: Iterator[Item], report: ValidationReport, limits: ValidationLimits, validated_out: BinaryIO | None,
             errors_out: BinaryIO | None, unique_custom_ids: bool = False,
             stopped: Callable[[], bool] | None = None) -> None:
    """Count and write every item; the hot loop of validation."""
    dumps, newline = orjson.dumps, orjson.OPT_APPEND_NEWLINE
    write_valid = validated_out.write if validated_out is not None else None
    write_error = errors_out.write if errors_out is not None else None
    errors, max_errors, max_requests = report.errors, limits.max_reported_errors, limits.max_requests
    total = valid = 0
    try:
        for item in items:
            total += 1
            if stopped is not None and total % STOP_CHECK_ITEMS == 0 and stopped():
                raise ValidationStopped(f"stopped after {total} requests")
            if total > max_requests:
                raise BatchRejected("too_many_requests", f"the input has more than {max_requests} "
                                    "requests (limit max_requests)")
            if type(item) is BatchRequest:
                valid += 1
                if write_valid is not None:
                    record = {"index": item.index, "custom_id": item.custom_id, "body": item.body, "line": item.line}
                    for name in _OPTIONAL_FIELDS:
                        if (value := getattr(item, name)) is not None:
                            record[name] = value
                    write_valid(dumps(record, option=newline))
            else:
                if unique_custom_ids and item.code == ErrorCode.DUPLICATE_CUSTOM_ID:
                    raise BatchRejected("duplicate_custom_id", f"line {item.line}: {item.message}")
                if len(errors) < max_errors:
                    errors.append(item)
                if write_error is not None:
                    write_error(dumps(item.model_dump(), option=newline))
    except InputUnreadable as exc:
        raise BatchRejected("unreadable", f"the input cannot be read as {report.format}: {exc}") from None
    report.total, report.valid, report.invalid = total, valid, total - valid


def _no_valid_message(report: ValidationReport) -> str:
    if report.total == 0:
        return "the input has no requests"
    first = report.errors[0] if report.errors else None
    detail = f" (first: line {first.line}, {first.code}: {first.message})" if first else ""
    return f"no valid request in the input: all {report.total} are invalid{detail}"


def _items(source: Any, fmt: InputFormat, checker: RequestChecker, limits: ValidationLimits, budget: _ByteBudget,
           open_input: OpenInput) -> Iterator[Item]:
    """Every item of every input, indexes continuing across files."""
    inline_list = isinstance(source, list) and not any(isinstance(s, str | os.PathLike) for s in source[:1])
    if fmt is InputFormat.INLINE or (fmt is InputFormat.SCALE_V2 and inline_list):
        if not isinstance(source, list):
            raise BatchRejected("unreadable", f"{fmt.value} inline content must be a list of objects, got "
                                f"{type(source).__name__}")
        reader = read_inline if fmt is InputFormat.INLINE else read_scale_v2
        yield from reader(source, checker, max_item_bytes=limits.max_line_bytes)
        return
    if fmt is InputFormat.SCALE_V1 and isinstance(source, dict):
        yield from read_scale_v1(scale_v1_params(source), source["prompts"], checker,
                                 max_item_bytes=limits.max_line_bytes)
        return
    inputs = _openers(source, open_input)
    next_index = 0
    for name, open_stream in inputs:
        where = f"{name}: " if len(inputs) > 1 else ""
        for item in _read_one(fmt, name, open_stream, checker, limits, budget, next_index, where):
            next_index = item.index + 1
            yield item


def _read_one(fmt: InputFormat, name: str, open_stream: Callable[[], AbstractContextManager[BinaryIO]],
              checker: RequestChecker, limits: ValidationLimits, budget: _ByteBudget, start_index: int,
              where: str) -> Iterator[Item]:
    if fmt is InputFormat.SCALE_V1:
        # Two passes: the shared fields may follow the prompts in the object.
        with _opened(name, open_stream) as stream:
            params = scan_scale_v1_params(_CountingReader(stream, budget), where)
        with _opened(name, open_stream) as stream:
            prompts = scale_v1_prompts(stream, where)
            yield from read_scale_v1(params, prompts, checker, start_index=start_index, where=where,
                                     max_item_bytes=limits.max_line_bytes)
        return
    with _opened(name, open_stream) as stream:
        counted = _CountingReader(stream, budget)
        if fmt is InputFormat.JSONL:
            yield from read_jsonl(counted, checker, max_line_bytes=limits.max_line_bytes,
                                  start_index=start_index, where=where)
        else:
            yield from read_scale_v2(counted, checker, start_index=start_index, where=where,
                                     max_item_bytes=limits.max_line_bytes)


@contextmanager
def _opened(name: str, open_stream: Callable[[], AbstractContextManager[BinaryIO]]) -> Iterator[BinaryIO]:
    """Open an input; failing to open or read it makes the input unreadable, naming it."""
    try:
        with open_stream() as stream:
            yield stream
    except StorageError as exc:  # its message names the URI
        raise InputUnreadable(str(exc)) from None
    except OSError as exc:
        raise InputUnreadable(f"{name}: {exc.strerror or exc}") from None


def _openers(source: Any, open_input: OpenInput) -> list[tuple[str, Callable[[], Any]]]:
    """(name, opener) per input; an opener may be called twice (scale-v1 reads twice)."""
    if isinstance(source, os.PathLike):
        source = os.fspath(source)
    if isinstance(source, str):
        return [(source, lambda: open_input(source))]
    if hasattr(source, "read"):
        return [("input", _rereadable(source))]
    if isinstance(source, Sequence) and all(isinstance(s, str | os.PathLike) for s in source):
        return [(uri, partial(open_input, uri)) for uri in map(os.fspath, source)]
    raise TypeError(f"cannot read a batch from {type(source).__name__}")


def _rereadable(stream: BinaryIO) -> Callable[[], AbstractContextManager[BinaryIO]]:
    """An opener for a caller's stream, from its start each time (spooled to a temporary file if it
    cannot seek); the caller keeps it open."""
    if not stream.seekable():
        spooled = tempfile.TemporaryFile()
        shutil.copyfileobj(stream, spooled)
        spooled.seek(0)
        stream = spooled
    start = stream.tell()

    def opener() -> AbstractContextManager[BinaryIO]:
        stream.seek(start)
        return nullcontext(stream)

    return opener


class _ByteBudget:
    """Counts the bytes read from all inputs; over ``limit`` the batch is rejected."""

    def __init__(self, limit: int):
        self.limit = limit
        self.used = 0

    def spend(self, data: bytes) -> bytes:
        self.used += len(data)
        if self.used > self.limit:
            raise BatchRejected("input_too_large", f"the input is over {self.limit} bytes "
                                "(limit max_input_bytes)")
        return data


class _CountingReader:
    """A read-only view of a stream that charges what it reads to a byte budget."""

    def __init__(self, stream: BinaryIO, budget: _ByteBudget):
        self._read, self._readline, self._spend = stream.read, stream.readline, budget.spend

    def read(self, size: int = -1) -> bytes:
        return self._spend(self._read(size))

    def readline(self, size: int = -1) -> bytes:
        return self._spend(self._readline(size))
