"""validate_batch: the corpus of bad inputs, counts, ordering, limits, multi-file, layout."""

from __future__ import annotations

import io
import json
from pathlib import Path

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_batch.core.formats import ErrorCode
from llm_batch.core.layout import JobLayout
from llm_batch.core.model_choice import ModelChoice
from llm_batch.infra import storage
from llm_batch.pipeline.validation import BatchRejected, ValidationLimits, check_format, validate_batch
from tests.fuzzing import examples

CORPUS = Path(__file__).parent.parent / "corpus"
EXPECTED = {k: v for k, v in json.loads((CORPUS / "expected.json").read_text()).items()
            if not k.startswith("_")}
LIMITS = ValidationLimits(max_requests=1000, max_input_bytes=10**7, max_line_bytes=2**20,
                          max_reported_errors=100)


def local_open(uri: str):
    return open(uri, "rb")


def chat_line(custom_id: str, content: str = "Hello", **body) -> bytes:
    body = {"messages": [{"role": "user", "content": content}], **body}
    return orjson.dumps({"custom_id": custom_id, "body": body}) + b"\n"


def run(data: bytes, **kwargs):
    valid, errors = io.BytesIO(), io.BytesIO()
    kwargs.setdefault("fmt", "jsonl")
    kwargs.setdefault("limits", LIMITS)
    report = validate_batch(io.BytesIO(data), validated_out=valid, errors_out=errors, **kwargs)
    return report, _lines(valid.getvalue()), _lines(errors.getvalue())


def _lines(data: bytes) -> list[dict]:
    return [orjson.loads(line) for line in data.splitlines()]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_corpus(name: str) -> None:
    case = EXPECTED[name]
    limits = ValidationLimits(**{**LIMITS.__dict__, **case.get("limits", {})})
    valid_out, errors_out = io.BytesIO(), io.BytesIO()
    kwargs = dict(fmt=case["format"], endpoint=case["endpoint"], limits=limits,
                  validated_out=valid_out, errors_out=errors_out, open_input=local_open,
                  models=ModelChoice(**case["models"]) if "models" in case else None)
    if "rejected" in case:
        with pytest.raises(BatchRejected) as caught:
            validate_batch(str(CORPUS / name), **kwargs)
        assert caught.value.reason == case["rejected"]
        assert str(caught.value)
        return
    report = validate_batch(str(CORPUS / name), **kwargs)
    expected_errors = {int(line): code for line, code in case["errors"].items()}
    assert {e.line: e.code for e in report.errors} == expected_errors
    assert set(expected_errors.values()) <= {c.value for c in ErrorCode}
    assert report.valid == case["valid"]
    assert report.invalid == len(expected_errors)
    assert report.total == report.valid + report.invalid
    # Every item lands exactly once, in one of the two files, in input order.
    valid, errors = _lines(valid_out.getvalue()), _lines(errors_out.getvalue())
    assert len(valid) == report.valid and len(errors) == report.invalid
    indexes = sorted([r["index"] for r in valid] + [e["index"] for e in errors])
    assert indexes == list(range(report.total))
    assert [r["index"] for r in valid] == sorted(r["index"] for r in valid)
    assert all(e["message"] for e in errors)
    if "adapters" in case:  # the adapter each valid line runs on ("": the base)
        assert [r.get("adapter", "") for r in valid] == case["adapters"]


def test_every_error_code_is_in_the_corpus() -> None:
    seen = {code for case in EXPECTED.values() for code in case.get("errors", {}).values()}
    assert seen == {c.value for c in ErrorCode}


def test_validated_lines_are_batch_requests_in_order() -> None:
    data = b"".join(chat_line(f"r{i}", f"question {i}", max_tokens=8) for i in range(50))
    report, valid, errors = run(data, endpoint="/v1/chat/completions")
    assert (report.total, report.valid, report.invalid) == (50, 50, 0)
    assert [r["index"] for r in valid] == list(range(50))
    assert [r["custom_id"] for r in valid] == [f"r{i}" for i in range(50)]
    assert set(valid[0]) == {"index", "custom_id", "body", "line"}
    assert [r["line"] for r in valid] == list(range(1, 51))
    assert valid[7]["body"]["messages"][0]["content"] == "question 7"
    assert errors == []


