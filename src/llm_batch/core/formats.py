"""Streaming readers for the input formats (``InputFormat``): each yields, per input item, one
``BatchRequest`` or ``ErrorRecord``, in input order. ``index`` continues across input files;
blank JSONL lines get none but count in line numbers, so they match an editor's."""

from __future__ import annotations

import re
from array import array
from collections.abc import Callable, Iterable, Iterator
from enum import StrEnum
from itertools import chain
from typing import Any, BinaryIO, Protocol

import ijson
import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from llm_batch.core import strict_json
from llm_batch.core.endpoints import MEDIA_ENDPOINTS, SUPPORTED_ENDPOINTS, Endpoint
from llm_batch.core.model_choice import ModelChoice, ModelRefused
from llm_batch.core.records import BatchRequest, ErrorRecord
from llm_batch.core.schemas import body_model_for, describe_validation_error, fast_check_for, prompt_chars, shown

Item = BatchRequest | ErrorRecord


class ErrorCode(StrEnum):
    """Stable codes of per-item errors (documented in docs/validation.md)."""

    INVALID_UTF8 = "invalid_utf8"
    INVALID_JSON = "invalid_json"
    NOT_AN_OBJECT = "not_an_object"
    LINE_TOO_LONG = "line_too_long"
    MISSING_CUSTOM_ID = "missing_custom_id"
    INVALID_CUSTOM_ID = "invalid_custom_id"
    DUPLICATE_CUSTOM_ID = "duplicate_custom_id"
    INVALID_METHOD = "invalid_method"
    URL_MISMATCH = "url_mismatch"
    ENDPOINT_MISMATCH = "endpoint_mismatch"
    MISSING_BODY = "missing_body"
    INVALID_BODY = "invalid_body"
    INVALID_MEDIA = "invalid_media"
    MODEL_NOT_AVAILABLE = "model_not_available"


class InputUnreadable(Exception):
    """The input as a whole cannot be read (not JSON, wrong top-level shape): the batch is rejected."""


class IdSet:
    """The custom_ids seen so far, as 64-bit hashes in an open-addressing table: at most 16
    bytes an id, against ~100 in a ``set`` of strings. Two ids collide with probability
    ~n²/2⁶⁵ (3e-8 for a million); the later one would be reported as a duplicate."""

    def __init__(self, capacity: int = 1 << 12):
        self._slots = array("q", bytes(8 * capacity))
        self._mask = capacity - 1
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def add(self, key: str) -> bool:
        """Add ``key``; False when it was already there."""
        fingerprint = hash(key) or 1  # 0 marks an empty slot
        slots, mask = self._slots, self._mask
        i = fingerprint & mask
        while (seen := slots[i]) != 0:
            if seen == fingerprint:
                return False
            i = (i + 1) & mask
        slots[i] = fingerprint
        self._count += 1
        if self._count * 2 > len(slots):
            self._grow()
        return True

    def _grow(self) -> None:
        old = self._slots
        self._slots = slots = array("q", bytes(16 * len(old)))
        self._mask = mask = len(slots) - 1
        for fingerprint in old:
            if fingerprint:
                i = fingerprint & mask
                while slots[i]:
                    i = (i + 1) & mask
                slots[i] = fingerprint


class MediaRefused(ValueError):
    """A line's file cannot be used; the message names the body field and why."""


class MediaLookup(Protocol):
    """Resolves the file a media line names (``llm_batch.infra.media.MediaResolver``)."""

    def resolve(self, endpoint: Endpoint, body: dict[str, Any]) -> dict[str, Any] | None: ...


