"""Checked outputs: what a job's answers must look like (``OutputCheck``), and the check of one.

No pattern can stall a worker: every match runs with the ``regex`` library's timeout, and all
of a schema's pattern searches for one answer share one deadline (``ANSWER_CHECK_S``).
Nothing a schema names is fetched: validators resolve references inside the schema only, and
a schema naming anything outside itself (``schema_refused``) is refused where it comes in.
"""

from __future__ import annotations

import time
from contextvars import ContextVar
from functools import cached_property
from typing import Any

import orjson
import regex
from jsonschema import Draft202012Validator, validators
from jsonschema.exceptions import SchemaError, ValidationError
from pydantic import BaseModel, ConfigDict, Field, model_validator
from referencing import Registry
from referencing.exceptions import Unresolvable

INVALID_OUTPUT = "invalid_output"  # the error code of an answer that failed its check
MAX_SCHEMA_BYTES = 16 * 1024
MAX_PATTERN_CHARS = 512
MAX_RETRIES = 5
MATCH_TIMEOUT_S = 0.1
MAX_SCHEMA_PATTERNS = 32
ANSWER_CHECK_S = 1.0  # every pattern search of one answer against one schema, together
_answer_deadline: ContextVar[float] = ContextVar("answer_deadline", default=float("inf"))
CHECKED_ENDPOINTS = frozenset({"/v1/chat/completions", "/v1/completions"})


def _search(pattern: str, text: str) -> bool:
    """A schema's pattern, searched as JSON Schema does, within the timeout and what is left of
    the answer's deadline (jsonschema's own search uses ``re``, which has no timeout)."""
    left = _answer_deadline.get() - time.monotonic()
    if left <= 0:
        raise ValidationError(f"the schema's patterns ran out of time ({ANSWER_CHECK_S} s for the answer)")
    try:
        return regex.search(pattern, text, timeout=min(MATCH_TIMEOUT_S, left)) is not None
    except TimeoutError:
        raise ValidationError(f"the schema's pattern {pattern!r} ran out of time") from None
    except regex.error as exc:
        raise ValidationError(f"the schema's pattern {pattern!r} does not compile: {exc}") from None


def _pattern(validator: Any, pattern: str, instance: Any, schema: Any) -> Any:
    if validator.is_type(instance, "string") and not _search(pattern, instance):
        yield ValidationError(f"{instance[:80]!r} does not match {pattern!r}")


def _pattern_properties(validator: Any, patterns: dict[str, Any], instance: Any, schema: Any) -> Any:
    if not validator.is_type(instance, "object"):
        return
    for pattern, subschema in patterns.items():
        for name, value in instance.items():
            if _search(pattern, name):
                yield from validator.descend(value, subschema, path=name, schema_path=pattern)


# Draft 2020-12 with its two pattern keywords matched under the timeout.
Validator = validators.extend(Draft202012Validator, {"pattern": _pattern, "patternProperties": _pattern_properties})
# A registry that retrieves nothing: a reference resolves inside its schema or not at all.
_NOTHING_FETCHED = Registry()
# The keywords that name another schema, and the dialects a schema may declare.
_REFERENCE_KEYWORDS = ("$ref", "$dynamicRef", "$recursiveRef")
_DIALECTS = frozenset(
    f"{scheme}://json-schema.org/{draft}{suffix}"
    for scheme in ("http", "https")
    for draft in ("draft/2020-12/schema", "draft/2019-09/schema", "draft-07/schema", "draft-06/schema",
                  "draft-04/schema")
    for suffix in ("", "#"))


def schema_validator(schema: dict[str, Any]) -> Any:
    """The validator of ``schema``: every one the job's check and the lines' formats use."""
    return Validator(schema, registry=_NOTHING_FETCHED)


def schema_refused(schema: Any) -> str | None:
    """Where ``schema`` names anything outside itself (a reference not starting with ``#``, a
    ``$schema`` not a draft's), or that it holds too many patterns; None if neither."""
    entries = list(_entries(schema, "schema"))
    patterns = sum((key == "pattern" and isinstance(value, str))
                   + (len(value) if key == "patternProperties" and isinstance(value, dict) else 0)
                   for _, key, value in entries)
    if patterns > MAX_SCHEMA_PATTERNS:
        return f"schema: {patterns} patterns, more than {MAX_SCHEMA_PATTERNS}"
    for where, key, value in entries:
        if key in _REFERENCE_KEYWORDS and not (isinstance(value, str) and value.startswith("#")):
            return f"{where}.{key} {value!r} is not within the schema (only #... references; nothing is fetched)"
        if key == "$schema" and not (isinstance(value, str) and value in _DIALECTS):
            return f"{where}.$schema {value!r} is not a JSON Schema draft's (nothing is fetched)"
    return None


