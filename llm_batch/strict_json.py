"""Strict JSON: what every byte a user sends must be before anything reads it.

JSON as the pipeline writes it (orjson) and as every component can carry it: UTF-8 with no
lone surrogates, no NaN or Infinity, integers within 64 bits, and nesting no deeper than
``MAX_DEPTH``. Python's own parser (FastAPI's, Airflow's) admits all of these; a value that
holds one of them breaks a later writer (a DAG run's conf that cannot be serialised stops the
scheduler; orjson refuses 254 levels of nesting) far from the request that sent it. So the API
checks each JSON body here once, at its edge, and each DAG run's conf again before it is
triggered.

    check(data: bytes) -> Any        the value, or NotStrictJson saying what and where
    problem(value) -> str | None     the same rules for a value already parsed (a conf)
    depth_problem(value)             the depth rule alone, for what orjson parsed (batch lines)
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import orjson

__all__ = ["MAX_DEPTH", "NotStrictJson", "check", "depth_problem", "problem"]

# Deep enough for any request body, chat message or JSON schema we have seen (they stay under
# 20); far below orjson's own limit of 254, so a checked value can always be written again
# inside a record, a conf or a results line.
MAX_DEPTH = 64
_INT64_MIN, _UINT64_MAX = -(1 << 63), (1 << 64) - 1
# orjson reads an integer past 64 bits as a float: only a text with such a run of digits needs
# its integers read again.
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
    if found := _walk(value, "", 0):
        raise NotStrictJson(found[1], found[0])
    if _LONG_DIGITS.search(data.encode() if isinstance(data, str) else data):
        json.loads(data, parse_int=_int64)  # the rare text that may hold one: read its integers
    return value


def _int64(text: str) -> int:
    value = int(text)
    if not _INT64_MIN <= value <= _UINT64_MAX:
        shown = text if len(text) <= 30 else f"{text[:27]}... ({len(text)} digits)"
        raise NotStrictJson(f"the integer {shown} does not fit in 64 bits")
    return value


def problem(value: Any) -> str | None:
    """What keeps an already parsed value from being strict JSON ("where: what"), else None."""
    found = _walk(value, "", 0, parsed=True)
    return None if found is None else (f"{_shortened(found[0])}: {found[1]}" if found[0] else found[1])


def depth_problem(value: Any) -> str | None:
    """Where a value parsed by orjson (whose own limit is 1024 levels) nests deeper than
    ``MAX_DEPTH``, as "where: what", else None: a batch line that deep is that line's error,
    never a failure of the step that writes it again."""
    found = _walk(value, "", 0)
    return None if found is None else (f"{_shortened(found[0])}: {found[1]}" if found[0] else found[1])


def _shortened(where: str) -> str:
    return where if len(where) <= 120 else f"...{where[-100:]}"


def _decode_problem(data: bytes | str, exc: orjson.JSONDecodeError) -> NotStrictJson:
    try:
        json.loads(data)
    except (ValueError, RecursionError):
        return NotStrictJson(f"not valid JSON: {exc.msg} at character {exc.pos}", syntax=True)
    # Python's parser took it: what it admits and strict JSON does not.
    if "surrogate" in exc.msg:
        return NotStrictJson(f"text holds a lone surrogate (a \\ud800-\\udfff escape without its pair) "
                             f"near character {exc.pos}: not valid Unicode")
    if "recursion" in exc.msg:
        return NotStrictJson(f"nested deeper than {MAX_DEPTH} levels")
    return NotStrictJson(f"{exc.msg} at character {exc.pos}: NaN, Infinity and other values outside "
                         "JSON are refused")


def _walk(value: Any, where: str, depth: int, parsed: bool = False) -> tuple[str, str] | None:
    """(where, what) of the first thing that is not strict JSON, else None. ``parsed``: the
    value did not come through orjson (check strings, integers and types too)."""
    if depth > MAX_DEPTH:
        return where, f"nested deeper than {MAX_DEPTH} levels"
    if isinstance(value, dict):
        for key, item in value.items():
            if parsed and (not isinstance(key, str) or not _utf8(key)):
                return where, f"key {key!r} is not a JSON string"
            if found := _walk(item, f"{where}.{key}" if where else str(key), depth + 1, parsed):
                return found
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            if found := _walk(item, f"{where}[{index}]", depth + 1, parsed):
                return found
    elif isinstance(value, float):
        if not math.isfinite(value):
            return where, f"{value} is not a JSON number"
    elif parsed:
        if isinstance(value, bool) or value is None:
            return None
        if isinstance(value, int):
            return None if _INT64_MIN <= value <= _UINT64_MAX else (where, "an integer that does not fit in 64 bits")
        if isinstance(value, str):
            return None if _utf8(value) else (where, "text holds a lone surrogate: not valid Unicode")
        return where, f"a {type(value).__name__} is not a JSON value"
    return None


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
