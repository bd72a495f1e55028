"""Concurrent form triggers and API creates against the embedded stack, and `up` from nothing.

    .venv/bin/python benchmarks/stack_concurrency.py [--n 20] [--model smollm2-135m-instruct]
        [--databases postgres sqlite]

For each database in turn (one run, so the two sit side by side under the same load): starts
a stack on it in a fresh LLM_BATCH_HOME (timing `Stack.up`; the model cache is the one of
the caller's home, so the model is prepared), then sends N form-like
triggers (`POST /api/v2/dags/batch_inference/dagRuns` with the conf the Trigger form sends)
interleaved with N native creates (`POST /batch/v1/jobs`), all at once, and prints per kind
the count of each HTTP status, how many answers mention "database is locked", and p50/p95
latency. No client retries: a 5xx here is a 5xx a user of the UI or /api/v2 would see. The
stack is stopped at the end. Figures: docs/benchmarks.md ("Embedded stack").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from llm_batch.core.config import Settings, get_settings
from llm_batch.devstack.stack import DATABASES, Stack, free_port


def form_conf(model: str, i: int) -> dict:
    """What the Trigger form sends for a small inline batch (dags/batch_inference.py PARAMS)."""
    return {
        "job_id": None, "input_uri": None, "input_file_ids": None, "input_format": "jsonl",
        "input_requests": [{"custom_id": f"form-{i}", "body": {"messages": [{"role": "user", "content": "hi"}],
                                                                  "max_tokens": 4}}],
        "output_uri": None, "endpoint": "/v1/chat/completions", "model": model, "model_config": {},
        "data_parallelism": 1, "max_runtime_sec": 600, "priority": None, "labels": {"bench": "form"},
    }


def api_job(model: str, i: int) -> dict:
    return {"model": model, "endpoint": "/v1/chat/completions", "labels": {"bench": "api"},
            "requests": [{"custom_id": f"api-{i}", "body": {"messages": [{"role": "user", "content": "hi"}],
                                                               "max_tokens": 4}}]}


def timed(send) -> tuple[int, float, bool]:
    started = time.monotonic()
    try:
        response = send()
        status, text = response.status_code, response.text
    except httpx.HTTPError as exc:
        status, text = 0, str(exc)  # 0: no answer (timeout, reset)
    return status, time.monotonic() - started, "database is locked" in text


def load(stack: Stack, n: int, model: str) -> dict[str, dict]:
    token = stack.airflow_token()
    key = stack.api_key_file.read_text().strip()
    airflow = {"Authorization": f"Bearer {token}"}
    batch = {"Authorization": f"Bearer {key}"}

    def trigger(i: int):
        return timed(lambda: httpx.post(
            f"{stack.base_url}/api/v2/dags/batch_inference/dagRuns", headers=airflow, timeout=120,
            json={"dag_run_id": f"manual__bench_{uuid.uuid4().hex[:10]}", "logical_date": None,
                  "conf": form_conf(model, i)}))

    def create(i: int):
        return timed(lambda: httpx.post(f"{stack.base_url}/batch/v1/jobs", headers=batch, timeout=120,
                                        json=api_job(model, i)))

    calls = [(kind, fn, i) for i in range(n) for kind, fn in (("form trigger", trigger), ("api create", create))]
    with ThreadPoolExecutor(max_workers=len(calls)) as pool:
        answers = list(pool.map(lambda c: (c[0], c[1](c[2])), calls))
    report: dict[str, dict] = {}
    for kind in ("form trigger", "api create"):
        mine = [a for k, a in answers if k == kind]
        latencies = sorted(s for _, s, _ in mine)
        report[kind] = {
            "statuses": dict(Counter(status for status, _, _ in mine)),
            "database_is_locked": sum(locked for _, _, locked in mine),
            "p50_s": round(statistics.median(latencies), 2),
            "p95_s": round(latencies[max(0, round(0.95 * len(latencies)) - 1)], 2),
        }
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=20, help="triggers and creates each")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--databases", nargs="+", choices=DATABASES, default=list(DATABASES))
    args = parser.parse_args()
    os.environ["LLM_BATCH_MODEL_CACHE"] = str(get_settings().model_cache)
    results = []
    for database in args.databases:
        with tempfile.TemporaryDirectory(prefix="llm-batch-bench-") as home:
            os.environ["LLM_BATCH_HOME"] = home
            stack = Stack.create(Settings(home=Path(home)), free_port(), database)
            started = time.monotonic()
            try:
                stack.up(timeout=600)
                up_s = time.monotonic() - started
                results.append({"database": database, "up_s": round(up_s, 1),
                                "load": load(stack, args.n, args.model), "loadavg": os.getloadavg()})
            finally:
                stack.down()
        print(json.dumps(results[-1], indent=1), flush=True)


if __name__ == "__main__":
    main()