def _entries(schema: Any, where: str) -> Any:
    """(where, key, value) of every object member in ``schema``, depth first."""
    if isinstance(schema, dict):
        for key, value in schema.items():
            yield where, key, value
            yield from _entries(value, f"{where}.{key}")
    elif isinstance(schema, list):
        for index, item in enumerate(schema):
            yield from _entries(item, f"{where}[{index}]")


class OutputCheck(BaseModel):
    """How a job's answers must look (at least one of the three checks)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    response_format: bool = Field(
        default=False,
        description="Check each line's answer against the line's own `response_format`: `json_object` must parse "
        "as a JSON object, `json_schema` as JSON valid against its schema")
    json_schema: dict[str, Any] | None = Field(
        default=None,
        description=f"A JSON schema (draft 2020-12, at most {MAX_SCHEMA_BYTES} bytes) every answer must parse "
        "as JSON and be valid against")
    regex: str | None = Field(
        default=None, max_length=MAX_PATTERN_CHARS,
        description=f"A regular expression (at most {MAX_PATTERN_CHARS} characters) the whole answer must match")
    max_retries: int = Field(
        default=2, ge=0, le=MAX_RETRIES,
        description=f"How many times an answer that fails is tried again with a new seed (0-{MAX_RETRIES}); "
        "then the line is recorded as `invalid_output`")

    @model_validator(mode="after")
    def _bounded(self) -> OutputCheck:
        if not (self.response_format or self.json_schema is not None or self.regex is not None):
            raise ValueError("give at least one of response_format, json_schema and regex")
        if self.json_schema is not None:
            if len(orjson.dumps(self.json_schema)) > MAX_SCHEMA_BYTES:
                raise ValueError(f"json_schema: more than {MAX_SCHEMA_BYTES} bytes")
            try:
                Draft202012Validator.check_schema(self.json_schema)
            except SchemaError as exc:
                raise ValueError(f"json_schema: not a valid JSON schema: {exc.message}") from None
            if problem := schema_refused(self.json_schema):
                raise ValueError(f"json_schema: {problem}")
        if self.regex is not None:
            try:
                regex.compile(self.regex)
            except regex.error as exc:
                raise ValueError(f"regex: does not compile: {exc}") from None
        return self

    @cached_property
    def _schema(self) -> Any:
        return schema_validator(self.json_schema) if self.json_schema is not None else None

    @cached_property
    def _pattern(self) -> regex.Pattern | None:
        return regex.compile(self.regex) if self.regex is not None else None

    def problem(self, answer: str, body: dict[str, Any]) -> str | None:
        """Why ``answer`` (the text a line's request ``body`` got) fails the check; None if it passes."""
        if self.response_format and (problem := _format_problem(answer, body.get("response_format"))):
            return problem
        if self._schema is not None and (problem := _schema_problem(answer, self._schema)):
            return problem
        if self._pattern is not None:
            try:
                if self._pattern.fullmatch(answer, timeout=MATCH_TIMEOUT_S) is None:
                    return "the answer does not match the job's regex"
            except TimeoutError:
                return f"the job's regex ran out of time ({MATCH_TIMEOUT_S} s) on the answer"
        return None


def _schema_problem(answer: str, validator: Any) -> str | None:
    try:
        value = orjson.loads(answer)
    except orjson.JSONDecodeError as exc:
        return f"the answer is not JSON: {exc}"
    token = _answer_deadline.set(time.monotonic() + ANSWER_CHECK_S)
    try:
        error = next(iter(validator.iter_errors(value)), None)
    except ValidationError as exc:  # a pattern that ran out of time or does not compile
        return exc.message
    except Unresolvable as exc:  # a line's schema naming what is not in it
        return f"the schema cannot be applied: {exc}"[:500]
    finally:
        _answer_deadline.reset(token)
    if error is None:
        return None
    where = "/".join(str(part) for part in error.absolute_path) or "the top level"
    return f"the answer is not valid against the schema at {where}: {error.message}"[:500]


def _format_problem(answer: str, response_format: Any) -> str | None:
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "json_object":
        try:
            value = orjson.loads(answer)
        except orjson.JSONDecodeError as exc:
            return f"the answer is not JSON (response_format json_object): {exc}"
        return None if isinstance(value, dict) else "the answer is JSON but not an object (response_format json_object)"
    if kind == "json_schema":
        schema = (response_format.get("json_schema") or {}).get("schema")
        if isinstance(schema, dict):
            try:
                return _schema_problem(answer, schema_validator(schema))
            except SchemaError:
                return None  # validation refused such a line; nothing to check against
    return None


def answer_text(endpoint: str, payload: dict[str, Any]) -> str | None:
    """The text a check reads: a chat answer's message content, a completion's text."""
    choices = payload.get("choices") if isinstance(payload.get("choices"), list) else []
    first = choices[0] if choices and isinstance(choices[0], dict) else {}
    if endpoint == "/v1/chat/completions":
        content = (first.get("message") or {}).get("content")
        return content if isinstance(content, str) else ""
    if endpoint == "/v1/completions":
        return first.get("text") if isinstance(first.get("text"), str) else ""
    return None