class RequestChecker:
    """Checks items against one job: custom_id, method, url and body for its endpoint.

    ``endpoint`` None: the first item that implies one (a JSONL ``url``, a Scale item's prompt
    or messages) fixes it, else ``settle(default)``. Without ``media``, media lines are checked
    for their form only; without ``models`` (offline validation), any body.model is taken.
    """

    def __init__(self, endpoint: Endpoint | str | None = None, media: MediaLookup | None = None,
                 models: ModelChoice | None = None):
        self.endpoint: Endpoint | None = Endpoint(endpoint) if endpoint else None
        self.media = media
        self.models = models
        self.seen_ids = IdSet()
        self.prompt_chars = 0
        self._fast: Callable[[dict[str, Any]], int | None] | None = None
        self._model: type[BaseModel] | None = None
        if self.endpoint:
            self._use(self.endpoint)

    def _use(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self._fast = fast_check_for(endpoint)
        self._model = body_model_for(endpoint)

    def settle(self, default: Endpoint) -> Endpoint:
        """The job's endpoint: the one named or implied, else ``default``."""
        if self.endpoint is None:
            self._use(default)
        return self.endpoint  # type: ignore[return-value]

    def claims(self, implied: Endpoint) -> bool:
        """Whether an item implying ``implied`` fits the job (fixing the endpoint if unset)."""
        if self.endpoint is None:
            self._use(implied)
        return implied == self.endpoint

    def check_line(self, raw: bytes, index: int, line: int, where: str) -> Item:
        """One JSONL line (bytes, with or without its newline)."""
        try:
            obj = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            return _bad_bytes(raw, exc, index, line, where)
        if type(obj) is not dict:
            hint = _first_line_hint(raw) if line == 1 else ""
            return _error(index, line, None, ErrorCode.NOT_AN_OBJECT,
                          f"{where}expected a JSON object, got {_json_kind(obj)}{hint}")
        # Counting brackets is cheap; only a line with enough of them can be too deep.
        if raw.count(b"[") + raw.count(b"{") > strict_json.MAX_DEPTH and (deep := strict_json.depth_problem(obj)):
            return _error(index, line, _id_if_str(obj), ErrorCode.INVALID_JSON, f"{where}{deep}")
        return self.check_record(obj, index, line, where)

    def check_record(self, obj: dict[str, Any], index: int, line: int, where: str, *,
                     id_required: bool = True) -> Item:
        """A ``{"custom_id", "method"?, "url"?, "body"}`` object."""
        custom_id = obj.get("custom_id")
        if custom_id is None:
            if id_required:
                return _error(index, line, None, ErrorCode.MISSING_CUSTOM_ID, f"{where}custom_id is missing")
            custom_id = str(index)
        elif type(custom_id) is not str or not custom_id:
            return _error(index, line, None, ErrorCode.INVALID_CUSTOM_ID,
                          f"{where}custom_id must be a non-empty string, got {shown(custom_id)}")
        # The first item naming a custom_id owns it, whether or not the item is valid.
        if not self.seen_ids.add(custom_id):
            return _error(index, line, custom_id, ErrorCode.DUPLICATE_CUSTOM_ID,
                          f"{where}custom_id {shown(custom_id)} is already used by an earlier request")
        method = obj.get("method")
        if method is not None and method != "POST":
            return _error(index, line, custom_id, ErrorCode.INVALID_METHOD,
                          f"{where}method must be \"POST\", got {shown(method)}")
        url = obj.get("url")
        if url is not None and not self._url_fits(url):
            wanted = (f"the job's endpoint {self.endpoint}" if self.endpoint else
                      f"a supported endpoint ({', '.join(SUPPORTED_ENDPOINTS)})")
            return _error(index, line, custom_id, ErrorCode.URL_MISMATCH, f"{where}url {shown(url)} is not {wanted}")
        body = obj.get("body")
        if body is None:
            return _error(index, line, custom_id, ErrorCode.MISSING_BODY, f"{where}body is missing")
        return self.check_body(body, custom_id, index, line, where)

    def _url_fits(self, url: Any) -> bool:
        if self.endpoint is None and url in SUPPORTED_ENDPOINTS:
            self._use(Endpoint(url))
        return url == self.endpoint

    def check_body(self, body: Any, custom_id: str, index: int, line: int, where: str) -> Item:
        """A request body against the job's endpoint schema (fast path first)."""
        if type(body) is not dict:
            return _error(index, line, custom_id, ErrorCode.INVALID_BODY,
                          f"{where}body must be a JSON object, got {_json_kind(body)}")
        if self._fast is None:
            self.settle(Endpoint.CHAT_COMPLETIONS)
        chars = self._fast(body)  # type: ignore[misc]
        if chars is None:
            try:
                self._model.model_validate(body)  # type: ignore[union-attr]
            except ValidationError as exc:
                return _error(index, line, custom_id, ErrorCode.INVALID_BODY, where + describe_validation_error(exc))
            chars = prompt_chars(body)
        media = None
        if self.endpoint in MEDIA_ENDPOINTS and self.media is not None:
            try:
                media = self.media.resolve(self.endpoint, body)
            except MediaRefused as exc:
                return _error(index, line, custom_id, ErrorCode.INVALID_MEDIA, f"{where}{exc}")
        adapter = None
        if self.models is not None:
            try:
                adapter = self.models.adapter_of(body.get("model"))
            except ModelRefused as exc:
                return _error(index, line, custom_id, ErrorCode.MODEL_NOT_AVAILABLE, f"{where}body.model: {exc}")
        self.prompt_chars += chars
        adapter_uri = self.models.locations.get(adapter) if adapter else None
        return BatchRequest.model_construct(index=index, custom_id=custom_id, body=body, line=line, media=media,
                                            adapter=adapter, adapter_uri=adapter_uri)


def _error(index: int, line: int, custom_id: str | None, code: ErrorCode, message: str) -> ErrorRecord:
    return ErrorRecord.model_construct(index=index, line=line, custom_id=custom_id, code=code.value, message=message)


def _json_kind(value: Any) -> str:
    kinds = {list: "an array", str: "a string", bool: "a boolean", int: "a number",
             float: "a number", type(None): "null"}
    return kinds.get(type(value), type(value).__name__)


def not_json(value: Any, path: str) -> tuple[ErrorCode, str] | None:
    """Why inline content (Python objects, not parsed here) is not strict JSON, and where; None when it is."""
    found = strict_json.problem(value, path)
    if found is None:
        return None
    return (ErrorCode.INVALID_UTF8 if found.unicode else ErrorCode.INVALID_JSON), str(found)


def _bad_bytes(raw: bytes, exc: orjson.JSONDecodeError, index: int, line: int, where: str) -> ErrorRecord:
    """Not JSON: say whether the bytes are not UTF-8 (and where) or the JSON is broken."""
    custom_id = _peek_custom_id(raw)
    hint = _first_line_hint(raw) if line == 1 else ""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as bad:
        return _error(index, line, custom_id, ErrorCode.INVALID_UTF8,
                      f"{where}bytes are not valid UTF-8 at byte {bad.start + 1} of the line{hint}")
    try:  # again without the newline, so the position is within the line
        orjson.loads(raw.rstrip(b"\r\n"))
    except orjson.JSONDecodeError as inline:
        exc = inline
    reason = _ORJSON_REASONS.get(exc.msg, exc.msg)
    return _error(index, line, custom_id, ErrorCode.INVALID_JSON,
                  f"{where}invalid JSON: {reason} at column {exc.colno}{hint}")


def _first_line_hint(raw: bytes) -> str:
    """When the first line shows the whole file is not JSONL, say what it looks like."""
    if raw.startswith((b"\xff\xfe", b"\xfe\xff")):
        return " (the file looks like UTF-16: save it as UTF-8)"
    head = raw.strip()
    if head.startswith(b"["):
        return " (a file that is one JSON array of requests is the scale-v2 format, not JSONL)"
    if head == b"{":
        return " (JSONL needs each request whole on one line, not pretty-printed JSON)"
    return ""


# orjson's words, said plainly where they are obscure.
_ORJSON_REASONS = {
    "depth limit exceeded": "nested deeper than 1024 levels (the parser's limit)",
    "number is infinity when parsed as double": "a number too large for a double (such as 1e400)",
}


# A custom_id written first in the line, found without parsing it (broken or huge lines).
_LEADING_ID = re.compile(rb'^\s*\{\s*"custom_id"\s*:\s*"((?:[^"\\\r\n]|\\.){1,256})"')


def _peek_custom_id(raw: bytes) -> str | None:
    match = _LEADING_ID.match(raw)
    if not match:
        return None
    try:
        return orjson.loads(b'"' + match.group(1) + b'"')
    except orjson.JSONDecodeError:
        return None


# -- JSONL --------------------------------------------------------------------------------------

_SKIP_CHUNK = 1 << 16
_BOM = b"\xef\xbb\xbf"


def read_jsonl(stream: BinaryIO, checker: RequestChecker, *, max_line_bytes: int, start_index: int = 0,
               where: str = "") -> Iterator[Item]:
    """Items of a JSONL stream. A line over ``max_line_bytes`` (its ending not counted) is never
    held whole: it is skipped and reported ``line_too_long``. A leading UTF-8 BOM is ignored."""
    index, line = start_index, 0
    readline = stream.readline
    limit = max_line_bytes + 2  # room for "\r\n"
    raw = readline(limit + len(_BOM))
    if raw.startswith(_BOM):  # editors on Windows write one
        raw = raw[len(_BOM):]
    check_line = checker.check_line
    while raw:
        line += 1
        if len(raw) > max_line_bytes and (  # the size without its "\n" or "\r\n"
                size := len(raw) - raw.endswith(b"\n") - raw.endswith(b"\r\n")) > max_line_bytes:
            if raw[-1:] != b"\n":  # cut short at the limit: skip the rest of the line
                size = len(raw) + _skip_rest_of_line(stream, raw[-1:])
            yield _error(index, line, _peek_custom_id(raw), ErrorCode.LINE_TOO_LONG,
                         f"{where}line is {size} bytes, over the limit of {max_line_bytes}")
            index += 1
        elif not raw.isspace():  # a blank line gets no index
            yield check_line(raw, index, line, where)
            index += 1
        raw = readline(limit)


def _skip_rest_of_line(stream: BinaryIO, tail: bytes) -> int:
    """Read past the end of a line cut short; the content bytes skipped. ``tail`` is the last
    byte already read, in case a "\\r\\n" ending is split."""
    skipped = 0
    while chunk := stream.readline(_SKIP_CHUNK):
        if chunk[-1:] == b"\n":
            end = len(chunk) - 1
            before = chunk[end - 1:end] if end else tail
            return skipped + end - (before == b"\r")
        skipped += len(chunk)
        tail = chunk[-1:]
    return skipped


class WithoutBom:
    """A binary stream without its leading UTF-8 byte-order mark (Windows tools write one; JSON parsers refuse it)."""

    def __init__(self, stream: BinaryIO):
        self._stream = stream
        head = b""
        while len(head) < len(_BOM) and (more := stream.read(len(_BOM) - len(head))):
            head += more
        self._head = b"" if head == _BOM else head

    def read(self, size: int = -1) -> bytes:
        if not self._head:
            return self._stream.read(size)
        if 0 <= size < len(self._head):
            out, self._head = self._head[:size], self._head[size:]
            return out
        out, self._head = self._head, b""
        return out + self._stream.read(-1 if size < 0 else size - len(out))


# -- inline -------------------------------------------------------------------------------------


def read_inline(items: Iterable[Any], checker: RequestChecker, *, start_index: int = 0, where: str = "",
                max_item_bytes: int | None = None) -> Iterator[Item]:
    """Items of an inline list of ``{"custom_id"?, "body", ...}`` dicts."""
    for offset, obj in enumerate(items):
        index = start_index + offset
        if type(obj) is not dict:
            yield _error(index, offset + 1, None, ErrorCode.NOT_AN_OBJECT,
                         f"{where}expected an object, got {_json_kind(obj)}")
        elif unfit := _unfit(obj, "", f"{where}request {offset + 1}", max_item_bytes):
            yield _error(index, offset + 1, _id_if_str(obj), *unfit)
        else:
            yield checker.check_record(obj, index, offset + 1, where, id_required=False)


def _unfit(value: Any, path: str, label: str, max_bytes: int | None,
           parsed: bool = False) -> tuple[ErrorCode, str] | None:
    """Why an item cannot be taken, its message starting with ``label``: not strict JSON (unless
    ``parsed`` from JSON text), or over ``max_bytes`` as compact JSON (the bound a line has)."""
    if not parsed and (bad := not_json(value, path)):
        return bad[0], f"{label}: {bad[1]}"
    if max_bytes is not None and (size := len(orjson.dumps(value))) > max_bytes:
        return ErrorCode.LINE_TOO_LONG, f"{label} is {size} bytes as JSON, over the limit of {max_bytes}"
    return None


def _id_if_str(obj: dict[str, Any]) -> str | None:
    custom_id = obj.get("custom_id")
    return custom_id if type(custom_id) is str and not_json(custom_id, "") is None else None


# -- Scale v2 -----------------------------------------------------------------------------------

# Scale's guided-decoding fields, which vLLM reads from ``structured_outputs``.
_SCALE_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def scale_v2_body(item: dict[str, Any]) -> dict[str, Any]:
    """The OpenAI-compatible body of a Scale v2 request (its ``guided_*`` fields moved)."""
    if not any(key in item for key in _SCALE_GUIDED):
        return item
    body = {k: v for k, v in item.items() if k not in _SCALE_GUIDED}
    guided = {_SCALE_GUIDED[k]: v for k, v in item.items() if k in _SCALE_GUIDED and v is not None}
    if guided:
        body["structured_outputs"] = {**(body.get("structured_outputs") or {}), **guided}
    return body


def read_scale_v2(source: BinaryIO | Iterable[Any], checker: RequestChecker, *, start_index: int = 0,
                  where: str = "", max_item_bytes: int | None = None) -> Iterator[Item]:
    """Items of a Scale v2 JSON array (a stream, streamed) or inline content (a list)."""
    inline = not hasattr(source, "read")
    elements = source if inline else _array_elements(source, where)
    for offset, obj in enumerate(elements):
        index, line = start_index + offset, offset + 1
        if type(obj) is not dict:
            yield _error(index, line, None, ErrorCode.NOT_AN_OBJECT,
                         f"{where}element {line}: expected an object, got {_json_kind(obj)}")
            continue
        custom_id = str(index)
        if unfit := _unfit(obj, "body", f"{where}element {line}", max_item_bytes, parsed=not inline):
            yield _error(index, line, custom_id, *unfit)
            continue
        has_prompt, has_messages = "prompt" in obj, "messages" in obj
        if has_prompt == has_messages:
            yield _error(index, line, custom_id, ErrorCode.INVALID_BODY, f"{where}element {line}: "
                         "needs either 'prompt' (a completion) or 'messages' (a chat), found "
                         + ("both" if has_prompt else "neither"))
            continue
        implied = Endpoint.CHAT_COMPLETIONS if has_messages else Endpoint.COMPLETIONS
        if not checker.claims(implied):
            kind = "chat (messages)" if has_messages else "completion (prompt)"
            yield _error(index, line, custom_id, ErrorCode.ENDPOINT_MISMATCH,
                         f"{where}element {line} is a {kind} request but the job's endpoint is {checker.endpoint}")
            continue
        yield checker.check_body(scale_v2_body(obj), custom_id, index, line, where)


def _array_elements(stream: BinaryIO, where: str) -> Iterator[Any]:
    count = 0
    try:
        events = _events(stream, "start_array", "expected a JSON array of requests", where)
        for element in ijson.items(events, "item"):
            count += 1
            yield element
    except ijson.JSONError as exc:  # also IncompleteJSONError
        raise InputUnreadable(f"{where}not valid JSON after element {count}: {_ijson_reason(exc)}") from None


def _events(stream: BinaryIO, start: str, wrong_start: str, where: str) -> Iterator[tuple]:
    """ijson's parse events of a stream whose top-level value must begin with ``start``."""
    events = ijson.parse(WithoutBom(stream), use_float=True)
    first = next(events, None)
    if first is None or first[1] != start:
        raise InputUnreadable(where + wrong_start)
    return chain([first], events)


# yajl's words for numbers it cannot hold, said plainly.
_IJSON_REASONS = {
    "integer overflow": "an integer too large for 64 bits",
    "numeric (floating point) overflow": "a number too large for a double (such as 1e400)",
}


def _ijson_reason(exc: Exception) -> str:
    """The parser's message, and the text around the spot when it shows it (its second line)."""
    text = exc.args[0] if exc.args else ""
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    lines = [line.strip() for line in str(text).strip().splitlines()]
    if not lines:
        return type(exc).__name__
    reason = lines[0].removeprefix("parse error: ").removeprefix("lexical error: ").rstrip(".")
    reason = _IJSON_REASONS.get(reason, reason)[:200]
    if len(lines) > 1 and lines[1]:
        reason += f" near {lines[1][:60]!r}"
    return reason


# -- Scale v1 -----------------------------------------------------------------------------------


class ScaleV1Params(BaseModel):
    """The shared fields of Scale v1 content (its own ranges: temperature 0..1)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    max_new_tokens: int = Field(ge=1)
    temperature: float = Field(ge=0, le=1)
    stop_sequences: list[str] | None = None
    return_token_log_probs: bool | None = False
    presence_penalty: float | None = Field(default=None, ge=0, le=2)
    frequency_penalty: float | None = Field(default=None, ge=0, le=2)
    top_k: int | None = Field(default=None, ge=-1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    skip_special_tokens: bool | None = True

    def completion_body(self, prompt: Any) -> dict[str, Any]:
        optional = {"stop": self.stop_sequences, "logprobs": 1 if self.return_token_log_probs else None,
                    "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
                    "top_k": self.top_k, "top_p": self.top_p, "skip_special_tokens": self.skip_special_tokens}
        return {"prompt": prompt, "max_tokens": self.max_new_tokens, "temperature": self.temperature,
                **{k: v for k, v in optional.items() if v is not None}}


def scale_v1_params(content: dict[str, Any], where: str = "") -> ScaleV1Params:
    """The validated shared fields, or InputUnreadable naming the bad one."""
    if type(content.get("prompts")) is not list:
        raise InputUnreadable(f"{where}scale-v1 content needs a 'prompts' array")
    shared = {k: v for k, v in content.items() if k != "prompts"}
    if bad := not_json(shared, "content"):
        raise InputUnreadable(where + bad[1])
    try:
        return ScaleV1Params.model_validate(content)
    except ValidationError as exc:
        raise InputUnreadable(where + describe_validation_error(exc, root="content")) from None


def scan_scale_v1_params(stream: BinaryIO, where: str = "") -> ScaleV1Params:
    """First pass over a Scale v1 file: its shared fields, skipping the prompts without holding them."""
    fields: dict[str, Any] = {}
    prompts_kind = None
    try:
        events = _events(stream, "start_map", "scale-v1 content must be a JSON object", where)
        key = None
        for prefix, event, value in events:
            if prefix == "":
                if event == "map_key":
                    key = value
                    if key == "prompts" and prompts_kind is not None:
                        # JSON parsers keep the last one; a stream would read both.
                        raise InputUnreadable(f"{where}scale-v1 content has the key 'prompts' more than once")
                continue
            if key == "prompts":
                if prefix == "prompts" and prompts_kind is None:
                    prompts_kind = event
                continue
            fields[key] = _build_value(event, value, events)
    except ijson.JSONError as exc:
        raise InputUnreadable(f"{where}not valid JSON: {_ijson_reason(exc)}") from None
    fields["prompts"] = [] if prompts_kind == "start_array" else None
    return scale_v1_params(fields, where)


def _build_value(event: str, value: Any, events: Iterator[tuple]) -> Any:
    """The value starting with (event, value), consuming its remaining events."""
    builder = ijson.ObjectBuilder()  # the value assembly ijson.items uses
    builder.event(event, value)
    depth = 1 if event in ("start_map", "start_array") else 0
    while depth:
        _, event, value = next(events)
        builder.event(event, value)
        if event in ("start_map", "start_array"):
            depth += 1
        elif event in ("end_map", "end_array"):
            depth -= 1
    return builder.value


def scale_v1_prompts(stream: BinaryIO, where: str = "") -> Iterator[Any]:
    """Second pass over a Scale v1 file: its prompts, one at a time."""
    try:
        yield from ijson.items(WithoutBom(stream), "prompts.item", use_float=True)
    except ijson.JSONError as exc:
        raise InputUnreadable(f"{where}not valid JSON: {_ijson_reason(exc)}") from None


def read_scale_v1(params: ScaleV1Params, prompts: Iterable[Any], checker: RequestChecker, *, start_index: int = 0,
                  where: str = "", max_item_bytes: int | None = None) -> Iterator[Item]:
    """One /v1/completions item per prompt."""
    if not checker.claims(Endpoint.COMPLETIONS):
        raise InputUnreadable(f"{where}scale-v1 content makes /v1/completions requests, but the "
                              f"job's endpoint is {checker.endpoint}")
    for offset, prompt in enumerate(prompts):
        index = start_index + offset
        if unfit := _unfit(prompt, "body.prompt", f"{where}prompt {offset + 1}", max_item_bytes):
            yield _error(index, offset + 1, str(index), *unfit)
        else:
            yield checker.check_body(params.completion_body(prompt), str(index), index, offset + 1,
                                     f"{where}prompt {offset + 1}: ")
