"""Small jobs on the embedded stack, dedicated vs warm engines, side by side in one run.

    .venv/bin/python benchmarks/small_jobs.py [--requests 24] [--jobs 100]
        [--modes dedicated,warm,seated] [--seats 2] [--model smollm2-135m-instruct] [--max-tokens 16]

For each mode, a fresh embedded stack (``llm-batch up``: LocalExecutor, SQLite, the local
runner) in a temporary home, the model cache shared, ``LLM_BATCH_WARM_ENGINES`` off
("dedicated": every shard starts its own engine) or on ("warm": ``llm_batch.runtime.warm_engines``,
one engine, one shard at a time; "seated": one engine running ``--seats`` shards at once,
the default 2 as ``llm-batch up`` runs it):

1. A job of ``--requests`` chat requests, submitted on the native route; then the same job
   again. Printed: submit -> SUCCEEDED of each (in warm mode the first starts the engine,
   the second finds it warm), and the second job's timeline: every task's queued, start and
   end, in seconds after the submit, so the time between the tasks shows too.
2. ``--jobs`` one-request jobs submitted at once. Printed: the time until every one has
   ended, how many SUCCEEDED, and requests lost or duplicated (each job must have exactly
   one result).

Targets (issue 16): the small job under 20 s warm and under 30 s cold; 100 one-request jobs
all SUCCEEDED within 3 minutes; none lost.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.shape import airflow_api, batch_api, ts, wait_job  # noqa: E402


@contextmanager
def temp_stack(warm: bool, model_cache: Path, seats: int = 1) -> Iterator[Any]:
    """One local engine at a time; with warm engines it runs ``seats`` shards at once (the
    pool has as many slots: docs/worker.md, "Seats")."""
    with stack_in_temp_home(model_cache, "small-jobs", LLM_BATCH_WARM_ENGINES="1" if warm else "0",
                            LLM_BATCH_WARM_ENGINE_SEATS=str(seats), LLM_BATCH_LOCAL_POOL_SLOTS="1") as stack:
        yield stack


@contextmanager
def stack_in_temp_home(model_cache: Path, name: str, **env: str) -> Iterator[Any]:
    """A fresh embedded stack (``llm-batch up``) in a temporary home, the model cache shared,
    ``env`` set before it starts; stopped and its home removed after."""
    home = Path(tempfile.mkdtemp(prefix=f"llm-batch-{name}-"))
    os.environ.update(LLM_BATCH_HOME=str(home), LLM_BATCH_MODEL_CACHE=str(model_cache), **env)
    from llm_batch.core.config import get_settings
    from llm_batch.devstack.stack import Stack, free_port

    get_settings.cache_clear()
    stack = Stack.create(get_settings(), free_port())
    try:
        started = time.monotonic()
        stack.up(timeout=600)
        print(f"  stack up in {time.monotonic() - started:.0f} s", flush=True)
        yield stack
    finally:
        stack.down()
        shutil.rmtree(home, ignore_errors=True)


def chat_requests(model: str, count: int, max_tokens: int, tag: str) -> list[dict[str, Any]]:
    return [{"custom_id": f"{tag}-{i}", "body": {"model": model, "messages": [{"role": "user", "content": f"say {i}"}],
                                                 "max_tokens": max_tokens, "temperature": 0}} for i in range(count)]


def submit(api: Any, model: str, requests: list[dict[str, Any]]) -> str:
    created = api.post("/v1/jobs", json={"requests": requests, "model": model})
    created.raise_for_status()
    return created.json()["id"]


def one_job(stack: Any, model: str, count: int, max_tokens: int, tag: str) -> tuple[float, dict[str, Any]]:
    with batch_api(stack) as api:
        submitted_at, started = time.time(), time.monotonic()
        job = wait_job(api, submit(api, model, chat_requests(model, count, max_tokens, tag)), timeout=1800, poll=0.25)
        took = time.monotonic() - started
    if job["status"] != "SUCCEEDED":
        raise SystemExit(f"job {job['id']} ended {job['status']}: {job.get('status_reason')}")
    job["submitted_at"] = submitted_at
    return took, job


def timeline(stack: Any, job: dict[str, Any]) -> list[str]:
    with airflow_api(stack) as airflow:
        tis = airflow.get(f"/dags/batch_inference/dagRuns/{job['dag_run_id']}/taskInstances",
                          params={"limit": 1000}).json()["task_instances"]
    t0 = job["submitted_at"]
    rows = []
    for ti in sorted(tis, key=lambda t: ts(t["start_date"]) or 1e18):
        if ti["map_index"] < 0 and ti["task_id"] == "run_shard":
            continue  # the mapped task's parent row
        marks = [ts(ti.get(k)) for k in ("queued_when", "start_date", "end_date")]
        text = "  ".join(f"{m - t0:6.1f}" if m else "     -" for m in marks)
        name = ti["task_id"] + (f"[{ti['map_index']}]" if ti["map_index"] >= 0 else "")
        rows.append(f"    {name:32} {text}  {ti['state']}")
    return rows


def cpu_seconds(stack: Any) -> dict[str, float]:
    """CPU seconds so far: the machine's (busy: all but idle and iowait) and each stack
    component's process group, its reaped children included (the LocalExecutor's workers
    live in the scheduler's group and reap their task processes)."""
    import psutil

    from llm_batch.devstack.stack import COMPONENTS
    from llm_batch.infra.processes import read_pid

    machine = psutil.cpu_times()
    out = {"machine": sum(machine) - machine.idle - getattr(machine, "iowait", 0.0)}
    leaders = {c: read_pid(stack.pid_file(c)) for c in COMPONENTS}
    for component, leader in leaders.items():
        total = 0.0
        for proc in psutil.process_iter():
            try:
                if leader and os.getpgid(proc.pid) == leader:
                    t = proc.cpu_times()
                    total += t.user + t.system + t.children_user + t.children_system
            except (psutil.Error, ProcessLookupError):
                continue
        out[component] = total
    return out