def test_unknown_fields_are_kept_in_the_body() -> None:
    data = chat_line("a", max_tokens=8, vendor_flag=True, model="anything")
    _, valid, _ = run(data)
    assert valid[0]["body"]["vendor_flag"] is True
    assert valid[0]["body"]["model"] == "anything"


def test_counts_are_never_capped_but_reported_errors_are() -> None:
    data = b"not json\n" * 30 + chat_line("ok")
    limits = ValidationLimits(1000, 10**7, 2**20, max_reported_errors=5)
    report, _, errors = run(data, limits=limits)
    assert (report.total, report.valid, report.invalid) == (31, 1, 30)
    assert [e.line for e in report.errors] == [1, 2, 3, 4, 5]
    assert len(errors) == 30  # the error file has them all


def test_report_estimates_prompt_tokens_and_names_endpoint() -> None:
    data = chat_line("a", "x" * 400) + chat_line("b", "y" * 400, name_of_thing=1)
    report, _, _ = run(data)
    assert report.endpoint == "/v1/chat/completions"
    assert report.estimated_prompt_tokens == 200
    assert report.input_bytes == len(data)


def test_endpoint_is_taken_from_the_first_url() -> None:
    line = orjson.dumps({"custom_id": "a", "method": "POST", "url": "/v1/embeddings",
                         "body": {"input": "text"}}) + b"\n"
    report, valid, _ = run(line + chat_line("b"))
    assert report.endpoint == "/v1/embeddings"
    assert report.valid == 1 and valid[0]["custom_id"] == "a"


def test_unsupported_endpoint_is_rejected_naming_the_supported_ones() -> None:
    with pytest.raises(BatchRejected) as caught:
        run(chat_line("a"), endpoint="/v1/conversations")
    assert caught.value.reason == "unsupported_endpoint"
    assert "/v1/chat/completions" in str(caught.value)


def test_too_many_requests_rejects_the_batch() -> None:
    data = b"".join(chat_line(f"r{i}") for i in range(11))
    with pytest.raises(BatchRejected) as caught:
        run(data, limits=ValidationLimits(10, 10**7, 2**20, 100))
    assert caught.value.reason == "too_many_requests"
    assert "10" in str(caught.value)
    report, _, _ = run(data, limits=ValidationLimits(11, 10**7, 2**20, 100))
    assert report.valid == 11


def test_input_over_max_bytes_rejects_the_batch() -> None:
    data = b"".join(chat_line(f"r{i}") for i in range(20))
    with pytest.raises(BatchRejected) as caught:
        run(data, limits=ValidationLimits(1000, len(data) - 1, 2**20, 100))
    assert caught.value.reason == "input_too_large"
    report, _, _ = run(data, limits=ValidationLimits(1000, len(data), 2**20, 100))
    assert report.valid == 20


def test_no_valid_line_rejects_with_the_report() -> None:
    with pytest.raises(BatchRejected) as caught:
        run(b"{}\n[]\n")
    assert caught.value.reason == "no_valid_requests"
    assert caught.value.report.invalid == 2
    assert "line 1" in str(caught.value)


def test_missing_input_is_unreadable_and_named(tmp_path: Path) -> None:
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(BatchRejected) as caught:
        validate_batch(str(missing), fmt="jsonl", limits=LIMITS, open_input=local_open)
    assert caught.value.reason == "unreadable"
    assert str(missing) in str(caught.value)


def test_several_files_continue_indexes_and_name_the_file(tmp_path: Path) -> None:
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first.write_bytes(chat_line("a0") + chat_line("a1"))
    second.write_bytes(chat_line("b0") + b"broken\n" + chat_line("a0"))
    valid_out, errors_out = io.BytesIO(), io.BytesIO()
    report = validate_batch([str(first), str(second)], fmt="jsonl", limits=LIMITS,
                            open_input=local_open, validated_out=valid_out, errors_out=errors_out)
    assert (report.total, report.valid, report.invalid) == (5, 3, 2)
    assert [r["index"] for r in _lines(valid_out.getvalue())] == [0, 1, 2]
    errors = _lines(errors_out.getvalue())
    assert [(e["index"], e["line"], e["code"]) for e in errors] == [
        (3, 2, "invalid_json"), (4, 3, "duplicate_custom_id")]
    assert all(e["message"].startswith(f"{second}: ") for e in errors)


