"""Checked outputs' declaration and check: bounded at the edge (size, a valid schema, a
pattern that compiles, tries), each kind of check passing and failing, a pattern that would
backtrack for ever stopped by its timeout, and the job's check reaching its shards' workers."""

from __future__ import annotations

import time

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from llm_batch.core.job_spec import JobOptions
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
                     deadline="2030-01-01T00:00:00+00:00", options_json=JobOptions(output_check=check).model_dump_json())
    assert config_from_argv(task.worker_args()).options.output_check == check
    unchecked = task.model_copy(update={"options_json": "{}"})
    assert "output_check" not in " ".join(unchecked.worker_args())
    assert config_from_argv(unchecked.worker_args()).options.output_check is None


# -- nothing a schema names is fetched ----------------------------------------------------------

@pytest.fixture
def listener():
    """A local HTTP server that counts what it is asked (nothing should be)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    asked: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            asked.append(self.path)
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.end_headers()
            self.wfile.write(b'{"type": "string"}')

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}", asked
    server.shutdown()


def _naming(url: str) -> list[dict]:
    """Schemas naming something outside themselves, one keyword and place each."""
    return [
        {"$ref": f"{url}/a.json"},
        {"properties": {"a": {"$dynamicRef": f"{url}/b.json#meta"}}},
        {"prefixItems": [{"$recursiveRef": f"{url}/c.json"}]},
        {"$schema": f"{url}/dialect.json", "type": "string"},
        {"$defs": {"x": {"$ref": "file:///etc/passwd"}}, "$ref": "#/$defs/x"},
        {"$ref": "other.json"},
    ]


def test_a_job_schema_naming_anything_outside_itself_is_refused_naming_it(listener):
    url, asked = listener
    for schema in _naming(url):
        with pytest.raises(ValidationError, match=r"json_schema: schema\S*\.\$\w+ .* (is not within|is not a JSON)"):
            OutputCheck(json_schema=schema)
    assert asked == []


def test_a_line_schema_naming_anything_outside_itself_is_that_lines_error(listener):
    import io

    import orjson

    from llm_batch.pipeline.validation import ValidationLimits, validate_batch

    url, asked = listener
    schemas = [*_naming(url), {"$schema": {"not": "a string"}}]  # (the job's edge: not a valid schema)
    lines = [{"custom_id": f"r{i}", "body": {"messages": [{"role": "user", "content": "hi"}],
                                              "response_format": {"type": "json_schema",
                                                                  "json_schema": {"name": "s", "schema": schema}}}}
             for i, schema in enumerate(schemas)]
    lines.append({"custom_id": "inside", "body": {"messages": [{"role": "user", "content": "hi"}],
                  "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {
                      "$schema": "https://json-schema.org/draft/2020-12/schema",
                      "$defs": {"a": {"type": "string"}}, "$ref": "#/$defs/a"}}}}})
    data = b"".join(orjson.dumps({"url": "/v1/chat/completions", "method": "POST", **line}) + b"\n" for line in lines)
    valid, errors = io.BytesIO(), io.BytesIO()
    validate_batch(io.BytesIO(data), validated_out=valid, errors_out=errors, fmt="jsonl",
                   limits=ValidationLimits(max_requests=100, max_input_bytes=10**6, max_line_bytes=2**20,
                                           max_reported_errors=100))
    refused = [orjson.loads(line) for line in errors.getvalue().splitlines()]
    assert [e["custom_id"] for e in refused] == [f"r{i}" for i in range(len(schemas))]
    assert all(e["code"] == "invalid_body" and "response_format" in e["message"] for e in refused), refused
    assert [orjson.loads(line)["custom_id"] for line in valid.getvalue().splitlines()] == ["inside"]
    assert asked == []


def test_an_answer_is_checked_without_fetching_even_a_schema_past_the_edge(listener):
    url, asked = listener
    # As a stored job made before the edge refused these would carry them: the check fails
    # the answer, saying why, and fetches nothing.
    for schema in ({"$ref": f"{url}/a.json"}, {"$dynamicRef": f"{url}/b.json#meta"},
                   {"properties": {"a": {"$ref": f"{url}/c.json"}}}):
        check = OutputCheck.model_construct(json_schema=schema, response_format=False, regex=None, max_retries=0)
        assert "cannot be applied" in (check.problem('{"a": 1}', {}) or "")
        line = {"response_format": {"type": "json_schema", "json_schema": {"schema": schema}}}
        assert "cannot be applied" in (OutputCheck(response_format=True).problem('{"a": 1}', line) or "")
    assert asked == []


def test_a_schemas_patterns_are_capped_and_share_one_deadline_per_answer():
    from llm_batch.core.output_check import ANSWER_CHECK_S, MAX_SCHEMA_PATTERNS

    slow = "^(a|aa)+$"
    many = {"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": slow}
                                             for i in range(MAX_SCHEMA_PATTERNS + 1)}}
    with pytest.raises(ValidationError, match=f"patterns, more than {MAX_SCHEMA_PATTERNS}"):
        OutputCheck(json_schema=many)
    from llm_batch.core.schemas import ResponseFormat

    with pytest.raises(ValidationError, match=f"more than {MAX_SCHEMA_PATTERNS}"):
        ResponseFormat.model_validate({"type": "json_schema", "json_schema": {"name": "n", "schema": many}})
    # As many as allowed, each slow on the answer: the check of one answer ends within its one
    # deadline, whatever the patterns.
    allowed = {"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": slow}
                                                for i in range(MAX_SCHEMA_PATTERNS)}}
    answer = "{%s}" % ", ".join(f'"p{i}": "{"a" * 60}b"' for i in range(MAX_SCHEMA_PATTERNS))
    started = time.monotonic()
    problem = OutputCheck(json_schema=allowed).problem(answer, {})
    took = time.monotonic() - started
    assert problem is not None and "ran out of time" in problem, problem
    assert took < ANSWER_CHECK_S + 1.5, took
