"""Exactly-once under kill -9 of a Celery worker, repeated, on the production shape.

    .venv/bin/python benchmarks/celery_kill_repeat.py [--runs 20] [--requests 60]

Starts the shape (benchmarks/shape.py: two Celery workers with homes of their own, Redis,
PostgreSQL, SeaweedFS S3) once; then each run submits a job of ``--requests`` requests in 2
shards (two sequences at a time, so a shard runs long enough), waits until a shard running on
worker k (1 and 2 in turn) has checkpointed at least 3 results to S3, kills worker k's
process groups with SIGKILL, waits for the job to end, starts worker k again and counts the
output's custom ids: lost (asked, not in the output) and duplicated (more than once).
Prints one line per run and the totals. Targets: 0 lost, 0 duplicated.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

KILL_AFTER_DONE = 3
# [scheduler] task_instance_heartbeat_timeout: how soon the killed try is failed and retried.
HEARTBEAT_TIMEOUT_S = "45"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--requests", type=int, default=60)
    args = parser.parse_args()

    import os

    import orjson

    os.environ["AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT"] = HEARTBEAT_TIMEOUT_S
    os.environ["LLM_BATCH_SHARD_RETRY_DELAY_SECONDS"] = "2"
    from benchmarks.shape import MODEL, airflow_api, batch_api, chat_requests, temp_shape, wait_job

    totals = collections.Counter()
    with temp_shape(2) as stack, batch_api(stack) as api, airflow_api(stack) as airflow:
        s3 = stack.s3_client()

        def done_on_s3(job_id: str, shard: int) -> int:
            try:
                body = s3.get_object(Bucket="llm-batch", Key=f"work/{job_id}/shards/{shard:05d}/progress.json")["Body"]
            except s3.exceptions.NoSuchKey:
                return 0
            return orjson.loads(body.read()).get("done") or 0

        for run in range(1, args.runs + 1):
            worker = 1 + (run - 1) % 2
            requests = chat_requests(args.requests, 60, step=6)
            created = api.post("/v1/jobs", json={"requests": requests, "model": MODEL, "data_parallelism": 2,
                                                  "model_config": {"engine_args": {"max_num_seqs": 2}}})
            created.raise_for_status()
            job_id = created.json()["id"]
            started = time.monotonic()
            killed = None
            while killed is None and time.monotonic() - started < 900:
                run_id = api.get(f"/v1/jobs/{job_id}").json()["dag_run_id"]
                if run_id:
                    tis = airflow.get(f"/dags/batch_inference/dagRuns/{run_id}/taskInstances",
                                      params={"limit": 100}).json()["task_instances"]
                    for ti in tis:
                        if (ti["task_id"] == "run_shard" and ti["state"] == "running"
                                and ti["hostname"] == stack.worker_name(worker)
                                and done_on_s3(job_id, ti["map_index"]) >= KILL_AFTER_DONE):
                            stack.kill_worker(worker)
                            killed = ti["map_index"]
                            break
                time.sleep(1)
            job = wait_job(api, job_id)
            stack.workers_up(timeout=300)
            seen = collections.Counter()
            if job.get("output_file_id"):
                content = api.get(f"/v1/files/{job['output_file_id']}/content").content
                seen.update(orjson.loads(line)["custom_id"] for line in content.splitlines() if line.strip())
            asked = {r["custom_id"] for r in requests}
            lost = len(asked - set(seen))
            duplicated = sum(n - 1 for n in seen.values() if n > 1)
            totals.update(runs=1, killed=killed is not None, lost=lost, duplicated=duplicated,
                          succeeded=job["status"] == "SUCCEEDED")
            print(f"run {run:2d}: killed {stack.worker_name(worker)} on shard {killed}; job {job['status']} "
                  f"in {time.monotonic() - started:.0f} s; lost {lost}, duplicated {duplicated}", flush=True)
    print(f"{totals['runs']} runs ({totals['killed']} with a kill mid-shard, {totals['succeeded']} SUCCEEDED): "
          f"lost {totals['lost']}, duplicated {totals['duplicated']} (target 0 / 0)")
    return 0 if totals["lost"] == totals["duplicated"] == 0 and totals["killed"] == totals["runs"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