def many_jobs(stack: Any, model: str, jobs: int, max_tokens: int, timeout: float) -> dict[str, Any]:
    cpu_before = cpu_seconds(stack)
    with batch_api(stack) as api:
        started = time.monotonic()
        ids = [submit(api, model, chat_requests(model, 1, max_tokens, f"many{i}")) for i in range(jobs)]
        submitted = time.monotonic() - started
        pending, ended = set(ids), {}
        while pending and time.monotonic() - started < timeout:
            for job_id in list(pending):
                job = api.get(f"/v1/jobs/{job_id}").json()
                if job["terminal"]:
                    ended[job_id] = job
                    pending.discard(job_id)
            time.sleep(2)
        took = time.monotonic() - started
    cpu = {k: v - cpu_before.get(k, 0.0) for k, v in cpu_seconds(stack).items()}
    statuses: dict[str, int] = {}
    for job in ended.values():
        statuses[job["status"]] = statuses.get(job["status"], 0) + 1
    counts = [(job.get("counts") or {}) for job in ended.values()]
    lost = sum(1 for c in counts if c.get("succeeded", 0) + c.get("failed", 0) != 1)
    return {"submitted_s": submitted, "took_s": took, "ended": len(ended), "pending": len(pending),
            "statuses": statuses, "lost_or_duplicated": lost, "tasks": task_medians(stack, list(ended.values())),
            "cpu": cpu}


def task_medians(stack: Any, jobs: list[dict[str, Any]]) -> list[str]:
    """Where the many jobs' time went: per task, the median wait (queued -> start) and run
    (start -> end) over the ended jobs, and the shard slot's busy seconds per shard."""
    import statistics

    waits: dict[str, list[float]] = {}
    runs: dict[str, list[float]] = {}
    timeline: dict[str, dict[str, float]] = {}
    with airflow_api(stack) as airflow:
        for job in jobs:
            tis = airflow.get(f"/dags/batch_inference/dagRuns/{job['dag_run_id']}/taskInstances",
                              params={"limit": 100}).json()["task_instances"]
            for ti in tis:
                queued, start, end = (ts(ti.get(k)) for k in ("queued_when", "start_date", "end_date"))
                if ti["task_id"] == "run_shard" and start and end:
                    timeline.setdefault(job["id"], {}).update(start=start, end=end)
                if ti["task_id"] == "prepare" and end:
                    timeline.setdefault(job["id"], {})["prepared"] = end
                if start and end:
                    runs.setdefault(ti["task_id"], []).append(end - start)
                    if queued:
                        waits.setdefault(ti["task_id"], []).append(start - queued)
    rows = [f"    {task:12} wait {statistics.median(waits.get(task) or [0]):5.1f} s, run {statistics.median(r):5.1f} s"
            f" (median of {len(r)})" for task, r in runs.items()]
    shard_runs = runs.get("run_shard") or []
    rows.append(f"    shard slot busy: {sum(shard_runs):.0f} s in all, {sum(shard_runs) / max(1, len(shard_runs)):.1f} s per shard")
    rows.append(slot_gaps(list(timeline.values())))
    return rows


