"""One counting rule, every dialect, every moment (a property test over interleavings).

A job of N lines (some invalid) in S shards runs through the real pipeline steps on a real
SQLite store; hypothesis draws an interleaving of shard progress (results written by a
stand-in worker, successes and engine errors, a resumed attempt republishing, a stale
report read late), cancel, deadline and a shard failing for good. After each step the
watcher of the shard it touched reports that shard alone (``shard_task.report_shard``: its
own progress object into its own row; cancel and deadline: every watcher, one by one), and
after every report each dialect's view of the job must hold:

- Mistral and Scale: succeeded + failed == completed <= total;
- OpenAI request_counts: completed + failed <= total;
- no live count (nor token count: the stand-in's failures use none) ever goes down.

When the job ends every request is in exactly one bucket (completed == total ==
succeeded + failed, one output or error line each), requests that never ran carry the code
of why (batch_cancelled, batch_expired, shard_failed) and, in a shard that failed, a message
naming that shard; the usage is the sum of the output lines' usage.
"""

from __future__ import annotations

import shutil
import uuid
from datetime import timedelta
from pathlib import Path

import orjson
from hypothesis import HealthCheck, given
from hypothesis import settings as hyp_settings
from hypothesis import strategies as st

from llm_batch.api.mistral.models import BatchJobOut
from llm_batch.api.openai.models import BatchOut
from llm_batch.api.scale.models import BatchCompletionsJob
from llm_batch.core import jobs, run_conf
from llm_batch.core.config import Settings
from llm_batch.core.records import ResultRecord
from llm_batch.infra import storage
from llm_batch.infra.jobstore import JobStore, utcnow
from llm_batch.infra.progress import ShardProgress
from llm_batch.infra.results import ResultsWriter
from llm_batch.pipeline import shard_task, steps
from tests.fuzzing import examples

STEP = st.one_of(
    st.tuples(st.just("progress"), st.integers(0, 3), st.integers(1, 4), st.booleans()),
    st.tuples(st.just("resume"), st.integers(0, 3)),
    st.tuples(st.just("stale"), st.integers(0, 3)),
    st.tuples(st.just("cancel")),
    st.tuples(st.just("deadline")),
    st.tuples(st.just("fail"), st.integers(0, 3)),
)
FAILED_FOR_GOOD = "the worker failed (exit status 1); a retry resumes on attempt 3 of 3"
USAGE = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5, "prompt_tokens_details": {"cached_tokens": 1}}


def _views(job) -> dict[str, tuple[int, ...]]:
    batch = BatchOut.of(job)
    openai, usage = batch.request_counts, batch.usage
    mistral = BatchJobOut.of(job)
    scale = BatchCompletionsJob.of(job, None).metadata
    return {
        "openai": (openai.total, openai.completed, openai.failed),
        "openai usage": (usage.input_tokens, usage.output_tokens, usage.total_tokens) if usage else (0, 0, 0),
        "mistral": (mistral.total_requests, mistral.completed_requests, mistral.succeeded_requests, mistral.failed_requests),
        "scale": tuple(scale[k] for k in ("total_requests", "completed_requests", "succeeded_requests", "failed_requests")),
    }


def _check(views: dict[str, tuple[int, ...]], before: dict[str, tuple[int, ...]] | None) -> None:
    total, completed, failed = views["openai"]
    assert completed + failed <= total, views
    for name in ("mistral", "scale"):
        total, completed, succeeded, failed = (int(x) for x in views[name])
        assert succeeded + failed == completed <= total, (name, views)
    if before is not None:
        for name, counts in views.items():
            assert all(now >= then for now, then in zip(counts, before[name])), (name, before[name], counts)


class _Shards:
    """Stand-in workers: each shard's results and progress as a worker writes them."""

    def __init__(self, tasks: list[dict]):
        self.tasks = [shard_task.ShardTask.model_validate(t) for t in tasks]
        self.requests = [[orjson.loads(x) for x in storage.read_bytes(t.requests_uri).splitlines()] for t in self.tasks]
        self.done = [0] * len(self.tasks)
        self.ok = [0] * len(self.tasks)
        self.failed_for_good: set[int] = set()

    def advance(self, k: int, n: int, ok: bool) -> None:
        task, requests = self.tasks[k], self.requests[k]
        batch = requests[self.done[k]:self.done[k] + n]
        with ResultsWriter.open(task.results_uri) as writer:
            for request in batch:
                writer.write(ResultRecord(index=request["index"], custom_id=request["custom_id"],
                                          status_code=200 if ok else 400,
                                          body={"object": "x", "usage": USAGE} if ok else {"object": "x"}))
        self.done[k] += len(batch)
        self.ok[k] += len(batch) if ok else 0
        self.publish(k, resumed=0)

    def publish(self, k: int, resumed: int, stale: bool = False) -> None:
        """What the worker writes; a resumed attempt reports its earlier results too. A
        stale report (an older state read late by a watcher) reports half of it."""
        task = self.tasks[k]
        done, ok = (self.done[k] // 2, min(self.ok[k], self.done[k] // 2)) if stale else (self.done[k], self.ok[k])
        progress = ShardProgress(job_id=task.job_id, shard=task.shard, total=len(self.requests[k]), done=done,
                                 succeeded=ok, failed=done - ok, resumed=resumed, prompt_tokens=3 * ok,
                                 completion_tokens=2 * ok, cached_prompt_tokens=ok, engine_seconds=0.5 * done,
                                 state="running")
        storage.write_bytes(task.progress_uri, progress.model_dump_json().encode())

    def fail_for_good(self, k: int) -> shard_task.ShardOutcome:
        """The shard's last attempt failed: no more results; its task records the outcome."""
        self.failed_for_good.add(k)
        return shard_task.ShardOutcome(shard=self.tasks[k].shard, exit_code=1, state="failed", message=FAILED_FOR_GOOD)


@hyp_settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lines=st.integers(1, 24),
    bad=st.sets(st.integers(0, 23), max_size=4),
    shards=st.integers(1, 4),
    moves=st.lists(STEP, max_size=12),
    cancel_at=st.sampled_from(["never", "queued", "validated"]),
)
def test_counts_tell_one_story_at_every_moment(tmp_path: Path, sqlite_store_template: Path, lines, bad, shards,
                                               moves, cancel_at):
    settings = Settings()
    copy = tmp_path / f"{uuid.uuid4().hex}.db"  # a migrated store per example
    shutil.copyfile(sqlite_store_template, copy)
    store = JobStore(f"sqlite:///{copy}")
    try:
        _one_job(store, settings, lines, bad, shards, moves, cancel_at)
    finally:
        store.close()


