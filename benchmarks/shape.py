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
from pathlib import Path
from typing import Any

MODEL = "tiny-random-llama"


@contextmanager
def temp_shape(workers: int, keep: bool = False) -> Iterator[Any]:
    os.environ.setdefault("LLM_BATCH_ENFORCE_EAGER", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    home = Path(tempfile.mkdtemp(prefix="llm-batch-shape-bench-"))
    os.environ["LLM_BATCH_HOME"] = str(home)

    from llm_batch.celery_stack import CeleryStack
    from llm_batch.config import Settings
    from llm_batch.stack import free_port

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
