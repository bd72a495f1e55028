"""Strict JSON: what every byte a user sends must be before anything reads it (what orjson writes
and every component can carry). Python's parser admits more, and such a value breaks a later
writer far from the request that sent it (a run's conf that cannot be serialised stops the
scheduler), so the API checks each JSON body at its edge and each run's conf before its trigger."""

from __future__ import annotations

import json
import math
from typing import Any, NamedTuple

import orjson

# Deep enough for any real body or schema; far below orjson's own limit of 254, so a checked
# value can always be written again inside a record, a conf or a results line.
MAX_DEPTH = 64
_INT64_MIN, _UINT64_MAX = -(1 << 63), (1 << 64) - 1
# orjson reads an integer past 64 bits as a float: only a text where such a float turns up is
# read again by Python's parser, which keeps integers as they are written.
_HUGE = "a number past 64 bits"


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
    if found is not None and found.what == _HUGE:
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
    """What keeps an already parsed value (a conf) from being strict JSON, else None; ``where``
    is the value's own place."""
    return _walk(value, where, 0, parsed=True)


def depth_problem(value: Any) -> Problem | None:
    """Where a value parsed by orjson nests deeper than ``MAX_DEPTH``, else None (a batch line
    that deep is its own error, not the failure of a later writer)."""
    return _walk(value, "", 0)


def _shortened(where: str) -> str:
    return where if len(where) <= 120 else f"...{where[-100:]}"


def _decode_problem(data: bytes | str, exc: orjson.JSONDecodeError) -> NotStrictJson:
    """Why orjson refused ``data``: too deep, not JSON at all (``syntax``), or what Python's parser admits."""
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
    found = _find(value, depth, parsed)
    if found is None:
        return None
    path, what, unicode = found
    for part in reversed(path):
        if isinstance(part, int):
            where += f"[{part}]"
        elif part is _KEY:
            where += " (a key)"
        else:
            where = f"{where}.{part}" if where else part
    return Problem(where, what, unicode)


# What orjson gives is never a problem but for its depth: skipped without a call (the walk
# touches every value of bodies up to 64 MiB).
_PLAIN = frozenset({str, int, bool, type(None)})
_KEY = object()  # a path part: "the key itself", for a key that is not valid text


def _find(value: Any, depth: int, parsed: bool) -> tuple[list[Any], str, bool] | None:
    """(path to it, innermost first; what; is it bad text) of the first problem, else None.
    The path is built only on the way back from a problem, never for good values."""
    if depth > MAX_DEPTH:
        return [], f"nested deeper than {MAX_DEPTH} levels", False
    kind = type(value)
    if kind is dict:
        for key, item in value.items():
            if parsed:
                if not isinstance(key, str):
                    return [], f"key {key!r} is not a string", False
                if bad := _bad_text(key):
                    return [_KEY], bad, True
            elif type(item) in _PLAIN:
                continue
            if found := _find(item, depth + 1, parsed):
                found[0].append(key)
                return found
    elif kind is list or kind is tuple:
        for index, item in enumerate(value):
            if not parsed and type(item) in _PLAIN:
                continue
            if found := _find(item, depth + 1, parsed):
                found[0].append(index)
                return found
    elif kind is float:
        if not math.isfinite(value):
            return [], f"{value} is not a JSON number", False
        if not parsed and abs(value) >= 2.0**63:  # >=: -(2**63 + 1) reads as -2**63
            return [], _HUGE, False
    elif not parsed or value is None or kind is bool:
        return None
    elif isinstance(value, int):
        if not _INT64_MIN <= value <= _UINT64_MAX:
            digits = str(value)
            shown = digits if len(digits) <= 30 else f"{digits[:27]}... ({len(digits)} digits)"
            return [], f"the integer {shown} does not fit in 64 bits", False
    elif isinstance(value, str):
        if bad := _bad_text(value):
            return [], bad, True
    elif isinstance(value, float):  # a float subclass
        return _find(float(value), depth, parsed)
    else:
        return [], f"a {kind.__name__} is not a JSON value", False
    return None


def _bad_text(text: str) -> str | None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"text is not valid UTF-8 (a lone surrogate at character {exc.start + 1})"
    return None
