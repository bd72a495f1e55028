"""Interactive on a busy stack: a small job's first result and end, warm and beside a big job.

    .venv/bin/python benchmarks/interactive.py [--model tiny-random-llama] [--small 10]
        [--big 100000] [--max-tokens 16] [--skip-big]

One fresh embedded stack (``llm-batch up`` as a user runs it: PostgreSQL, warm engines by
default) in a temporary home, the model cache shared. Two owners: the small jobs are
alice's, the big job is bob's. Printed, each beside its target (issue 45):

1. cold: the first ``--small``-line chat job on the new stack (submit -> first result,
   submit -> end; "no slower than today");
2. warm: the same job again (first result <= 5 s, end <= 15 s) and how long after its first
   finished line the job's counts moved (<= 3 s);
3. the ``--big``-line job alone (bob, the result cache off so that both runs compute every
   line), then again with the small job submitted once the big one runs: the small job's end
   (<= 60 s) and the big job's time against alone (<= +10 %).

A "first result" is the first line ``GET /v1/jobs/{id}/results?order=finished`` answers,
polled every 0.1 s.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.small_jobs import stack_in_temp_home  # noqa: E402

POLL_S = 0.1


def client(stack: Any, key: str) -> httpx.Client:
    return httpx.Client(base_url=f"{stack.base_url}/batch", timeout=120, headers={"Authorization": f"Bearer {key}"})


def owner_key(stack: Any, owner: str) -> str:
    from llm_batch.infra.jobstore import get_job_store

    return get_job_store(stack.settings.database_url).create_api_key(owner, "benchmarks/interactive.py")[1]


def lines(model: str, count: int, max_tokens: int, tag: str) -> bytes:
    """Prompts of their own per tag: a small job's lines are never the result cache's answers."""
    return b"".join(orjson.dumps({"custom_id": f"{tag}-{i}", "body": {
        "model": model, "messages": [{"role": "user", "content": f"say {i} ({tag})"}], "max_tokens": max_tokens,
        "temperature": 0}}) + b"\n" for i in range(count))


def submit(api: httpx.Client, model: str, data: bytes, name: str, **options: Any) -> str:
    uploaded = api.post("/v1/files", files={"file": (name, data)}, data={"purpose": "batch"})
    uploaded.raise_for_status()
    created = api.post("/v1/jobs", json={"model": model, "input_file_ids": [uploaded.json()["id"]], **options})
    created.raise_for_status()
    return created.json()["id"]


def follow(api: httpx.Client, job_id: str, since: float, timeout: float = 3600) -> dict[str, float | None]:
    """Seconds after ``since`` of: the first finished line, the counts first moving, the end."""
    first = moved = None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        now = time.monotonic() - since
        if first is None:
            with api.stream("GET", f"/v1/jobs/{job_id}/results", params={"order": "finished"}) as answer:
                if answer.status_code == 200 and next(answer.iter_lines(), ""):
                    first = now
        job = api.get(f"/v1/jobs/{job_id}").json()
        if moved is None and job["counts"]["completed"] > 0:
            moved = time.monotonic() - since
        if job["terminal"]:
            return {"first": first if first is not None else now, "moved": moved, "end": now,
                    "status": job["status"], "engine_s": (job.get("usage") or {}).get("engine_seconds")}
        time.sleep(POLL_S)
    raise TimeoutError(f"job {job_id} did not end within {timeout} s")


def small_job(api: httpx.Client, model: str, count: int, max_tokens: int, tag: str) -> dict[str, Any]:
    started = time.monotonic()
    job_id = submit(api, model, lines(model, count, max_tokens, tag), f"{tag}.jsonl")
    return {"id": job_id, **follow(api, job_id, started)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-random-llama")
    parser.add_argument("--small", type=int, default=10)
    parser.add_argument("--big", type=int, default=100_000)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--skip-big", action="store_true", help="only the cold and warm small jobs")
    args = parser.parse_args()
    from llm_batch.infra.model_cache import prepare_model

    cache = prepare_model(args.model).parent  # the shared cache (prepared once)
    with stack_in_temp_home(cache, "interactive") as stack:  # as `llm-batch up` runs it: its defaults
        print(f"warm engines: {stack.settings.warm_engines}", flush=True)
        alice, bob = client(stack, owner_key(stack, "alice")), client(stack, owner_key(stack, "bob"))
        cold = small_job(alice, args.model, args.small, args.max_tokens, "cold")
        warm = small_job(alice, args.model, args.small, args.max_tokens, "warm")
        print(f"{args.small}-line job, cold stack: first result {cold['first']:.1f} s, end {cold['end']:.1f} s "
              f"({cold['status']})")
        print(f"{args.small}-line job, warm: first result {warm['first']:.1f} s (target <= 5), "
              f"end {warm['end']:.1f} s (target <= 15) ({warm['status']}); counts moved "
              f"{(warm['moved'] or warm['end']) - warm['first']:+.1f} s after the first result (target <= 3)",
              flush=True)
        if args.skip_big:
            return
        big_data = lines(args.model, args.big, args.max_tokens, "big")
        started = time.monotonic()
        # The result cache off: the second big job computes every line again, as the first.
        alone = follow(bob, submit(bob, args.model, big_data, "big.jsonl", result_cache=False), started)
        print(f"{args.big}-line job alone: {alone['end']:.1f} s ({alone['status']})", flush=True)

        started = time.monotonic()
        big_id = submit(bob, args.model, big_data, "big-again.jsonl", result_cache=False)
        beside: dict[str, Any] = {}

        def small_beside() -> None:
            while bob.get(f"/v1/jobs/{big_id}").json()["counts"]["completed"] == 0:
                time.sleep(0.5)
            beside.update(small_job(alice, args.model, args.small, args.max_tokens, "beside"))

        thread = threading.Thread(target=small_beside)
        thread.start()
        shared = follow(bob, big_id, started)
        thread.join()
        print(f"{args.small}-line job beside it (another owner): end {beside['end']:.1f} s (target <= 60) "
              f"({beside['status']})")
        grown = shared["end"] / alone["end"] - 1
        print(f"{args.big}-line job with it: {shared['end']:.1f} s, {grown:+.1%} against alone (target <= +10 %) "
              f"({shared['status']})")


if __name__ == "__main__":
    main()
