"""``llm-batch validate``: its readable summary, the JSON it prints with --json, and its exit
statuses (0 all valid, 1 some lines bad, 2 refused)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from llm_batch.cli.main import main
from llm_batch.core.config import Settings, get_settings

GOOD = '{"custom_id": "%s", "body": {"messages": [{"role": "user", "content": "Hi"}]}}\n'


@pytest.fixture
def batch(tmp_path: Path) -> Path:
    path = tmp_path / "batch.jsonl"
    path.write_text(GOOD % "a" + "not json\n" + GOOD % "a" + GOOD % "b")
    return path


def run_cli(capsys, *argv: str, settings: Settings | None = None) -> tuple[int, dict | None, str]:
    status = main(["validate", *argv, "--json"], settings=settings)
    out, err = capsys.readouterr()
    return status, (json.loads(out) if out.strip() else None), err


def test_readable_summary_names_each_bad_line_and_exits_1(capsys, batch: Path) -> None:
    status = main(["validate", str(batch)])
    out, err = capsys.readouterr()
    assert status == 1 and err == ""
    lines = out.splitlines()
    assert lines[0] == "4 lines read: 2 valid, 2 bad"
    assert lines[1] == "bad lines by code: invalid_json 1, duplicate_custom_id 1"
    assert lines[2].startswith("  line 2  custom_id=-  invalid_json: ")
    assert lines[3].startswith("  line 3  custom_id=a  duplicate_custom_id: ")
    assert len(lines) == 4


def test_an_all_valid_batch_exits_0(capsys, tmp_path: Path) -> None:
    path = tmp_path / "ok.jsonl"
    path.write_text(GOOD % "a" + GOOD % "b")
    assert main(["validate", str(path)]) == 0
    assert capsys.readouterr().out == "2 lines read: 2 valid, 0 bad\n"


def test_the_summary_shows_the_first_bad_lines_and_says_how_many_more(capsys, tmp_path: Path) -> None:
    path = tmp_path / "many.jsonl"
    path.write_text("junk\n" * 15 + GOOD % "ok")
    assert main(["validate", str(path)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert sum(line.startswith("  line ") for line in lines) == 10
    assert lines[-1] == "  ... and 5 more (all of them: --json)"


def test_prints_counts_and_errors_and_exits_1(capsys, batch: Path) -> None:
    status, printed, err = run_cli(capsys, str(batch))
    assert status == 1 and err == ""
    assert set(printed) == {"total", "valid", "invalid", "errors"}
    assert (printed["total"], printed["valid"], printed["invalid"]) == (4, 2, 2)
    assert printed["errors"] == [
        {"line": 2, "custom_id": None, "code": "invalid_json", "message": printed["errors"][0]["message"]},
        {"line": 3, "custom_id": "a", "code": "duplicate_custom_id",
         "message": printed["errors"][1]["message"]},
    ]


def test_no_valid_line_exits_2_with_counts_and_reason(capsys, tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text("[]\n{}\n")
    status, printed, err = run_cli(capsys, str(path))
    assert status == 2
    assert printed["valid"] == 0 and printed["invalid"] == 2
    assert "no_valid_requests" in err


def test_unreadable_input_exits_2_with_the_reason_on_stderr(capsys, tmp_path: Path) -> None:
    status, printed, err = run_cli(capsys, str(tmp_path / "missing.jsonl"))
    assert status == 2 and printed is None
    assert "missing.jsonl" in err and "unreadable" in err


def test_unsupported_endpoint_exits_2(capsys, batch: Path) -> None:
    status, _, err = run_cli(capsys, str(batch), "--endpoint", "/v1/conversations")
    assert status == 2 and "/v1/chat/completions" in err


def test_endpoint_and_format_options(capsys, tmp_path: Path) -> None:
    path = tmp_path / "scale.json"
    path.write_text(json.dumps([{"prompt": "a"}, {"messages": [{"role": "user", "content": "b"}]}]))
    status, printed, _ = run_cli(capsys, str(path), "--format", "scale-v2",
                                 "--endpoint", "/v1/completions")
    assert status == 1 and (printed["valid"], printed["invalid"]) == (1, 1)
    assert printed["errors"][0]["code"] == "endpoint_mismatch"


def test_errors_are_capped_by_settings_counts_are_not(capsys, tmp_path: Path) -> None:
    path = tmp_path / "many.jsonl"
    path.write_text("junk\n" * 12 + GOOD % "ok")
    settings = get_settings().model_copy(update={"max_reported_errors": 3})
    status, printed, _ = run_cli(capsys, str(path), settings=settings)
    assert status == 1
    assert printed["invalid"] == 12 and len(printed["errors"]) == 3


def test_several_inputs_are_one_batch(capsys, tmp_path: Path) -> None:
    first, second = tmp_path / "1.jsonl", tmp_path / "2.jsonl"
    first.write_text(GOOD % "a")
    second.write_text(GOOD % "a")
    status, printed, _ = run_cli(capsys, str(first), str(second))
    assert status == 1 and printed["errors"][0]["code"] == "duplicate_custom_id"
    assert str(second) in printed["errors"][0]["message"]


def test_console_entry_point_reads_stdin(batch: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "llm_batch.cli.main", "validate", "-", "--json"],
                          input=batch.read_bytes(), capture_output=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert json.loads(done.stdout)["valid"] == 2


def test_scale_v1_from_a_pipe_is_read_twice() -> None:
    content = b'{"prompts": ["a", "b", ""], "max_new_tokens": 5, "temperature": 0.5}'
    done = subprocess.run([sys.executable, "-m", "llm_batch.cli.main", "validate", "--format",
                           "scale-v1", "-", "--json"], input=content, capture_output=True, timeout=120)
    assert done.returncode == 1, done.stderr
    printed = json.loads(done.stdout)
    assert (printed["total"], printed["valid"]) == (3, 2)
    assert printed["errors"][0]["line"] == 3


def test_job_option_writes_the_files_shard_reads(capsys, batch: Path) -> None:
    work = Path(get_settings().work_uri)
    status, printed, _ = run_cli(capsys, str(batch), "--job", "j1")
    assert status == 1 and printed["valid"] == 2
    assert sorted(p.name for p in (work / "j1").iterdir()) == [
        "validated.jsonl", "validation.json", "validation_errors.jsonl"]
    assert len((work / "j1" / "validation_errors.jsonl").read_text().splitlines()) == 2
    assert main(["shard", "j1", "-n", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["shards"][1]["last_index"] == 3
    # validating again into a sharded job would leave its shards stale: refused
    status, printed, err = run_cli(capsys, str(batch), "--job", "j1")
    assert status == 2 and printed is None and "has shards already" in err


def test_shard_without_validation_says_how_to_validate(capsys) -> None:
    assert main(["shard", "nojob", "-n", "2"]) == 2
    assert "llm-batch validate INPUT --job nojob" in capsys.readouterr().err


def test_merge_without_shards_says_how_to_shard(capsys) -> None:
    assert main(["merge", "noshards", "--work-uri", get_settings().work_uri]) == 2
    assert "llm-batch shard noshards -n N" in capsys.readouterr().err


@pytest.mark.parametrize("endpoint, bodies", [
    ("/v1/audio/transcriptions", [{"file_id": "file-1", "language": "en"}, {"file_url": "s3://bucket/me/a.wav"},
                                  {"file": {"file_name": "a.wav", "content": "UklGRiQAAABXQVZFZm10IA=="}},
                                  {"file_url": "https://example.com/a.wav"}]),
    ("/v1/ocr", [{"document": {"type": "file", "file_id": "file-1"}},
                 {"document": {"type": "document_url", "document_url": "data:application/pdf;base64,JVBERi0xLjc="}},
                 {"document": {"type": "document_url", "document_url": "/data/me/page.png"}, "pages": [0]},
                 {"document": {"type": "image_url", "image_url": "https://example.com/page.png"}}]),
])
def test_media_endpoints_accept_valid_lines(capsys, tmp_path: Path, endpoint: str, bodies: list) -> None:
    """Offline, a file id or path is checked for its form; inline bytes are read (the last
    line of each, a web URL, is refused; a PDF's pages are the worker's to read)."""
    path = tmp_path / "media.jsonl"
    path.write_text("".join(json.dumps({"custom_id": f"m{i}", "body": b}) + "\n" for i, b in enumerate(bodies)))
    status, printed, _ = run_cli(capsys, str(path), "--endpoint", endpoint)
    assert status == 1 and (printed["valid"], printed["invalid"]) == (3, 1)
    assert printed["errors"][0]["line"] == 4 and printed["errors"][0]["code"] == "invalid_media"
