"""Merge: output and error files in input order, Scale array, counts, idempotence."""

from __future__ import annotations

import contextlib

import orjson
import pytest

from llm_batch.core.records import BatchRequest, ErrorRecord, ResultRecord, dumps_line
from llm_batch.infra import storage
from llm_batch.infra.results import ResultsWriter, part_uri
from llm_batch.pipeline.merge import MergeCounts, MergeError, merge_job
from llm_batch.pipeline.sharding import plan_shards
from tests.unit.data_plane_fixtures import engine_error, new_layout, ok_result, write_job


def jsonl(uri: str) -> list[dict]:
    return [orjson.loads(line) for line in storage.read_bytes(uri).splitlines()]


@pytest.fixture
def job():
    """10 input lines (3 and 7 invalid), 3 shards [0,1,2] [4,5] [6,8,9]; shard 0 all run
    (1 is an engine error), shard 1 half run, shard 2 nothing run."""
    layout = new_layout()
    requests = write_job(layout, [i not in (3, 7) for i in range(10)])
    plans = plan_shards(layout, 3)
    by_index = {r.index: r for r in requests}
    ran = {0: [0, 1, 2], 1: [4], 2: []}
    for plan in plans:
        with ResultsWriter.open(plan.results_uri) as writer:
            for index in ran[plan.index]:
                record = by_index[index]
                writer.write(engine_error(record) if index == 1 else ok_result(record))
    return layout, plans


def test_outputs_cover_every_line_in_order(job):
    layout, plans = job
    assert [(p.first_index, p.last_index) for p in plans] == [(0, 2), (4, 5), (6, 9)]
    counts = merge_job(layout, json_array=True)
    # The stand-in bodies carry no usage: no token counts, their details unknown.
    assert counts == MergeCounts(total=10, succeeded=3, failed=7, not_run=4, invalid=2,
                                 cached_prompt_tokens=None)

    outputs = jsonl(layout.output_jsonl)
    assert [o["custom_id"] for o in outputs] == ["req-0", "req-2", "req-4"]
    assert all(o["error"] is None and o["response"]["status_code"] == 200 for o in outputs)
    assert outputs[0]["response"]["body"] == {"object": "chat.completion", "echo": "req-0"}
    assert all(o["id"].startswith("batch_req_") and o["response"]["request_id"].startswith("req_")
               for o in outputs)

    errors = jsonl(layout.errors_jsonl)
    assert [e["line"] for e in errors] == [2, 4, 6, 7, 8, 9, 10]
    assert [e["error"]["code"] for e in errors] == [
        "context_length_exceeded", "invalid_json", "shard_failed", "shard_failed", "invalid_json",
        "shard_failed", "shard_failed"]
    engine = errors[0]
    assert engine["response"]["status_code"] == 400
    assert engine["response"]["body"]["error"] == {
        "message": "prompt is too long", "type": "invalid_request_error",
        "code": "context_length_exceeded"}
    assert all(e["response"] is None for e in errors[1:])
    assert errors[1]["custom_id"] is None and errors[2]["custom_id"] == "req-5"

    ids = [o["id"] for o in outputs + errors]
    assert len(set(ids)) == 10

    scale = orjson.loads(storage.read_bytes(layout.output_json))
    assert len(scale) == 10
    assert scale[0] == {"object": "chat.completion", "echo": "req-0"}
    assert scale[1] == {"error": {"code": "context_length_exceeded", "message": "prompt is too long"},
                        "custom_id": "req-1", "line": 2}
    assert scale[3]["error"]["code"] == "invalid_json" and scale[3]["line"] == 4
    assert [("error" not in s) for s in scale] == [i in (0, 2, 4) for i in range(10)]


def test_rerun_writes_the_same_bytes(job):
    layout, _ = job
    first = merge_job(layout, json_array=True)
    files = [storage.read_bytes(u) for u in (layout.output_jsonl, layout.errors_jsonl, layout.output_json)]
    assert merge_job(layout, json_array=True) == first
    assert [storage.read_bytes(u) for u in (layout.output_jsonl, layout.errors_jsonl,
                                            layout.output_json)] == files


def test_not_run_reasons_job_wide_and_per_shard(job):
    layout, _ = job
    merge_job(layout, not_run_reason="job cancelled before this request ran",
              shard_not_run_reasons={2: "shard 2 failed after 3 attempts"})
    messages = {e["custom_id"]: e["error"]["message"] for e in jsonl(layout.errors_jsonl)
                if e["error"]["code"] == "shard_failed"}
    assert messages == {"req-5": "job cancelled before this request ran",
                        "req-6": "shard 2 failed after 3 attempts",
                        "req-8": "shard 2 failed after 3 attempts",
                        "req-9": "shard 2 failed after 3 attempts"}


def test_array_output_uri_override_and_jsonl_off(job):
    layout, _ = job
    target = layout.root + "/user/out.json"
    merge_job(layout, jsonl=False, array_output_uri=target)
    assert len(orjson.loads(storage.read_bytes(target))) == 10
    assert not storage.exists(layout.output_jsonl) and not storage.exists(layout.output_json)


