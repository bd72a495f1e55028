"""validate_batch reading from and writing to a real S3 server (SeaweedFS)."""

from __future__ import annotations

import json

import orjson
import pytest

from llm_batch.core.layout import JobLayout
from llm_batch.infra import storage
from llm_batch.pipeline.validation import BatchRejected, ValidationLimits, validate_batch

pytestmark = pytest.mark.s3

LIMITS = ValidationLimits(max_requests=10_000, max_input_bytes=10**8, max_line_bytes=4096,
                          max_reported_errors=10)


def chat_line(custom_id: str) -> bytes:
    return orjson.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                         "body": {"messages": [{"role": "user", "content": "Hi"}],
                                  "max_tokens": 8}}) + b"\n"


def test_jsonl_files_on_s3_to_a_layout_on_s3(s3_bucket: str) -> None:
    first, second = f"s3://{s3_bucket}/in/part-1.jsonl", f"s3://{s3_bucket}/in/part-2.jsonl"
    storage.write_bytes(first, b"".join(chat_line(f"r{i}") for i in range(1500)) + b"oops\n")
    storage.write_bytes(second, b"x" * 5000 + b"\n" + chat_line("r0") + chat_line("last"))
    layout = JobLayout(f"s3://{s3_bucket}/work", "job-s3")

    report = validate_batch([first, second], fmt="jsonl", endpoint=None, layout=layout,
                            limits=LIMITS)

    assert (report.total, report.valid, report.invalid) == (1504, 1501, 3)
    assert report.endpoint == "/v1/chat/completions"
    valid = [orjson.loads(line) for line in storage.read_bytes(layout.validated).splitlines()]
    assert [r["index"] for r in valid] == [*range(1500), 1503]
    errors = [orjson.loads(line) for line in
              storage.read_bytes(layout.validation_errors).splitlines()]
    assert [(e["index"], e["code"]) for e in errors] == [
        (1500, "invalid_json"), (1501, "line_too_long"), (1502, "duplicate_custom_id")]
    assert errors[0]["message"].startswith(first) and errors[1]["message"].startswith(second)
    assert json.loads(storage.read_bytes(layout.validation_report))["valid"] == 1501


def test_scale_v1_file_on_s3_is_read_twice(s3_bucket: str) -> None:
    uri = f"s3://{s3_bucket}/in/v1.json"
    storage.write_bytes(uri, json.dumps({"prompts": [f"p{i}" for i in range(300)],
                                         "max_new_tokens": 4, "temperature": 0}).encode())
    report = validate_batch(uri, fmt="scale-v1", limits=LIMITS)
    assert report.valid == 300 and report.endpoint == "/v1/completions"


def test_missing_object_is_unreadable_and_named(s3_bucket: str) -> None:
    uri = f"s3://{s3_bucket}/in/absent.jsonl"
    with pytest.raises(BatchRejected) as caught:
        validate_batch(uri, fmt="jsonl", limits=LIMITS)
    assert caught.value.reason == "unreadable" and uri in str(caught.value)


# -- tried as a user: the CLI on s3:// URIs, each failure a named reason and exit 2 -------------

def _cli(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    from llm_batch.cli.main import main

    status = main(["validate", *argv])
    out, err = capsys.readouterr()
    return status, out, err


def test_cli_reads_s3_and_writes_the_job_there(s3_bucket: str, capsys) -> None:
    uri = f"s3://{s3_bucket}/my batch/in put.jsonl"  # spaces in keys
    storage.write_bytes(uri, b"\xef\xbb\xbf" + chat_line("a").replace(b"\n", b"\r\n") + b"junk")
    status, out, err = _cli(capsys, uri, "--job", "j-s3", "--work-uri", f"s3://{s3_bucket}/work", "--json")
    assert status == 1, err  # a bad line: the others would run
    assert json.loads(out)["errors"][0]["line"] == 2
    layout = JobLayout(f"s3://{s3_bucket}/work", "j-s3")
    assert len(storage.read_bytes(layout.validated).splitlines()) == 1


@pytest.mark.parametrize("where, names", [
    ("{bucket}/absent.jsonl", "no such object"),
    ("no-such-bucket-{bucket}/in.jsonl", "does not exist"),
])
def test_cli_names_a_missing_object_or_bucket(s3_bucket: str, capsys, where: str, names: str) -> None:
    uri = "s3://" + where.format(bucket=s3_bucket)
    status, out, err = _cli(capsys, uri)
    assert status == 2 and out == ""
    assert uri in err and names in err and "Traceback" not in err


def test_cli_names_bad_credentials(s3_wrong_secret: str, capsys) -> None:
    uri = f"s3://{s3_wrong_secret}/in.jsonl"
    status, out, err = _cli(capsys, uri)
    assert status == 2 and out == ""
    assert uri in err and "access denied" in err