def slot_gaps(jobs: list[dict[str, float]]) -> str:
    """Between one shard's end and the next shard's start (one pool slot): how long the slot
    stood idle while a job's shard was ready (its prepare had ended, its shard not started)
    and while none was."""
    jobs = sorted((j for j in jobs if {"prepared", "start", "end"} <= j.keys()), key=lambda j: j["start"])
    ready_idle = none_idle = 0.0
    for before, after in zip(jobs, jobs[1:], strict=False):
        gap_start, gap_end = before["end"], after["start"]
        if gap_end <= gap_start:
            continue
        ready_at = min((j["prepared"] for j in jobs if j["start"] >= gap_end), default=gap_end)
        ready_at = min(max(ready_at, gap_start), gap_end)
        none_idle += ready_at - gap_start
        ready_idle += gap_end - ready_at
    return (f"    shard slot idle between shards: {ready_idle:.0f} s with a shard ready, "
            f"{none_idle:.0f} s with none ready")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--jobs", type=int, default=100)
    parser.add_argument("--modes", default="dedicated,warm,seated",
                        help="dedicated: an engine per shard; warm: one warm engine, one shard at a time; "
                             "seated: one warm engine running --seats shards at once")
    parser.add_argument("--seats", type=int, default=2)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--many-timeout", type=float, default=900, help="stop waiting for the many jobs after this")
    args = parser.parse_args()
    os.environ.setdefault("LLM_BATCH_ENFORCE_EAGER", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from llm_batch.infra.model_cache import prepare_model

    model_cache = prepare_model(args.model).parent
    print(f"load average at start: {os.getloadavg()[0]:.1f}; model {args.model}, {args.requests} requests x "
          f"{args.max_tokens} tokens; {args.jobs} one-request jobs", flush=True)
    summary = []
    for mode in args.modes.split(","):
        print(f"\n== {mode} engines", flush=True)
        with temp_stack(mode != "dedicated", model_cache, args.seats if mode == "seated" else 1) as stack:
            first, _ = one_job(stack, args.model, args.requests, args.max_tokens, "a")
            second, job = one_job(stack, args.model, args.requests, args.max_tokens, "b")
            print(f"  {args.requests}-request job: first {first:.1f} s, second {second:.1f} s (submit -> SUCCEEDED)")
            print("  the second job's tasks: queued, start, end (s after submit)")
            print("\n".join(timeline(stack, job)))
            many = many_jobs(stack, args.model, args.jobs, args.max_tokens, args.many_timeout)
            print(f"  {args.jobs} one-request jobs: submitted in {many['submitted_s']:.1f} s; "
                  f"{many['ended']} ended in {many['took_s']:.0f} s ({many['statuses']}), "
                  f"{many['pending']} still live; lost or duplicated: {many['lost_or_duplicated']}", flush=True)
            print("  the many jobs' tasks: median wait (queued -> start) and run (start -> end)")
            print("\n".join(many["tasks"]), flush=True)
            cpu = many["cpu"]
            rest = cpu["machine"] - sum(v for k, v in cpu.items() if k != "machine")
            print(f"  CPU seconds while they ran: machine {cpu['machine']:.0f} of {(os.cpu_count() or 1) * many['took_s']:.0f} "
                  f"({os.cpu_count()} cores x {many['took_s']:.0f} s); "
                  + ", ".join(f"{k} {v:.0f}" for k, v in cpu.items() if k != "machine")
                  + f" (with the task processes), the rest {rest:.0f} (warm engine, this script)", flush=True)
            summary.append((mode, first, second, many))
    print("\nmode       first job  second job  many: all ended in   SUCCEEDED  lost/dup")
    for mode, first, second, many in summary:
        print(f"{mode:10} {first:8.1f} s {second:9.1f} s  {many['took_s']:8.0f} s{' (not all)' if many['pending'] else '':10}"
              f"  {many['statuses'].get('SUCCEEDED', 0):9}  {many['lost_or_duplicated']}")
    print("targets: small job < 20 s warm, < 30 s cold; 100 one-request jobs all SUCCEEDED within 180 s; none lost")
    return 0


if __name__ == "__main__":
    sys.exit(main())