def test_all_invalid_job_merges_to_errors_only():
    layout = new_layout()
    write_job(layout, [False, False, False])
    plan_shards(layout, 2)
    assert merge_job(layout, json_array=True) == MergeCounts(3, 0, 3, 0, 3)
    assert storage.read_bytes(layout.output_jsonl) == b""
    assert [e["line"] for e in jsonl(layout.errors_jsonl)] == [1, 2, 3]
    assert len(orjson.loads(storage.read_bytes(layout.output_json))) == 3


def test_empty_scale_array_is_valid_json():
    layout = new_layout()
    write_job(layout, [])
    plan_shards(layout, 1)
    assert merge_job(layout, json_array=True).total == 0
    assert orjson.loads(storage.read_bytes(layout.output_json)) == []


def test_stale_and_repeated_results_are_passed_over(job):
    layout, plans = job
    # A later part repeats index 4 and holds an index shard 1 does not own (3).
    storage.write_bytes(part_uri(plans[1].results_uri, 1), b"".join(
        dumps_line(ResultRecord(index=i, custom_id=f"req-{i}", status_code=200, body={}))
        for i in (3, 4, 5)))
    counts = merge_job(layout)
    assert (counts.total, counts.succeeded) == (10, 4)  # 5 is now done, 3 stays invalid


def test_overlapping_records_for_one_index_fail_the_merge_and_publish_nothing(job):
    layout, _ = job
    extra = ErrorRecord(index=0, line=1, custom_id=None, code="invalid_json", message="dup")
    storage.write_bytes(layout.validation_errors,
                        dumps_line(extra) + storage.read_bytes(layout.validation_errors))
    with pytest.raises(MergeError, match="input index 0 comes after index 0"):
        merge_job(layout)
    assert not storage.exists(layout.output_jsonl)


def test_cli_shards_and_merges_a_job(capsys):
    from llm_batch.cli.main import main

    layout = new_layout()
    write_job(layout, [True, False, True, True])
    assert main(["shard", layout.job_id, "-n", "2", "--work-uri", layout.work_uri]) == 0
    assert sorted(s["count"] for s in orjson.loads(capsys.readouterr().out)["shards"]) == [1, 2]
    assert main(["merge", layout.job_id, "--scale", "--work-uri", layout.work_uri,
                 "--not-run-reason", "cancelled"]) == 0
    assert orjson.loads(capsys.readouterr().out) == {
        "total": 4, "succeeded": 0, "failed": 4, "not_run": 3, "invalid": 1,
        "prompt_tokens": 0, "completion_tokens": 0, "cached_prompt_tokens": 0, "reasoning_tokens": 0,
        "result_cache_hits": 0, "result_cache_tokens": 0,
        "invalid_output": 0, "output_retries": 0, "retry_tokens": 0, "by_model": {}}
    assert main(["merge", "no-such-job", "--work-uri", layout.work_uri]) == 2
    assert "no-such-job" in capsys.readouterr().err


def test_merge_holds_at_most_three_streams_open_whatever_the_shard_count(monkeypatch):
    layout = new_layout()
    write_job(layout, [i % 4 != 1 for i in range(200)])
    for plan in plan_shards(layout, 64):
        with ResultsWriter.open(plan.results_uri) as writer:
            first = BatchRequest(index=plan.first_index, custom_id="c", body={})
            writer.write(ok_result(first))
    open_now, most = 0, 0
    real_open_read = storage.open_read

    @contextlib.contextmanager
    def counting_open_read(uri, **kwargs):
        nonlocal open_now, most
        with real_open_read(uri, **kwargs) as stream:
            open_now += 1
            most = max(most, open_now)
            try:
                yield stream
            finally:
                open_now -= 1

    monkeypatch.setattr(storage, "open_read", counting_open_read)
    counts = merge_job(layout, json_array=True)
    assert (counts.total, counts.succeeded, counts.invalid) == (200, 64, 50)
    assert most == 3


def test_error_lines_carry_the_input_line_past_blank_lines():
    """Blank JSONL lines get no index, so the line number must come from validation."""
    from llm_batch.pipeline.validation import validate_batch

    layout = new_layout()
    body = orjson.dumps({"messages": [{"role": "user", "content": "hi"}]})
    source = b"\n".join([b'{"custom_id": "a", "body": ' + body + b"}", b"",
                         b'{"custom_id": "b", "body": ' + body + b"}", b"not json",
                         b'{"custom_id": "c", "body": ' + body + b"}"]) + b"\n"
    storage.write_bytes(f"{layout.root}/input.jsonl", source)
    validate_batch(f"{layout.root}/input.jsonl", fmt="jsonl", endpoint="/v1/chat/completions",
                   layout=layout)
    (plan,) = plan_shards(layout, 1)
    with ResultsWriter.open(plan.results_uri) as writer:  # "a" fails in the engine, "c" never runs
        writer.write(engine_error(BatchRequest(index=0, custom_id="a", body={})))
    merge_job(layout)
    lines = {e["custom_id"]: (e["line"], e["error"]["code"]) for e in jsonl(layout.errors_jsonl)}
    assert lines["a"] == (1, "context_length_exceeded")
    assert lines["b"][0] == 3  # index 1, line 3: the blank line 2 is skipped
    assert lines[None] == (4, "invalid_json")
    assert lines["c"] == (5, "shard_failed")
