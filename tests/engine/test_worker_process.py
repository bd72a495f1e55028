"""``llm-batch worker`` as a subprocess on the tiny model: resume after kill -9 (exactly one
result per request), progress that moves, the cancel marker (on the real S3 server, with the
engine core in its own process), and the exit codes.

Engine starts are the cost (a few seconds in-process, 15-40 s with the engine core in its own
process), so there are three: the killed run, its resume, and the cancelled run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import orjson
import pytest

from llm_batch.core import exit_codes
from llm_batch.core.layout import JobLayout
from llm_batch.core.records import BatchRequest, dumps_line
from llm_batch.infra.progress import ShardState, read_progress
from llm_batch.infra.results import count_results, read_results

pytestmark = pytest.mark.engine

MODEL_CONFIG = '{"model": "tiny-random-llama", "max_context_length": 512}'
START_TIMEOUT_S = 240


def _shard(home: Path, n: int, max_tokens: int, first_index: int = 1000) -> tuple[JobLayout, str]:
    """A local shard of ``n`` chat requests that each generate exactly ``max_tokens``."""
    layout = JobLayout(str(home / "work"), f"job-{uuid.uuid4().hex[:8]}")
    requests = Path(layout.shard(0).requests)
    requests.parent.mkdir(parents=True)
    with requests.open("wb") as f:
        for i in range(n):
            body = {"messages": [{"role": "user", "content": f"request {i}"}],
                    "max_tokens": max_tokens, "min_tokens": max_tokens}
            f.write(dumps_line(BatchRequest(index=first_index + i, custom_id=f"c{i}", body=body)))
    return layout, str(requests)


def hold(layout: JobLayout, after_results: int) -> None:
    """The shard's first attempt holds after ``after_results`` (the worker's hold point)."""
    from llm_batch.infra import storage

    storage.write_bytes(layout.hold_marker, orjson.dumps({"after_results": after_results}))


def _worker_cmd(layout: JobLayout, *extra: str, model_config: str = MODEL_CONFIG) -> list[str]:
    return [sys.executable, "-m", "llm_batch.cli.main", "worker", "--job-id", layout.job_id, "--shard", "0",
            "--work-uri", layout.work_uri, "--endpoint", "/v1/chat/completions",
            "--model-config", model_config, *extra]


def _start(layout: JobLayout, *extra: str, engine_in_process: bool = True) -> subprocess.Popen:
    cmd = _worker_cmd(layout, "--progress-interval-s", "0.5", *extra)
    env = {**os.environ, "LLM_BATCH_ENGINE_IN_PROCESS": str(engine_in_process).lower()}
    # Own session: kill -9 must take the engine's child processes down too.
    return subprocess.Popen(cmd, env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _wait_for(condition, timeout: float, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"worker exited early with {proc.returncode}"
        assert time.monotonic() < deadline, "timed out waiting for the worker"
        time.sleep(0.2)


def _progress(layout: JobLayout):
    try:
        return read_progress(layout.shard(0).progress)
    except Exception:  # not written yet
        return None


def test_kill_9_then_rerun_gives_exactly_one_result_per_request(llm_batch_home, tiny_model_dir):
    total = 40
    layout, _ = _shard(llm_batch_home, total, max_tokens=16)
    results = layout.shard(0).results
    # The first run holds after 8 results (the worker's hold point): the kill lands mid-shard
    # by construction.
    hold(layout, 8)
    proc = _start(layout, "--window", "1", "--flush-every-records", "4")
    try:
        seen_done: list[int] = []

        def progressed() -> bool:
            p = _progress(layout)
            if p is not None and p.state == ShardState.RUNNING:
                seen_done.append(p.done)
            # Held, the worker flushes the results and then the progress: the kill waits for both.
            return count_results(results) >= 8 and p is not None and p.done >= 8

        _wait_for(progressed, START_TIMEOUT_S, proc)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    killed_engine_seconds = read_progress(layout.shard(0).progress).engine_seconds
    assert seen_done == sorted(seen_done), "progress went backwards"
    killed_at = count_results(results)
    assert 8 <= killed_at < total

    rerun = _start(layout, "--flush-every-records", "4")
    assert rerun.wait(timeout=START_TIMEOUT_S) == exit_codes.DONE
    records = list(read_results(results))
    assert [r.index for r in records] == list(range(1000, 1000 + total))
    assert [r.custom_id for r in records] == [f"c{i}" for i in range(total)]
    assert all(r.status_code == 200 for r in records)
    final = read_progress(layout.shard(0).progress)
    assert final.state == ShardState.DONE
    assert final.done == final.total == total
    assert final.resumed >= killed_at
    # The rerun reports the earlier results too: their successes, their tokens (from the
    # results' usage) and the killed attempt's engine seconds, plus its own.
    assert final.succeeded == total and final.failed == 0
    assert final.completion_tokens == 16 * total
    assert final.prompt_tokens == sum(r.body["usage"]["prompt_tokens"] for r in records)
    assert final.cached_prompt_tokens == sum(r.body["usage"]["prompt_tokens_details"]["cached_tokens"] for r in records)
    assert final.engine_seconds > killed_engine_seconds > 0


@pytest.mark.s3
def test_cancel_marker_on_s3_stops_the_shard_with_a_prefix_written(s3_bucket, tiny_model_dir):
    # Everything on the real S3 server: requests, result parts, progress, cancel marker; the
    # engine core in its own process (vLLM's default, the GPU layout), and two requests the
    # engine refuses among the first results.
    from llm_batch.infra import storage

    total = 40
    layout = JobLayout(f"s3://{s3_bucket}/work", "job-s3")
    bodies = [{"messages": [{"role": "user", "content": f"request {i}"}], "max_tokens": 16, "min_tokens": 16}
              for i in range(total)]
    bodies[1]["messages"][0]["content"] = "hello " * 600  # beyond max_context_length=512
    bodies[2]["response_format"] = {"type": "json_schema", "json_schema": {"schema": {"type": "no-such-type"}}}
    lines = [dumps_line(BatchRequest(index=1000 + i, custom_id=f"c{i}", body=body)) for i, body in enumerate(bodies)]
    storage.write_bytes(layout.shard(0).requests, b"".join(lines))
    hold(layout, 4)  # cancelled mid-shard by construction
    proc = _start(layout, "--window", "1", "--flush-every-records", "4", engine_in_process=False)
    try:
        _wait_for(lambda: (p := _progress(layout)) is not None and p.done >= 4, START_TIMEOUT_S, proc)
        storage.write_bytes(layout.cancel_marker, b"")
        assert proc.wait(timeout=30) == exit_codes.CANCELLED
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    written = list(read_results(layout.shard(0).results))
    assert 4 <= len(written) < total
    assert [r.index for r in written] == list(range(1000, 1000 + len(written)))
    assert [r.status_code for r in written[:4]] == [200, 400, 400, 200]
    assert [r.error.code for r in written[1:3]] == ["context_length_exceeded", "invalid_request"]
    final = read_progress(layout.shard(0).progress)
    assert final.state == ShardState.CANCELLED
    assert final.done == len(written)


def _run_to_exit(layout: JobLayout, *extra: str, model_config: str = MODEL_CONFIG) -> int:
    cmd = _worker_cmd(layout, *extra, model_config=model_config)
    return subprocess.run(cmd, capture_output=True, timeout=120).returncode


def test_exit_codes_before_the_engine_loads(llm_batch_home, tiny_model_dir):
    layout, _ = _shard(llm_batch_home, 3, max_tokens=4)
    assert _run_to_exit(layout, model_config='{"model": "no-such-model"}') == exit_codes.USAGE
    assert _run_to_exit(layout, model_config='{"model": "all-minilm-l6-v2"}') == exit_codes.USAGE
    assert _run_to_exit(layout, "--deadline", str(time.time() - 1)) == exit_codes.DEADLINE
    Path(layout.cancel_marker).touch()
    assert _run_to_exit(layout) == exit_codes.CANCELLED
    assert count_results(layout.shard(0).results) == 0
    assert read_progress(layout.shard(0).progress).state == ShardState.CANCELLED
