"""Live progress of a 64-shard job on a real S3 server: storage requests per progress period
and GET-job latency, the old flow (every watcher re-reads every shard) beside the new one
(each watcher reads its own shard, one row per shard in the store).

    .venv/bin/python benchmarks/progress.py [--shards 64] [--periods 5] [--gets 100]

Starts SeaweedFS (``weed server -s3``, the test fixture's own start-up, tests/fixtures/s3.py)
and a SQLite job store in a temp dir; plans a job of 4 requests a shard (inline input) on
``s3://<bucket>/work``. Each period: the stand-in workers (no engine) each publish their
progress object (one PUT a shard), then every shard's watcher reports, all 64 at once on 8
threads, as the shard tasks' 2-second watch loops do. Meanwhile one client thread GETs the
job (``GET /batch/v1/batches/{id}``, the plugin app in-process through TestClient, an API
key). S3 calls are counted with a botocore ``before-call`` hook on llm_batch.infra.storage's client.

- old: what ``pipeline.publish_progress`` did (removed; reproduced here): read the manifest,
  the validation report and every shard's progress object, then one UPDATE of the counts.
- new: ``shard_task.report_shard``: read this shard's progress object, one transaction that
  upserts its row and sets the job's counts from the rows' sum.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.fixtures.s3: the server start-up


class _TmpFactory:
    """What the s3_server fixture asks of pytest's tmp_path_factory."""

    def __init__(self, root: Path):
        self.root = root

    def mktemp(self, name: str) -> Path:
        path = Path(tempfile.mkdtemp(prefix=name, dir=self.root))
        return path


def _old_publish(store, settings, job_id: str) -> None:
    """The old watcher round: every shard's progress object, whoever asks."""
    from llm_batch.infra import storage
    from llm_batch.infra.progress import read_progress
    from llm_batch.pipeline import steps
    from llm_batch.pipeline.sharding import read_manifest

    layout = steps.layout_of(settings, job_id)
    manifest = read_manifest(layout)
    invalid = int(orjson.loads(storage.read_bytes(layout.validation_report)).get("invalid", 0))
    succeeded, failed = 0, invalid
    for shard in manifest.shards:
        progress = read_progress(shard.progress_uri)
        succeeded += progress.succeeded
        failed += progress.failed
    store.set_counts(job_id, completed=succeeded + failed, succeeded=succeeded, failed=failed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=64)
    parser.add_argument("--periods", type=int, default=5)
    parser.add_argument("--per-shard", type=int, default=4)
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="llm-batch-progress-bench-"))
    os.environ.update(LLM_BATCH_HOME=str(root / "home"), LLM_BATCH_DATABASE_URL=f"sqlite:///{root / 'jobs.db'}")
    from pytest import MonkeyPatch

    from tests.fixtures import s3

    server_fixture = s3.s3_server.__wrapped__(_TmpFactory(root))
    server = next(server_fixture)
    patch = MonkeyPatch()
    try:
        bucket = s3._new_bucket(server)
        patch.setenv("LLM_BATCH_WORK_URI", f"s3://{bucket}/work")
        patch.setenv("LLM_BATCH_ALLOWED_BUCKETS", bucket)
        s3._point_storage_at(patch, server, server.secret_key)
        run(args)
    finally:
        patch.undo()
        next(server_fixture, None)  # stops the server


