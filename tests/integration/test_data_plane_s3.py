"""The data plane on a real S3 server: validate -> plan shards -> worker results with a kill
and resume -> merge, every file on s3://, outputs complete and in input order."""

from __future__ import annotations

import orjson
import pytest

from llm_batch.core.layout import JobLayout
from llm_batch.core.records import ResultRecord
from llm_batch.infra import storage
from llm_batch.infra.results import ResultsWriter, count_results, list_parts, read_results
from llm_batch.infra.storage import iter_lines
from llm_batch.pipeline.merge import MergeCounts, merge_job
from llm_batch.pipeline.sharding import plan_shards, read_manifest
from llm_batch.pipeline.validation import validate_batch

pytestmark = pytest.mark.s3

LINES = 120


def _input() -> bytes:
    lines = []
    for i in range(LINES):
        if i % 10 == 3:
            lines.append(b'{"custom_id": "x", "body": ')  # invalid JSON
        else:
            lines.append(orjson.dumps({"custom_id": f"r{i}", "body": {
                "messages": [{"role": "user", "content": f"question {i}"}], "max_tokens": 8}}))
    return b"\n".join(lines) + b"\n"


def _requests(uri: str) -> list[dict]:
    with storage.open_read(uri) as stream:
        return [orjson.loads(line) for line in iter_lines(stream)]


def _answer(request: dict) -> ResultRecord:
    return ResultRecord(index=request["index"], custom_id=request["custom_id"], status_code=200,
                        body={"object": "chat.completion", "echo": request["custom_id"]})


def test_job_on_s3_survives_a_killed_worker_and_merges_in_order(s3_bucket):
    layout = JobLayout(f"s3://{s3_bucket}/work", "job-s3")
    storage.write_bytes(f"s3://{s3_bucket}/in/batch.jsonl", _input())
    report = validate_batch(f"s3://{s3_bucket}/in/batch.jsonl", fmt="jsonl", layout=layout)
    assert (report.valid, report.invalid) == (108, 12)

    plans = plan_shards(layout, 3, by="tokens")
    assert [p.index for p in plans] == [0, 1, 2] and sum(p.count for p in plans) == 108
    assert read_manifest(layout).shards == plans

    # Shard 0 runs fully; shard 1 is killed after 2 published parts, then resumed to the
    # end; shard 2 is killed and never comes back.
    first = plans[0]
    with ResultsWriter.open(first.results_uri, flush_every_records=7) as writer:
        for request in _requests(first.requests_uri):
            writer.write(_answer(request))
    assert len(list_parts(first.results_uri)) == -(-first.count // 7)

    second = _requests(plans[1].requests_uri)
    killed = ResultsWriter.open(plans[1].results_uri, flush_every_records=5, flush_every_s=3600)
    for request in second[:13]:
        killed.write(_answer(request))  # 10 published, 3 lost with the process
    resumed = ResultsWriter.open(plans[1].results_uri, flush_every_records=5)
    assert resumed.done == 10
    for request in second[resumed.done:]:
        resumed.write(_answer(request))
    resumed.close()
    assert count_results(plans[1].results_uri) == len(second)
    assert [r.index for r in read_results(plans[1].results_uri)] == [r["index"] for r in second]

    third = _requests(plans[2].requests_uri)
    with ResultsWriter.open(plans[2].results_uri, flush_every_records=4) as writer:
        for request in third[:4]:
            writer.write(_answer(request))

    scale_uri = f"s3://{s3_bucket}/out/result.json"
    counts = merge_job(layout, array_output_uri=scale_uri, not_run_reason="job timed out")
    not_run = len(third) - 4
    assert counts == MergeCounts(total=LINES, succeeded=108 - not_run, failed=12 + not_run,
                                 not_run=not_run, invalid=12, cached_prompt_tokens=None)

    outputs = [orjson.loads(x) for x in storage.read_bytes(layout.output_jsonl).splitlines()]
    errors = [orjson.loads(x) for x in storage.read_bytes(layout.errors_jsonl).splitlines()]
    ok_lines = [int(o["custom_id"][1:]) + 1 for o in outputs]
    error_lines = [e["line"] for e in errors]
    assert ok_lines == sorted(ok_lines) and error_lines == sorted(error_lines)
    assert sorted(ok_lines + error_lines) == list(range(1, LINES + 1))
    assert {e["error"]["message"] for e in errors if e["error"]["code"] == "shard_failed"} == {
        "job timed out"}

    scale = orjson.loads(storage.read_bytes(scale_uri))
    assert len(scale) == LINES
    assert all(("error" in item) == (i + 1 in error_lines)
               for i, item in enumerate(scale))

    before = [storage.read_bytes(u) for u in (layout.output_jsonl, layout.errors_jsonl, scale_uri)]
    assert merge_job(layout, array_output_uri=scale_uri, not_run_reason="job timed out") == counts
    assert [storage.read_bytes(u) for u in (layout.output_jsonl, layout.errors_jsonl,
                                            scale_uri)] == before