def test_inline_requests_take_their_index_as_custom_id() -> None:
    items = [
        {"body": {"messages": [{"role": "user", "content": "a"}]}},
        {"custom_id": "named", "body": {"messages": [{"role": "user", "content": "b"}]}},
        "not an object",
        {"custom_id": "x", "body": {"messages": []}},
    ]
    valid_out = io.BytesIO()
    report = validate_batch(items, fmt="inline", endpoint="/v1/chat/completions", limits=LIMITS,
                            validated_out=valid_out)
    assert [r["custom_id"] for r in _lines(valid_out.getvalue())] == ["0", "named"]
    assert [(e.line, e.code) for e in report.errors] == [(3, "not_an_object"), (4, "invalid_body")]


def test_scale_v2_inline_content() -> None:
    content = [{"prompt": "a", "max_tokens": 4}, {"prompt": "b", "max_tokens": -4}]
    report = validate_batch(content, fmt="scale-v2", limits=LIMITS)
    assert report.endpoint == "/v1/completions"
    assert (report.valid, report.invalid) == (1, 1)


def test_scale_v1_inline_content() -> None:
    content = {"prompts": ["a", "b", "c"], "max_new_tokens": 4, "temperature": 0.0}
    valid_out = io.BytesIO()
    report = validate_batch(content, fmt="scale-v1", limits=LIMITS, validated_out=valid_out)
    assert report.endpoint == "/v1/completions" and report.valid == 3
    assert [r["body"]["prompt"] for r in _lines(valid_out.getvalue())] == ["a", "b", "c"]


def test_scale_v1_from_an_unseekable_stream_reads_twice() -> None:
    class Pipe(io.RawIOBase):  # a stream that cannot seek, like a network body
        def __init__(self, data: bytes):
            self._data = io.BytesIO(data)

        def readable(self) -> bool:
            return True

        def readinto(self, buffer) -> int:
            chunk = self._data.read(len(buffer))
            buffer[: len(chunk)] = chunk
            return len(chunk)

    data = json.dumps({"prompts": ["p0", "p1"], "max_new_tokens": 3, "temperature": 0}).encode()
    report = validate_batch(io.BufferedReader(Pipe(data)), fmt="scale-v1", limits=LIMITS)
    assert report.valid == 2


def test_layout_publishes_validated_errors_and_report(llm_batch_home: Path) -> None:
    layout = JobLayout(str(llm_batch_home / "work"), "job-validate-1")
    source = llm_batch_home / "inputs" / "batch.jsonl"
    source.parent.mkdir(parents=True, exist_ok=True)
    source.write_bytes(chat_line("a") + b"oops\n" + chat_line("b"))
    report = validate_batch(str(source), fmt="jsonl", endpoint="/v1/chat/completions",
                            layout=layout, limits=LIMITS)
    assert [r["custom_id"] for r in _lines(storage.read_bytes(layout.validated))] == ["a", "b"]
    assert [e["line"] for e in _lines(storage.read_bytes(layout.validation_errors))] == [2]
    saved = json.loads(storage.read_bytes(layout.validation_report))
    assert saved["valid"] == report.valid == 2 and saved["invalid"] == 1


def test_layout_keeps_errors_when_no_line_is_valid(llm_batch_home: Path) -> None:
    layout = JobLayout(str(llm_batch_home / "work"), "job-validate-2")
    source = llm_batch_home / "inputs" / "bad.jsonl"
    source.parent.mkdir(parents=True, exist_ok=True)
    source.write_bytes(b"oops\n{}\n")
    with pytest.raises(BatchRejected):
        validate_batch(str(source), fmt="jsonl", layout=layout, limits=LIMITS)
    assert len(_lines(storage.read_bytes(layout.validation_errors))) == 2
    assert storage.read_bytes(layout.validated) == b""


def test_layout_publishes_nothing_when_a_limit_is_exceeded(llm_batch_home: Path) -> None:
    layout = JobLayout(str(llm_batch_home / "work"), "job-validate-3")
    source = llm_batch_home / "inputs" / "many.jsonl"
    source.parent.mkdir(parents=True, exist_ok=True)
    source.write_bytes(b"".join(chat_line(f"r{i}") for i in range(5)))
    with pytest.raises(BatchRejected):
        validate_batch(str(source), fmt="jsonl", layout=layout,
                       limits=ValidationLimits(4, 10**7, 2**20, 100))
    assert not storage.exists(layout.validated)
    assert not storage.exists(layout.validation_errors)


