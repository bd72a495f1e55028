"""Latency of the job store's hot calls with N jobs in it (store level, no HTTP).

    .venv/bin/python benchmarks/jobstore.py [--url URL] [--jobs 10000] [--samples 300]

Default URL: a SQLite file in a temp dir. The N jobs (over 50 owners, 3 dialects, mixed
statuses and models) are seeded with one bulk insert (seeding is not what is measured);
then each call is timed `samples` times: get_job with an owner, list_jobs of one owner
filtered by status (page of 100), the next page by cursor, an admin list filtered by
metadata, create_job, add_counts, and a transition. Prints one JSON object of p50 / p99
milliseconds. The API's own targets (GET p99 < 50 ms, list p99 < 100 ms, submit p99 <
250 ms) include HTTP and auth on top of these.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

from sqlalchemy import insert

from llm_batch.core.jobs import JobStatus
from llm_batch.infra.jobstore import JobStore
from llm_batch.infra.jobstore.models import JobRow

OWNERS = [f"user{i}" for i in range(50)]
STATUSES = [JobStatus.SUCCEEDED, JobStatus.SUCCEEDED, JobStatus.RUNNING, JobStatus.QUEUED, JobStatus.FAILED]


def seed(store: JobStore, count: int) -> list[str]:
    """Insert `count` jobs in one transaction; returns their ids."""
    start = datetime.now(UTC) - timedelta(days=7)
    rows = []
    for i in range(count):
        created = start + timedelta(seconds=i * 30)
        rows.append(
            dict(
                id=f"job_{uuid.uuid4().hex}", dialect=("openai", "mistral", "scale")[i % 3],
                endpoint="/v1/chat/completions", model=("tiny", "smollm2")[i % 2],
                model_config={}, input={"file_ids": [f"file-{i}"]}, metadata_={"batch": f"b{i % 20}"},
                labels={}, priority=i % 5, data_parallelism=1, resources={}, errors=[],
                status=STATUSES[i % len(STATUSES)].value, created_at=created, updated_at=created,
                total=100, completed=100, succeeded=99, failed=1, owner=OWNERS[i % len(OWNERS)],
            )
        )
    with store.engine.begin() as connection:
        connection.execute(insert(JobRow), rows)
    return [r["id"] for r in rows]


def timed(samples: int, call: Callable[[int], object]) -> dict[str, float]:
    durations = []
    for i in range(samples):
        began = time.perf_counter()
        call(i)
        durations.append((time.perf_counter() - began) * 1000)
    quantiles = statistics.quantiles(durations, n=100)
    return {"p50_ms": round(quantiles[49], 3), "p99_ms": round(quantiles[98], 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="SQLAlchemy URL (default: a temp SQLite file)")
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--samples", type=int, default=300)
    args = parser.parse_args()
    url = args.url or f"sqlite:///{Path(tempfile.mkdtemp(prefix='jobstore-bench-')) / 'jobs.db'}"
    store = JobStore(url)
    began = time.perf_counter()
    ids = seed(store, args.jobs)
    seconds = time.perf_counter() - began
    pick = random.Random(0)
    created: list[str] = []

    def create(i: int) -> None:
        created.append(
            store.create_job(dialect="openai", endpoint="/v1/chat/completions", model="tiny", owner=OWNERS[i % 50]).id
        )

    def next_page(i: int) -> None:
        first, _ = store.list_jobs(owner=OWNERS[i % 50], limit=100)
        store.list_jobs(owner=OWNERS[i % 50], limit=100, after=first[-1].id)

    figures = {
        "url_backend": url.split(":", 1)[0],
        "jobs": args.jobs,
        "samples": args.samples,
        "seed_seconds": round(seconds, 2),
        "get_job": timed(args.samples, lambda i: store.get_job(pick.choice(ids), owner=None)),
        "list_owner_status_100": timed(
            args.samples,
            lambda i: store.list_jobs(owner=OWNERS[i % 50], statuses=[JobStatus.SUCCEEDED, JobStatus.FAILED], limit=100),
        ),
        "list_owner_first_and_cursor_page": timed(args.samples, next_page),
        "list_admin_metadata_100": timed(args.samples, lambda i: store.list_jobs(metadata={"batch": f"b{i % 20}"}, limit=100)),
        "create_job": timed(args.samples, create),
        "add_counts": timed(args.samples, lambda i: store.add_counts(pick.choice(created), completed=1, succeeded=1)),
        "transition": timed(args.samples, lambda i: store.transition(created[i], JobStatus.VALIDATING)),
    }
    store.close()
    print(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
