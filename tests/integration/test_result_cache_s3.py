"""The result cache on the real S3 server, through kill -9 of the merge step while it fills
the cache: the jobs' work, the answers' packs and the job store are shared as separate
components share them (S3, a database file), the merge runs in its own process.

The kill lands between two shards' entries by construction (the fill's hold point, the job's
hold marker ``{"cache_fill_after_shards": 1}``). After it, every entry the index holds reads
back whole, with its own key (a pack written without its rows is never served); a second job
of the same lines is answered from exactly those entries and runs the rest; the merge run
again (a retried task) completes the cache, and a third job is answered from it whole.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import orjson
import pytest

from llm_batch.core import run_conf
from llm_batch.core.config import Settings
from llm_batch.core.records import ResultRecord
from llm_batch.infra import storage
from llm_batch.infra.jobstore import JobStore
from llm_batch.infra.result_cache import read_answers
from llm_batch.infra.results import ResultsWriter
from llm_batch.pipeline import shard_task, steps
from tests.fixtures.s3 import aws_environment

pytestmark = pytest.mark.s3

LINES = 300
SHARDS = 3
OWNER = run_conf.DEFAULT_OWNER


@pytest.fixture
def on_s3(s3_server, s3_bucket: str, tmp_path: Path):
    """(bucket, settings, store, the merge process's environment): the job's work, its
    result cache and the store as separate components share them, the cache on."""
    configured = {"LLM_BATCH_WORK_URI": f"s3://{s3_bucket}/work",
                  "LLM_BATCH_RESULT_CACHE_URI": f"s3://{s3_bucket}/result-cache",
                  "LLM_BATCH_ALLOWED_BUCKETS": s3_bucket, "LLM_BATCH_RESULT_CACHE": "true",
                  "LLM_BATCH_DATABASE_URL": f"sqlite:///{tmp_path / 'jobs.db'}"}
    settings = Settings(**{name.removeprefix("LLM_BATCH_").lower(): value for name, value in configured.items()})
    store = JobStore(settings.database_url)
    yield s3_bucket, settings, store, {**os.environ, **aws_environment(s3_server), **configured}
    store.close()


def _answer(custom_id: str) -> dict:
    return {"object": "chat.completion", "choices": [{"index": 0, "message": {"content": f"to {custom_id}"}}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}}


def _through_shards(store: JobStore, settings, bucket: str) -> tuple[str, int]:
    """A job of LINES greedy lines through validate and plan, its shards answered by a
    stand-in engine; returns its id and how many requests the shards held."""
    lines = [orjson.dumps({"custom_id": f"r{i}", "body": {"messages": [{"role": "user", "content": f"q{i}"}],
                                                          "max_tokens": 4, "temperature": 0}})
             for i in range(LINES)]
    uri = f"s3://{bucket}/{OWNER}/in-{uuid.uuid4().hex[:6]}.jsonl"
    storage.write_bytes(uri, b"\n".join(lines) + b"\n")
    job_id = steps.register(store, settings, {"input_uri": uri, "model": "tiny-random-llama",
                                              "data_parallelism": SHARDS}, f"manual__{uuid.uuid4().hex}")
    steps.validate(store, settings, job_id)
    held = 0
    for task in steps.plan(store, settings, job_id):
        shard = shard_task.ShardTask.model_validate(task.model_dump())
        requests = [orjson.loads(line) for line in storage.read_bytes(shard.requests_uri).splitlines()]
        with ResultsWriter.open(shard.results_uri) as writer:
            for request in requests:
                writer.write(ResultRecord(index=request["index"], custom_id=request["custom_id"], status_code=200,
                                          body=_answer(request["custom_id"])))
        held += len(requests)
    return job_id, held


def _merge_process(job_id: str, env: dict[str, str]) -> subprocess.Popen:
    code = ("import sys; from llm_batch.core.config import get_settings; "
            "from llm_batch.infra.jobstore import get_job_store; from llm_batch.pipeline import steps; "
            "s = get_settings(); steps.merge(get_job_store(s.database_url), s, sys.argv[1])")
    return subprocess.Popen([sys.executable, "-c", code, job_id], start_new_session=True, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _entries(store: JobStore, job_id: str):
    from sqlalchemy import select

    from llm_batch.infra.jobstore.models import RESULT_CACHE

    with store.engine.connect() as connection:
        return connection.execute(select(RESULT_CACHE).where(RESULT_CACHE.c.job_id == job_id)).all()


def test_kill_9_while_the_cache_fills_serves_no_broken_entry(on_s3):
    bucket, settings, store, merge_env = on_s3
    first, held = _through_shards(store, settings, bucket)
    assert held == LINES
    hold = steps.layout_of(settings, first).hold_marker
    storage.write_bytes(hold, orjson.dumps({"cache_fill_after_shards": 1}))  # held after the first shard's

    merge = _merge_process(first, merge_env)
    deadline = time.monotonic() + 120
    while not _entries(store, first):
        assert merge.poll() is None, merge.stderr.read().decode()
        assert time.monotonic() < deadline, "the merge never started filling the cache"
        time.sleep(0.05)
    os.killpg(merge.pid, signal.SIGKILL)
    merge.wait()
    storage.delete(hold)
    rows = _entries(store, first)
    assert len(rows) == LINES // SHARDS, "not one shard's entries: the kill did not land between two shards'"
    bodies = read_answers(rows)  # every indexed entry whole, under its own key
    assert len(bodies) == len(rows)
    assert all(body["choices"][0]["message"]["content"].startswith("to r") for body in bodies.values())

    second, held = _through_shards(store, settings, bucket)
    assert held == LINES - len(rows)
    steps.merge(store, settings, second)
    job = store.get_job(second)
    assert (job.total, job.succeeded, job.result_cache_hits) == (LINES, LINES, len(rows))
    outputs = [orjson.loads(line) for line in
               storage.read_bytes(steps.layout_of(settings, second).output_jsonl).splitlines()]
    assert [o["custom_id"] for o in outputs] == [f"r{i}" for i in range(LINES)]
    assert all(o["response"]["body"] == _answer(o["custom_id"]) for o in outputs)

    # The first job's merge, run again to the end, completes the cache.
    again = _merge_process(first, merge_env)
    assert again.wait(timeout=300) == 0, again.stderr.read().decode()
    third, held = _through_shards(store, settings, bucket)
    assert held == 0
    steps.merge(store, settings, third)
    assert store.get_job(third).result_cache_hits == LINES
    recent = datetime.now(UTC) - timedelta(hours=1)
    assert len(store.cached_answers(OWNER, [r.key for r in _entries(store, first)], made_after=recent)) >= len(rows)