def test_check_format_names_the_known_ones() -> None:
    assert check_format("scale-v2").value == "scale-v2"
    with pytest.raises(ValueError, match="jsonl"):
        check_format("csv")


def test_input_is_closed_when_a_limit_stops_validation(tmp_path: Path) -> None:
    source = tmp_path / "many.jsonl"
    source.write_bytes(b"".join(chat_line(f"r{i}") for i in range(5)))
    opened = []

    def tracking_open(uri: str):
        opened.append(open(uri, "rb"))
        return opened[-1]

    with pytest.raises(BatchRejected) as caught:  # keeps the traceback (and its frames) alive
        validate_batch(str(source), fmt="jsonl", open_input=tracking_open,
                       limits=ValidationLimits(2, 10**7, 2**20, 100))
    assert caught.value.reason == "too_many_requests"
    assert opened and opened[0].closed


def test_layout_and_streams_together_are_refused(llm_batch_home: Path) -> None:
    with pytest.raises(ValueError):
        validate_batch(io.BytesIO(chat_line("a")), fmt="jsonl", validated_out=io.BytesIO(),
                       layout=JobLayout(str(llm_batch_home / "work"), "j"))


LINE_KINDS = {
    "valid": lambda i: chat_line(f"id-{i}"),
    "duplicate": lambda i: chat_line("id-0"),
    "junk": lambda i: b"{not json\n",
    "array": lambda i: b"[1]\n",
    "bad_body": lambda i: orjson.dumps({"custom_id": f"bad-{i}", "body": {"messages": []}}) + b"\n",
    "too_long": lambda i: chat_line(f"long-{i}", "x" * 300),
    "blank": lambda i: b"  \n",
}


@settings(max_examples=examples(60), deadline=None)
@given(kinds=st.lists(st.sampled_from(sorted(LINE_KINDS)), max_size=40))
def test_every_non_blank_line_ends_exactly_once_in_order(kinds: list[str]) -> None:
    data = b"".join(LINE_KINDS[kind](i) for i, kind in enumerate(kinds))
    limits = ValidationLimits(1000, 10**7, max_line_bytes=200, max_reported_errors=100)
    valid_out, errors_out = io.BytesIO(), io.BytesIO()
    try:
        report = validate_batch(io.BytesIO(data), fmt="jsonl", limits=limits,
                                validated_out=valid_out, errors_out=errors_out)
    except BatchRejected as exc:
        assert exc.reason == "no_valid_requests"
        report = exc.report
    lines = [n for n, kind in enumerate(kinds, start=1) if kind != "blank"]
    valid, errors = _lines(valid_out.getvalue()), _lines(errors_out.getvalue())
    assert report.total == len(lines) == len(valid) + len(errors)
    merged = sorted([(r["index"], "ok") for r in valid] + [(e["index"], e["line"]) for e in errors])
    assert [index for index, _ in merged] == list(range(len(lines)))
    assert [e["line"] for e in errors] == [lines[e["index"]] for e in errors]
    claimed, expected_valid = set(), 0  # valid lines own their ids; "duplicate" reuses id-0
    for i, kind in enumerate(kinds):
        custom_id = {"valid": f"id-{i}", "duplicate": "id-0"}.get(kind)
        if custom_id is not None:
            expected_valid += custom_id not in claimed
            claimed.add(custom_id)
    assert report.valid == expected_valid


def test_paths_may_be_path_objects_and_an_unknown_format_is_named(tmp_path: Path) -> None:
    first, second = tmp_path / "a b.jsonl", tmp_path / "c.json"
    first.write_bytes(chat_line("a"))
    second.write_bytes(b'[{"prompt": "x"}]')
    assert validate_batch(first, fmt="jsonl", limits=LIMITS, open_input=local_open).valid == 1
    assert validate_batch([second], fmt="scale-v2", limits=LIMITS, open_input=local_open).valid == 1
    with pytest.raises(ValueError, match="known formats: jsonl"):
        validate_batch(first, fmt="csv", limits=LIMITS, open_input=local_open)
