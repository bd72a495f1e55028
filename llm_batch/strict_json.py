"""Strict JSON: what every byte a user sends must be before anything reads it.

JSON as the pipeline writes it (orjson) and as every component can carry it: UTF-8 with no
lone surrogates, no NaN or Infinity, integers within 64 bits, and nesting no deeper than
``MAX_DEPTH``. Python's own parser (FastAPI's, Airflow's) admits all of these; a value that
holds one of them breaks a later writer (a DAG run's conf that cannot be serialised stops the
scheduler; orjson refuses 254 levels of nesting) far from the request that sent it. So the API
checks each JSON body here once, at its edge, and each DAG run's conf again before it is
triggered.

    check(data: bytes) -> Any        the value, or NotStrictJson saying what and where
    problem(value) -> Problem | None the same rules for a value already parsed (a conf)
    depth_problem(value)             the depth rule alone, for what orjson parsed (batch lines)
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, NamedTuple

import orjson

__all__ = ["MAX_DEPTH", "NotStrictJson", "Problem", "check", "depth_problem", "problem"]

# Deep enough for any request body, chat message or JSON schema we have seen (they stay under
# 20); far below orjson's own limit of 254, so a checked value can always be written again
# inside a record, a conf or a results line.
MAX_DEPTH = 64
_INT64_MIN, _UINT64_MAX = -(1 << 63), (1 << 64) - 1
# orjson reads an integer past 64 bits as a float: only a text with such a run of digits is
# read again by Python's parser, which keeps integers as they are written.
_LONG_DIGITS = re.compile(rb"\d{20,}")


class NotStrictJson(ValueError):
    """Bytes that are not strict JSON. ``syntax`` is true when they are not JSON at all (then
    any JSON parser says so itself); ``where`` is a path such as ``requests[3].body``."""

    def __init__(self, message: str, where: str = "", syntax: bool = False):
        where = _shortened(where)
        super().__init__(f"{where}: {message}" if where else message)
        self.message = message
        self.where = where
        self.syntax = syntax


def check(data: bytes | str) -> Any:
    """The value of ``data`` if it is strict JSON, else ``NotStrictJson``."""
    try:
        value = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise _decode_problem(data, exc) from None
    found = _walk(value, "", 0)
    if found is None and _LONG_DIGITS.search(data.encode() if isinstance(data, str) else data):
        found = problem(json.loads(data))  # the rare text that may hold one: read its integers
    if found is not None:
        raise NotStrictJson(found.what, found.where)
    return value


class Problem(NamedTuple):
    """What keeps a value from being strict JSON, and where (``body.messages[0].content``);
    ``unicode``: the problem is text that is not valid Unicode (a lone surrogate)."""

    where: str
    what: str
    unicode: bool = False

    def __str__(self) -> str:
        return f"{_shortened(self.where)}: {self.what}" if self.where else self.what


def problem(value: Any, where: str = "") -> Problem | None:
    """What keeps an already parsed value (a conf, what Python's parser built) from being
    strict JSON, else None; ``where`` is the value's own place, for the message."""
    return _walk(value, where, 0, parsed=True)


def depth_problem(value: Any) -> Problem | None:
    """Where a value parsed by orjson (whose own limit is 1024 levels) nests deeper than
    ``MAX_DEPTH``, else None: a batch line that deep is that line's error, never a failure
    of the step that writes it again."""
    return _walk(value, "", 0)


def _shortened(where: str) -> str:
    return where if len(where) <= 120 else f"...{where[-100:]}"


def _decode_problem(data: bytes | str, exc: orjson.JSONDecodeError) -> NotStrictJson:
    """Why orjson refused ``data``: past its own depth limit, not JSON at all (``syntax``), or
    what Python's parser admits and strict JSON does not, found where it is."""
    if "recursion" in exc.msg:
        return NotStrictJson(f"nested deeper than {MAX_DEPTH} levels")
    try:
        found = problem(json.loads(data))
    except (ValueError, RecursionError):
        return NotStrictJson(f"not valid JSON: {exc.msg} at character {exc.pos}", syntax=True)
    if found is None:  # not expected: say what orjson said
        return NotStrictJson(f"{exc.msg} at character {exc.pos}")
    return NotStrictJson(found.what, found.where)


def _walk(value: Any, where: str, depth: int, parsed: bool = False) -> Problem | None:
    """The first thing in ``value`` that is not strict JSON, else None. ``parsed``: the value
    did not come through orjson (check strings, integers, keys and types too)."""
    if depth > MAX_DEPTH:
        return Problem(where, f"nested deeper than {MAX_DEPTH} levels")
    if isinstance(value, dict):
        for key, item in value.items():
            if parsed and not isinstance(key, str):
                return Problem(where, f"key {key!r} is not a string")
            here = f"{where}.{key}" if where else key
            if found := (parsed and _text_problem(key, f"{where} (a key)")) or _walk(item, here, depth + 1, parsed):
                return found
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            if found := _walk(item, f"{where}[{index}]", depth + 1, parsed):
                return found
    elif isinstance(value, float):
        if not math.isfinite(value):
            return Problem(where, f"{value} is not a JSON number")
    elif not parsed or value is None or isinstance(value, bool):
        return None
    elif isinstance(value, int):
        if not _INT64_MIN <= value <= _UINT64_MAX:
            digits = str(value)
            shown = digits if len(digits) <= 30 else f"{digits[:27]}... ({len(digits)} digits)"
            return Problem(where, f"the integer {shown} does not fit in 64 bits")
    elif isinstance(value, str):
        return _text_problem(value, where)
    else:
        return Problem(where, f"a {type(value).__name__} is not a JSON value")
    return None


def _text_problem(text: str, where: str) -> Problem | None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return Problem(where, f"text is not valid UTF-8 (a lone surrogate at character {exc.start + 1})", True)
    return None
