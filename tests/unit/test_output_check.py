"""Checked outputs' declaration and check: bounded at the edge (size, a valid schema, a
pattern that compiles, tries), each kind of check passing and failing, a pattern that would
backtrack for ever stopped by its timeout, and the job's check reaching its shards' workers."""

from __future__ import annotations

import time

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from llm_batch.core.output_check import MAX_PATTERN_CHARS, MAX_SCHEMA_BYTES, OutputCheck, answer_text
from llm_batch.pipeline.shard_task import ShardTask
from llm_batch.runtime.worker_args import config_from_argv


@pytest.mark.parametrize("fields, problem", [
    ({}, "at least one"),
    ({"regex": "("}, "does not compile"),
    ({"regex": "a" * (MAX_PATTERN_CHARS + 1)}, "at most"),
    ({"json_schema": {"type": "no-such-type"}}, "not a valid JSON schema"),
    ({"json_schema": {"description": "x" * MAX_SCHEMA_BYTES}}, "bytes"),
    ({"regex": ".*", "max_retries": 6}, "less than or equal"),
    ({"regex": ".*", "shell": "rm -rf /"}, "Extra inputs"),
    ({"json_schema": {"$ref": "http://127.0.0.1:9/x"}}, "not within the schema"),
    ({"json_schema": {"prefixItems": [{"$ref": "file:///etc/passwd"}]}}, "not within the schema"),
])
def test_a_check_is_refused_unless_bounded_and_valid(fields, problem):
    with pytest.raises(ValidationError, match=problem):
        OutputCheck.model_validate(fields)


def test_each_kind_of_check():
    digits = OutputCheck(regex=r"\d+")
    assert digits.problem("123", {}) is None and "regex" in digits.problem("12a", {})
    schema = OutputCheck(json_schema={"type": "object", "required": ["a"], "properties": {"a": {"type": "integer"}}})
    assert schema.problem('{"a": 1}', {}) is None
    assert "not JSON" in schema.problem("{a", {})
    assert "at a" in schema.problem('{"a": "x"}', {})
    own = OutputCheck(response_format=True)
    assert own.problem("plain text", {}) is None  # a line that asked no format
    assert own.problem('{"k": 1}', {"response_format": {"type": "json_object"}}) is None
    assert "not an object" in own.problem("[1]", {"response_format": {"type": "json_object"}})
    line_schema = {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {
        "type": "object", "required": ["b"]}}}}
    assert own.problem('{"b": 2}', line_schema) is None and own.problem('{"c": 2}', line_schema)


def test_a_pattern_that_backtracks_for_ever_stops_on_time():
    check = OutputCheck(regex=r"(a|aa)+$")
    started = time.monotonic()
    problem = check.problem("a" * 60 + "b", {})
    assert problem is not None and "ran out of time" in problem
    assert time.monotonic() - started < 2
    # The same pattern inside a schema (the job's, or a line's own response_format).
    evil = {"type": "object", "properties": {"s": {"type": "string", "pattern": "^(a|aa)+$"}},
            "patternProperties": {"^(a|aa)+$": {"type": "string"}}}
    for check, body in ((OutputCheck(json_schema=evil), {}), (OutputCheck(response_format=True), {
            "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": evil}}})):
        for answer in ('{"s": "%s"}' % ("a" * 60 + "b"), '{"%s": "x"}' % ("a" * 60 + "b")):
            started = time.monotonic()
            problem = check.problem(answer, body)
            assert problem is not None and "ran out of time" in problem, problem
            assert time.monotonic() - started < 2
    assert OutputCheck(json_schema=evil).problem('{"s": "aaa", "aa": "x"}', {}) is None
    # A line's own schema pointing nowhere is that answer's problem, never a worker's crash.
    nowhere = {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {
        "$ref": "#/$defs/missing"}}}}
    assert "cannot be applied" in OutputCheck(response_format=True).problem("{}", nowhere)


@given(st.text(max_size=200))
def test_any_answer_gets_an_answer(text):
    for check in (OutputCheck(regex=r"[a-z ]*"), OutputCheck(json_schema={"type": "string"}),
                  OutputCheck(response_format=True)):
        result = check.problem(text, {"response_format": {"type": "json_object"}})
        assert result is None or isinstance(result, str)


def test_answer_text_of_each_endpoint():
    chat = {"choices": [{"message": {"content": "hi"}}]}
    assert answer_text("/v1/chat/completions", chat) == "hi"
    assert answer_text("/v1/completions", {"choices": [{"text": "yo"}]}) == "yo"
    assert answer_text("/v1/chat/completions", {"choices": []}) == ""
    assert answer_text("/v1/embeddings", {"data": []}) is None


def test_the_jobs_check_reaches_the_worker():
    check = OutputCheck(json_schema={"type": "object"}, max_retries=3)
    task = ShardTask(job_id="j", shard=0, requests_uri="/w/r", results_uri="/w/res", progress_uri="/w/p",
                     cancel_marker="/w/c", endpoint="/v1/chat/completions", model_config_json='{"model": "m"}',
                     deadline="2030-01-01T00:00:00+00:00", output_check_json=check.model_dump_json())
    assert config_from_argv(task.worker_args()).output_check == check
    unchecked = task.model_copy(update={"output_check_json": None})
    assert "--output-check" not in unchecked.worker_args()
    assert config_from_argv(unchecked.worker_args()).output_check is None
