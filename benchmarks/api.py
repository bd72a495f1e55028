"""Batch API latency against a real ``airflow api-server`` with 10,000 jobs in the store.

Run: ``.venv/bin/python benchmarks/api.py [--jobs 10000] [--samples 300]``

Sets up a throw-away Airflow home (SQLite metadata DB, this repo's dags/, the plugin from
its entry point) and an llm-batch home, puts N jobs in the job store (10 owners, mixed
status, model and metadata), starts ``airflow api-server`` and times over HTTP (keep-alive,
one client, an API key as Bearer, so each request also pays authentication):

- GET one job            GET /batch/v1/batches/{id}                           (own jobs)
- list, filtered, 100    GET /batch/v1/batch/jobs?status=SUCCESS&model=..&page_size=100
- submit                 POST /batch/v1/batch/jobs (4 inline requests): job row, inline
                         file and the DAG run created in Airflow's DB; no scheduler runs,
                         so the run itself is excluded.
Targets: GET p99 < 50 ms, list p99 < 100 ms, submit p99 < 250 ms.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OWNERS = [f"user{i}" for i in range(10)]
MODELS = ["smollm2-135m-instruct", "tiny-random-llama"]
STATUSES = ["SUCCEEDED", "FAILED", "CANCELLED", "RUNNING", "QUEUED"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def environment(root: Path, port: int) -> dict[str, str]:
    airflow_home = root / "airflow"
    airflow_home.mkdir()
    return {
        **os.environ,
        "LLM_BATCH_HOME": str(root / "llm-batch"),
        "AIRFLOW_HOME": str(airflow_home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{airflow_home / 'airflow.db'}",
        "AIRFLOW__API__BASE_URL": f"http://127.0.0.1:{port}",
        "AIRFLOW__API__WORKERS": "1",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin",
        "AIRFLOW__API_AUTH__JWT_SECRET": "llm-batch-benchmark-" + "x" * 64,
    }


def seed_store(n_jobs: int) -> str:
    """N jobs spread over owners, statuses, models, metadata; returns user0's API key."""
    from llm_batch.core.jobs import JobStatus
    from llm_batch.infra.jobstore import get_job_store

    store = get_job_store()
    rng = random.Random(7)
    start = datetime.now(UTC) - timedelta(days=30)
    for i in range(n_jobs):
        job = store.create_job(
            dialect=rng.choice(["openai", "mistral", "scale"]),
            endpoint="/v1/chat/completions",
            model=rng.choice(MODELS),
            owner=OWNERS[i % len(OWNERS)],
            input={"file_ids": [f"file-seed{i}"]},
            input_format="jsonl",
            metadata={"team": f"t{i % 7}"},
            max_runtime_sec=86_400,
            created_at=start + timedelta(seconds=i * 200),
        )
        status = rng.choice(STATUSES)
        if status == "RUNNING":
            store.transition(job.id, JobStatus.VALIDATING)
        if status != "QUEUED":
            store.transition(job.id, JobStatus(status))
    return store.create_api_key(OWNERS[0], "benchmark")[1]


def wait_healthy(url: str, process: subprocess.Popen, timeout: float = 180) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"airflow api-server exited with {process.returncode}")
        try:
            if httpx.get(f"{url}/batch/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError("airflow api-server did not become healthy")


def airflow_token_check(url: str, airflow_home: Path) -> int:
    """Not a figure: the plugin on the real server also takes Airflow's own JWT."""
    import json

    import httpx

    passwords = json.loads((airflow_home / "simple_auth_manager_passwords.json.generated").read_text())
    token = httpx.post(f"{url}/auth/token", json={"username": "admin", "password": passwords["admin"]}).json()["access_token"]
    return httpx.get(f"{url}/batch/v1/batch/jobs", headers={"Authorization": f"Bearer {token}"}).status_code


def timed(client, method: str, url: str, samples: int, **kwargs) -> list[float]:
    out = []
    for i in range(samples):
        args = kwargs(i) if callable(kwargs) else kwargs
        began = time.perf_counter()
        response = client.request(method, url(i) if callable(url) else url, **args)
        out.append((time.perf_counter() - began) * 1000)
        response.raise_for_status()
    return out


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1] if len(values) > 1 else values[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--samples", type=int, default=300)
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="llm-batch-bench-api-"))
    port = free_port()
    env = environment(root, port)
    os.environ.update({k: v for k, v in env.items() if k.startswith("LLM_BATCH_")})
    airflow = [sys.executable, "-m", "airflow"]
    logs = root / "logs.txt"
    with logs.open("wb") as log:
        print(f"setting up Airflow in {root} ...", flush=True)
        subprocess.run([*airflow, "db", "migrate"], env=env, stdout=log, stderr=log, check=True)
        subprocess.run([*airflow, "dags", "reserialize"], env=env, stdout=log, stderr=log, check=True)
        began = time.perf_counter()
        key = seed_store(args.jobs)
        print(f"seeded {args.jobs} jobs in {time.perf_counter() - began:.1f} s", flush=True)
        server = subprocess.Popen(
            [*airflow, "api-server", "--host", "127.0.0.1", "--port", str(port)],
            env=env, stdout=log, stderr=log, start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, server)
        import httpx

        from llm_batch.infra.jobstore import get_job_store

        own, _ = get_job_store().list_jobs(owner=OWNERS[0], limit=1000)
        ids = [j.id for j in own]
        headers = {"Authorization": f"Bearer {key}"}
        jwt_status = airflow_token_check(url, Path(env["AIRFLOW_HOME"]))
        with httpx.Client(base_url=f"{url}/batch", headers=headers, timeout=30) as client:
            timed(client, "GET", "/health", 20)  # warm-up: connections, caches
            results = {
                "GET job": timed(client, "GET", lambda i: f"/v1/batches/{ids[i % len(ids)]}", args.samples),
                "list (100, filtered)": timed(
                    client, "GET", "/v1/batch/jobs", args.samples,
                    params={"status": "SUCCESS", "model": MODELS[0], "page_size": 100},
                ),
                "submit": timed(
                    client, "POST", "/v1/batch/jobs", max(50, args.samples // 3),
                    json={
                        "requests": [{"custom_id": str(i), "body": {"messages": [{"role": "user", "content": "hi"}]}} for i in range(4)],
                        "endpoint": "/v1/chat/completions",
                        "model": "tiny-random-llama",
                    },
                ),
            }
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)

    targets = {"GET job": 50, "list (100, filtered)": 100, "submit": 250}
    load = os.getloadavg()
    print(f"\njobs in store: {args.jobs}; load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}; {datetime.now(UTC):%Y-%m-%d %H:%M} UTC")
    print(f"Airflow JWT from /auth/token accepted by /batch: HTTP {jwt_status}")
    print(f"{'operation':<22}{'n':>5}{'p50 ms':>9}{'p99 ms':>9}{'target p99':>12}  ok")
    for name, values in results.items():
        p99 = pct(values, 99)
        print(f"{name:<22}{len(values):>5}{pct(values, 50):>9.1f}{p99:>9.1f}{targets[name]:>12}  {'yes' if p99 < targets[name] else 'NO'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