def _one_job(store, settings, lines, bad, shards, moves, cancel_at):
    path = settings.local_roots[0] / run_conf.DEFAULT_OWNER / f"inv-{uuid.uuid4().hex}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"messages": [{"role": "user", "content": "q"}], "max_tokens": 2}
    path.write_bytes(b"".join((b"{broken" if i in bad else orjson.dumps({"custom_id": f"r{i}", "body": body})) + b"\n"
                              for i in range(lines)))
    job_id = steps.register(store, settings, {"input_uri": str(path), "model": "tiny-random-llama",
                                                 "data_parallelism": shards}, f"manual__{uuid.uuid4().hex}")
    seen = _views(store.get_job(job_id))
    _check(seen, None)

    def observe(task=None, outcome=None) -> None:
        """One watcher's report: its own shard's progress object into its own row (the
        validation step has no watcher: the counts are read as they are)."""
        nonlocal seen
        if task is not None:
            shard_task.report_shard(store, task, outcome)
        now = _views(store.get_job(job_id))
        _check(now, seen)
        seen = now

    if cancel_at == "queued":
        store.request_cancel(job_id)
    try:
        validated = steps.validate(store, settings, job_id)
    except jobs.JobRejected:  # no valid line: FAILED at validation, every line an error
        job = store.get_job(job_id)
        _check(_views(job), seen)
        assert job.status.value == "FAILED" and job.total == job.completed == job.failed == lines
        return
    if validated is not None:
        observe()
    if cancel_at == "validated":
        store.request_cancel(job_id)
    tasks = [t.model_dump() for t in steps.plan(store, settings, job_id)]
    workers = _Shards(tasks) if tasks else None
    for step in moves if workers else []:
        k = step[1] % len(workers.tasks) if len(step) > 1 else None
        if k in workers.failed_for_good:
            continue  # its task has ended: no worker, no watcher
        outcome = None
        if step[0] == "progress":
            workers.advance(k, step[2], step[3])
        elif step[0] in ("resume", "stale"):
            workers.publish(k, resumed=workers.done[k], stale=step[0] == "stale")
        elif step[0] == "fail":
            outcome = workers.fail_for_good(k)
        elif step[0] == "cancel":
            store.request_cancel(job_id)
        else:
            store._update_job(job_id, expires_at=utcnow() - timedelta(seconds=1))
        watching = [k] if k is not None else sorted(set(range(len(workers.tasks))) - workers.failed_for_good)
        for w in watching:
            observe(workers.tasks[w], outcome)

    steps.merge(store, settings, job_id)
    job = steps.finalize(store, settings, job_id)
    final = _views(job)
    _check(final, seen)
    assert job.terminal
    if job.total == 0:  # cancelled before its input was read: says so, nothing to account for
        assert "before its input was read" in job.status_reason
        return
    assert job.total == lines and job.completed == job.total == job.succeeded + job.failed
    outputs = storage.read_bytes(store.get_file(job.output_file_id).uri).splitlines()
    errors = [orjson.loads(x) for x in storage.read_bytes(store.get_file(job.error_file_id).uri).splitlines()]
    assert len(outputs) == job.succeeded and len(errors) == job.failed
    indices = [int(orjson.loads(o)["custom_id"][1:]) for o in outputs] + [e["line"] - 1 for e in errors]
    assert sorted(indices) == list(range(lines))  # each line exactly once
    never_run = {e["error"]["code"] for e in errors} - {"invalid_json", "request_failed", None}
    expected = {"CANCELLED": "batch_cancelled", "TIMEOUT_EXCEEDED": "batch_expired", "FAILED": "shard_failed"}
    codes = {c for c in never_run if c in ("batch_cancelled", "batch_expired", "shard_failed")}
    assert codes <= {expected.get(job.status.value, "")}, (job.status, codes)
    # A request its failed shard never ran says which shard and why.
    shard_of = {r["index"]: t.shard for t, requests in zip(workers.tasks, workers.requests) for r in requests} if workers else {}
    failed_shards = {workers.tasks[k].shard for k in workers.failed_for_good} if workers else set()
    for error in errors:
        if error["error"]["code"] in expected.values() and shard_of.get(error["line"] - 1) in failed_shards:
            shard = shard_of[error["line"] - 1]
            assert error["error"]["message"] == f"shard {shard}: {FAILED_FOR_GOOD}", error
    # The usage is the output lines' usage, summed.
    usage = BatchOut.of(job).usage
    bodies = [orjson.loads(o)["response"]["body"] for o in outputs]
    assert usage.input_tokens == sum(b["usage"]["prompt_tokens"] for b in bodies) == job.prompt_tokens
    assert usage.output_tokens == sum(b["usage"]["completion_tokens"] for b in bodies)
    assert usage.input_tokens_details.cached_tokens == len(bodies)
