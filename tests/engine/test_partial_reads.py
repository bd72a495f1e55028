"""Partial reads while the real worker runs, on the real S3 server, through kill -9.

A job of 60 chat lines (4 refused at validation) planned on SeaweedFS; its shard's worker
(``llm-batch worker``, tiny model, engine in process) is read from continuously, killed
with -9 mid-shard (held there by the worker's hold point), read from again, and rerun to the
end while reads go on (several shards interleaving: tests/unit/test_partial_results.py).
Every read's lines are checked as they come: input order stops at the first unfinished
line, no line changes between reads. At the end the merge's output and error files hold
each of the 60 lines once, and every line any read showed is there unchanged: the final
files are what partial reads showed plus the rest.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import orjson
import pytest

from llm_batch.core import exit_codes
from llm_batch.core.layout import JobLayout
from llm_batch.core.records import BatchRequest, ErrorRecord, dumps_line
from llm_batch.infra import storage
from llm_batch.infra.results import count_results
from llm_batch.pipeline.merge import PartialOrder, merge_job, partial_entries
from llm_batch.pipeline.sharding import plan_shards
from tests.engine.test_worker_process import hold

pytestmark = [pytest.mark.engine, pytest.mark.s3]

TOTAL = 60
REFUSED = {5, 17, 30, 44}
MODEL_CONFIG = '{"model": "tiny-random-llama", "max_context_length": 512}'
START_TIMEOUT_S = 240


def _job(layout: JobLayout) -> None:
    """Validated requests and validation errors as validation writes them (line = index + 1)."""
    requests, errors = [], []
    for i in range(TOTAL):
        if i in REFUSED:
            errors.append(ErrorRecord(index=i, line=i + 1, custom_id=f"c{i}", code="invalid_request",
                                      message=f"line {i + 1}: refused"))
        else:
            body = {"messages": [{"role": "user", "content": f"request {i}"}], "max_tokens": 8, "min_tokens": 8}
            requests.append(BatchRequest(index=i, custom_id=f"c{i}", body=body))
    storage.write_bytes(layout.validated, b"".join(dumps_line(r) for r in requests))
    storage.write_bytes(layout.validation_errors, b"".join(dumps_line(e) for e in errors))


def _worker(layout: JobLayout, shard: int, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "llm_batch.cli.main", "worker", "--job-id", layout.job_id, "--shard", str(shard),
           "--work-uri", layout.work_uri, "--endpoint", "/v1/chat/completions", "--model-config", MODEL_CONFIG,
           "--progress-interval-s", "0.5", *extra]
    env = {**os.environ, "LLM_BATCH_ENGINE_IN_PROCESS": "true"}
    return subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


class Reader(threading.Thread):
    """Reads both orders over and over, checking each read against every earlier one."""

    def __init__(self, layout: JobLayout):
        super().__init__(daemon=True)
        self.layout = layout
        self.shown: dict[str, dict] = {}
        self.reads = 0
        self.longest_prefix = 0
        self.failure: BaseException | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                ordered = list(partial_entries(self.layout, PartialOrder.INPUT))
                finished = list(partial_entries(self.layout, PartialOrder.FINISHED))
                assert [e["index"] for e in ordered] == list(range(len(ordered)))
                # Read later, the finished lines hold at least the ordered prefix read before.
                assert [e["index"] for e in finished[:len(ordered)]] == list(range(len(ordered)))
                assert len(ordered) >= self.longest_prefix, "a partial read went backwards"
                self.longest_prefix = len(ordered)
                for entry in finished:
                    line = entry.get("output") or entry["error"]
                    assert self.shown.setdefault(line["id"], line) == line, f"line {entry['line']} changed"
                self.reads += 1
                self.stop.wait(0.25)  # a breath between reads: the worker shares the 2 cores
        except BaseException as exc:  # handed to the test thread
            self.failure = exc


def test_partial_reads_through_kill_9_equal_the_final_files(s3_bucket, tiny_model_dir):
    layout = JobLayout(f"s3://{s3_bucket}/work", "job-partial")
    _job(layout)
    plans = plan_shards(layout, 1)
    reader = Reader(layout)
    reader.start()
    results = layout.shard(0).results
    hold(layout, 9)  # the first attempt holds after 9 results: the kill lands mid-shard by construction
    proc = _worker(layout, 0, "--window", "1", "--flush-every-records", "3")
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while count_results(results) < 9:
            assert proc.poll() is None and time.monotonic() < deadline, "the worker did not get going"
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    killed_at, reads_before = count_results(results), reader.reads
    assert 9 <= killed_at < plans[0].count
    deadline = time.monotonic() + 60
    while reader.reads < reads_before + 2:  # a whole read of the killed shard's checkpoint
        assert reader.is_alive() and time.monotonic() < deadline, reader.failure
        time.sleep(0.05)

    assert _worker(layout, 0, "--flush-every-records", "3").wait(timeout=START_TIMEOUT_S) == exit_codes.DONE
    reader.stop.set()
    reader.join(timeout=60)
    if reader.failure:
        raise reader.failure
    assert reads_before > 0 and reader.reads > reads_before
    assert reader.longest_prefix == TOTAL  # the last reads saw the whole job

    counts = merge_job(layout)
    assert (counts.total, counts.succeeded, counts.invalid, counts.not_run) == (TOTAL, TOTAL - len(REFUSED), 4, 0)
    final: dict[str, dict] = {}
    for uri in (layout.output_jsonl, layout.errors_jsonl):
        for raw in storage.read_bytes(uri).splitlines():
            record = orjson.loads(raw)
            assert record["id"] not in final, "a line twice in the final files"
            final[record["id"]] = record
    assert len(final) == TOTAL
    assert len(reader.shown) == TOTAL
    assert all(final[line_id] == line for line_id, line in reader.shown.items())
