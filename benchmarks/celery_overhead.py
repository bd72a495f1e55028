"""Scheduling overhead per shard on the production shape (``llm-batch up --executor celery``).

    .venv/bin/python benchmarks/celery_overhead.py [--shards 64] [--workers 2] [--max-tokens 4]

Starts the Celery shape (CeleryExecutor, Redis broker, PostgreSQL, SeaweedFS S3, N Celery
workers with homes of their own; src/llm_batch/devstack/celery_stack.py) under a temporary LLM_BATCH_HOME
on free ports, prepares the tiny random model in each worker's cache, submits one job of
``--shards`` shards x 1 request (native route, inline requests) and reads the run's task
instances from Airflow's API and each shard's ``engine_seconds`` from its progress on S3.

Prints, with the run's timestamps (Airflow's start/end of each task instance):

- wall: plan done -> last shard done;
- engine: the sum of the shards' engine loop seconds (``engine_seconds``: generation only);
- overhead per shard = (wall x engines - engine) / shards, one engine per worker: the engine
  time a shard costs beyond its generation (what of the dispatch by scheduler and Celery
  and of the task's start the engine waits for; the ``llm-batch worker`` process with its
  engine start-up and model load, or the handover to a warm engine; checkpoint on S3);
- the same after each worker's first shard (its engine's start: once per engine with warm
  engines, once per shard without);
- split in its parts (medians over shards): queued -> started (scheduler + broker + worker
  pick-up), started -> ended minus engine (task process + worker process + engine start;
  with warm engines also the wait for the engine), and the gap on one worker between a
  shard's end and its next shard's start (negative: the next task started before).

Target: overhead per shard under 2 s.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TARGET_S = 2.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--keep", action="store_true", help="leave the shape running (prints its home)")
    args = parser.parse_args()

    import orjson

    from benchmarks.shape import batch_api, chat_requests, run_task_instances, temp_shape, wait_job
    from benchmarks.shape import ts as _ts

    with temp_shape(args.workers, keep=args.keep) as stack:
        model = "tiny-random-llama"
        requests = chat_requests(args.shards, args.max_tokens)
        with batch_api(stack) as api:
            created = api.post("/v1/jobs", json={"requests": requests, "model": model,
                                                  "data_parallelism": args.shards})
            created.raise_for_status()
            job_id = created.json()["id"]
            job = wait_job(api, job_id, poll=5)
        if job["status"] != "SUCCEEDED":
            print(f"job {job_id} ended {job['status']}: {job.get('status_reason')}", file=sys.stderr)
            return 1
        plan, shards = run_task_instances(stack, job)
        s3 = stack.s3_client()
        engine = {}
        for ti in shards:
            key_name = f"work/{job_id}/shards/{ti['map_index']:05d}/progress.json"
            engine[ti["map_index"]] = orjson.loads(s3.get_object(Bucket="llm-batch", Key=key_name)["Body"].read())[
                "engine_seconds"]
        wall = max(_ts(ti["end_date"]) for ti in shards) - _ts(plan["end_date"])
        engine_total = sum(engine.values())
        # One engine per worker: dedicated (concurrency 1) or warm (concurrency 2, one of the
        # two tasks waiting for the engine): the engine time a shard costs beyond generation.
        slots = args.workers
        per_shard = (wall * slots - engine_total) / len(shards)
        queued = [_ts(ti["start_date"]) - _ts(ti["queued_when"]) for ti in shards if ti.get("queued_when")]
        inside = [_ts(ti["end_date"]) - _ts(ti["start_date"]) - engine[ti["map_index"]] for ti in shards]
        gaps = []
        by_host: dict[str, list] = {}
        for ti in shards:
            by_host.setdefault(ti["hostname"], []).append(ti)
        # Once each engine has run its first shard (its start and model load, or a dedicated
        # shard's own): the worker time per later shard beyond generation.
        later_wall = later_engine = 0.0
        for host_tis in by_host.values():
            host_tis.sort(key=lambda t: _ts(t["start_date"]))
            gaps += [_ts(b["start_date"]) - _ts(a["end_date"]) for a, b in zip(host_tis, host_tis[1:], strict=False)]
            first = min(host_tis, key=lambda t: _ts(t["end_date"]))
            later = [t for t in host_tis if t is not first]
            later_wall += max((_ts(t["end_date"]) for t in later), default=_ts(first["end_date"])) - _ts(first["end_date"])
            later_engine += sum(engine[t["map_index"]] for t in later)
        later_count = len(shards) - len(by_host)
        tries = sum(ti["try_number"] for ti in shards) - len(shards)
        print(f"job {job_id}: {len(shards)} shards x 1 request, {args.workers} Celery workers "
              f"(shards per worker: {', '.join(f'{h} {len(t)}' for h, t in sorted(by_host.items()))}), "
              f"retries {tries}")
        print(f"plan done -> last shard done: {wall:.1f} s; engine (generation) total {engine_total:.1f} s")
        verdict = "OK" if per_shard < TARGET_S else "OVER TARGET"
        print(f"overhead per shard: {per_shard:.2f} s  (target < {TARGET_S:.0f} s: {verdict})")
        if later_count:
            print(f"  after each worker's first shard: {(later_wall - later_engine) / later_count:.2f} s per shard")
        if queued:
            print(f"  queued -> started (scheduler, broker, pick-up), median: {statistics.median(queued):.2f} s")
        print(f"  started -> ended minus engine (task + worker process + engine start), median: "
              f"{statistics.median(inside):.2f} s")
        if gaps:
            print(f"  one worker's shard end -> its next shard start, median: {statistics.median(gaps):.2f} s")
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
