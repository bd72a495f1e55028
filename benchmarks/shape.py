"""The benchmarks' Celery shape: started in a temporary home on free ports, the tiny random
model prepared in each worker's cache, stopped (and its folders removed) at the end."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

MODEL = "tiny-random-llama"


@contextmanager
def temp_shape(workers: int, keep: bool = False) -> Iterator[Any]:
    os.environ.setdefault("LLM_BATCH_ENFORCE_EAGER", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    home = Path(tempfile.mkdtemp(prefix="llm-batch-shape-bench-"))
    os.environ["LLM_BATCH_HOME"] = str(home)

    from llm_batch.core.config import Settings
    from llm_batch.devstack.celery_stack import CeleryStack
    from llm_batch.devstack.stack import free_port

    stack = CeleryStack.create(Settings(home=home), free_port(), workers=workers)
    started = time.monotonic()
    try:
        stack.up(timeout=600)
        stack.prepare_model(MODEL)
        print(f"shape up with {workers} workers in {time.monotonic() - started:.0f} s (home {home})", file=sys.stderr)
        yield stack
    finally:
        if keep:
            print(f"left running: LLM_BATCH_HOME={home} llm-batch down", file=sys.stderr)
        else:
            stack.down()
            shutil.rmtree(stack.pg_root, ignore_errors=True)
            shutil.rmtree(home, ignore_errors=True)


def batch_api(stack: Any):
    import httpx

    return httpx.Client(base_url=f"{stack.base_url}/batch", timeout=60,
                        headers={"Authorization": f"Bearer {stack.ensure_api_key()}"})


def airflow_api(stack: Any):
    import httpx

    return httpx.Client(base_url=f"{stack.base_url}/api/v2", timeout=60,
                        headers={"Authorization": f"Bearer {stack.airflow_token()}"})


def chat_requests(count: int, max_tokens: int, step: int = 0) -> list[dict[str, Any]]:
    """Inline chat requests to the tiny model; request i generates max_tokens + i * step tokens."""
    return [{"custom_id": f"req-{i:04d}", "body": {
        "model": MODEL, "messages": [{"role": "user", "content": f"say {i}"}],
        "max_tokens": max_tokens + i * step, "ignore_eos": True, "temperature": 0}} for i in range(count)]


def wait_job(api: Any, job_id: str, timeout: float = 3600, poll: float = 2) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        job = api.get(f"/v1/jobs/{job_id}").json()
        if job["terminal"] or time.monotonic() > deadline:
            return job
        time.sleep(poll)


def ts(value: str | None) -> float | None:
    """An Airflow / Celery ISO timestamp as epoch seconds (None stays None)."""
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp() if value else None


def all_task_instances(stack: Any, job: dict[str, Any]) -> list[dict[str, Any]]:
    """Every task instance of the job's run (Airflow's API, page by page: it answers at most
    100 a page, fewer than a 64-shard run of the Kubernetes runner's 21 lanes has)."""
    found: list[dict[str, Any]] = []
    with airflow_api(stack) as airflow:
        while True:
            page = airflow.get(f"/dags/batch_inference/dagRuns/{job['dag_run_id']}/taskInstances",
                               params={"limit": 100, "offset": len(found), "order_by": "id"})
            page.raise_for_status()
            body = page.json()
            found += body["task_instances"]
            if not body["task_instances"] or len(found) >= body["total_entries"]:
                return found


def run_task_instances(stack: Any, job: dict[str, Any],
                       tis: list[dict[str, Any]] | None = None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The job's run in Airflow: (the ``prepare`` task instance (it plans last), the shard task instances by
    map index: ``run_shard``'s expanded ones)."""
    tis = all_task_instances(stack, job) if tis is None else tis
    shards = sorted((ti for ti in tis if ti["task_id"] == "run_shard" and ti["map_index"] >= 0),
                    key=lambda t: t["map_index"])
    plan = next(ti for ti in tis if ti["task_id"] == "prepare")
    return plan, shards