def run(args: argparse.Namespace) -> None:
    from fastapi.testclient import TestClient

    from llm_batch.api.app import create_app
    from llm_batch.core import run_conf
    from llm_batch.core.config import get_settings
    from llm_batch.core.jobs import JobStatus
    from llm_batch.infra import storage
    from llm_batch.infra.jobstore import JobStore
    from llm_batch.infra.progress import ShardProgress
    from llm_batch.pipeline import shard_task, steps

    settings = get_settings()
    store = JobStore(settings.database_url)
    key = store.create_api_key(run_conf.DEFAULT_OWNER, "bench")[1]
    body = {"messages": [{"role": "user", "content": "q"}], "max_tokens": 2}
    requests = [{"custom_id": f"r{i}", "body": body} for i in range(args.shards * args.per_shard)]
    job_id = steps.register(store, settings, {"input_requests": requests, "model": "tiny-random-llama",
                                                 "data_parallelism": args.shards}, f"manual__bench{time.time_ns()}")
    steps.validate(store, settings, job_id)
    tasks = steps.plan(store, settings, job_id)
    assert len(tasks) == args.shards and store.get_job(job_id).status == JobStatus.RUNNING

    calls: dict[str, int] = {}
    lock = threading.Lock()

    def count(event_name: str, **_: object) -> None:
        operation = event_name.rsplit(".", 1)[-1]
        with lock:
            calls[operation] = calls.get(operation, 0) + 1

    storage._backend(f"s3://{tasks[0].progress_uri.split('/')[2]}/x").client.meta.events.register("before-call.s3", count)
    app = TestClient(create_app(settings, store), base_url="http://testserver")
    headers = {"Authorization": f"Bearer {key}"}
    for name in ("httpx", "httpx2"):  # one log line per GET otherwise (after Airflow's logging set-up)
        logging.getLogger(name).setLevel(logging.WARNING)

    def workers_publish(period: int) -> None:
        for task in tasks:
            done = min(args.per_shard, period + 1)
            storage.write_bytes(task.progress_uri, ShardProgress(
                job_id=job_id, shard=task.shard, total=args.per_shard, done=done, succeeded=done,
                prompt_tokens=10 * done, completion_tokens=5 * done, engine_seconds=2.0 * (period + 1),
                state="running").model_dump_json().encode())

    flows = {
        "old": lambda task: _old_publish(store, settings, job_id),
        "new": lambda task: shard_task.report_shard(store, task),
    }
    results = {}
    for name, watch in flows.items():
        latencies: list[float] = []
        stop = threading.Event()

        def poll_api() -> None:
            while not stop.is_set():
                start = time.perf_counter()
                response = app.get(f"/v1/batches/{job_id}", headers=headers)  # the app unmounted
                latencies.append((time.perf_counter() - start) * 1000)
                assert response.status_code == 200, response.text

        reads_per_period, seconds_per_period = [], []
        poller = threading.Thread(target=poll_api, daemon=True)
        poller.start()
        with ThreadPoolExecutor(8) as pool:
            for period in range(args.periods):
                workers_publish(period)
                calls.clear()
                start = time.perf_counter()
                list(pool.map(watch, tasks))
                seconds_per_period.append(time.perf_counter() - start)
                reads_per_period.append(dict(calls))
        stop.set()
        poller.join()
        latencies.sort()
        results[name] = dict(
            reads=statistics.median(sum(c.values()) for c in reads_per_period),
            kinds=reads_per_period[-1],
            round_s=statistics.median(seconds_per_period),
            gets=len(latencies),
            p50=latencies[len(latencies) // 2],
            p99=latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))],
        )
    n = args.shards
    print(f"{n} shards, {args.periods} progress periods per flow, load average {os.getloadavg()[0]:.1f}")
    print(f"expected storage reads per period: old N x (N + 2) = {n * (n + 2)}, new N = {n}")
    print(f"{'flow':<5} {'S3 calls/period':>16} {'by operation':<28} {'all watchers s':>15} "
          f"{'GETs':>5} {'GET p50 ms':>11} {'GET p99 ms':>11}")
    for name, r in results.items():
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(r["kinds"].items()))
        print(f"{name:<5} {r['reads']:>16,.0f} {kinds:<28} {r['round_s']:>15.2f} {r['gets']:>5} "
              f"{r['p50']:>11.1f} {r['p99']:>11.1f}")
    job = store.get_job(job_id)
    print(f"job counts after the new flow: completed {job.completed}/{job.total}, "
          f"tokens {job.prompt_tokens}+{job.completion_tokens}, engine s {job.engine_seconds}")


if __name__ == "__main__":
    main()
