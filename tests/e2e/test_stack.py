"""End to end on the real embedded stack (api-server, scheduler, dag-processor, triggerer as
processes; local vLLM-CPU shard workers on the tiny random model): every entry point, and
the faults a job must survive. One stack for the e2e tests, in any order.

Batches from ``long_batch`` finish request by request (each generates a fixed, growing
number of tokens), so a job can be cancelled, killed or timed out with some requests done.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import (
    FEW_SEQS,
    MODEL,
    RECURRING_REQUESTS,
    RECURRING_SPEC,
    hold_shards,
    long_batch,
    read_jsonl,
    release_shards,
    shard_held,
    shard_pids,
    wait_until,
)

pytestmark = [pytest.mark.e2e, pytest.mark.engine, pytest.mark.airflow]

# Generous bounds: engine start-up alone is ~20 s idle, far more on a loaded machine.
JOB_TIMEOUT = 420


def _job_ids(lines: list[dict[str, Any]]) -> list[str]:
    return [line["custom_id"] for line in lines]


def _content(client, file_id: str | None) -> list[dict[str, Any]]:
    assert file_id, "the job has no such file"
    return read_jsonl(b"".join(client.file_content(file_id)))


def _wait_for_progress(client, job_id: str) -> Any:
    job = wait_until(
        f"job {job_id} to finish its first request",
        lambda: (lambda j: j if j.completed > 0 or j.terminal else None)(client.job(job_id)),
        JOB_TIMEOUT,
        poll=0.5,
    )
    assert not job.terminal, f"job {job_id} ended ({job.status}) before it could be stopped mid-run"
    assert job.completed < job.total
    return job


def _status_or_none(client, job_id: str) -> str | None:
    from llm_batch.infra.api_client import ApiError

    try:
        return client.job(job_id).status
    except ApiError as exc:
        if exc.status == 404:
            return None
        raise


def _cli(env: dict[str, str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "llm_batch.cli.main", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def test_openai_sdk_job(e2e_stack, batch_client, job_logs, tmp_path):
    from openai import OpenAI

    batch = long_batch(tmp_path / "small.jsonl", 6, first_tokens=8, step=2)
    openai = OpenAI(api_key=e2e_stack.ensure_api_key(), base_url=f"{e2e_stack.base_url}/batch/v1", max_retries=2)
    uploaded = openai.files.create(file=batch.open("rb"), purpose="batch")
    created = openai.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    job_logs.append(created.id)
    done = wait_until(
        f"batch {created.id} to end",
        lambda: (lambda b: b if b.status in ("completed", "failed", "expired", "cancelled") else None)(
            openai.batches.retrieve(created.id)
        ),
        JOB_TIMEOUT,
    )
    assert done.status == "completed", done
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (6, 6, 0)
    results = read_jsonl(openai.files.content(done.output_file_id).content)
    assert _job_ids(results) == [f"req-{i:04d}" for i in range(6)]
    assert all(r["response"]["status_code"] == 200 and r["error"] is None for r in results)
    assert all(r["response"]["body"]["usage"]["completion_tokens"] == 8 + 2 * i for i, r in enumerate(results))


def test_recurring_spec_runs_on_its_schedule(e2e_stack, batch_client, job_logs):
    """The spec's DAG (paused, as new DAGs are) is unpaused; its next scheduled run starts a
    batch_inference run, which is an ordinary job that ends with outputs."""
    from llm_batch.core.run_conf import run_job_id

    headers = {"Authorization": f"Bearer {e2e_stack.airflow_token()}"}
    api = f"{e2e_stack.base_url}/api/v2/dags"
    recurring = f"recurring__{RECURRING_SPEC}"
    wait_until(f"{recurring} to unpause", lambda: httpx.patch(
        f"{api}/{recurring}", json={"is_paused": False}, headers=headers, timeout=30).status_code == 200, 60)

    def triggered_run() -> dict[str, Any] | None:
        runs = httpx.get(f"{api}/batch_inference/dagRuns", headers=headers, params={"limit": 100}, timeout=30)
        return next((r for r in runs.json()["dag_runs"]
                     if (r.get("conf") or {}).get("metadata", {}).get("recurring") == RECURRING_SPEC), None)

    try:
        run = wait_until(f"a batch_inference run started by {recurring}", triggered_run, 150, poll=2)
    finally:  # one scheduled run is the test: no more every minute (SQLite may be busy: retry)
        wait_until(f"{recurring} to pause", lambda: httpx.patch(
            f"{api}/{recurring}", json={"is_paused": True}, headers=headers, timeout=30).status_code == 200, 60)
    job_id = run_job_id(run["conf"], run["dag_run_id"])
    job_logs.append(job_id)
    wait_until(f"job {job_id} to exist", lambda: _status_or_none(batch_client, job_id), 120)
    job = batch_client.wait(job_id, timeout=JOB_TIMEOUT)
    assert (job.status, job.total, job.succeeded) == ("SUCCEEDED", RECURRING_REQUESTS, RECURRING_REQUESTS), job
    assert len(_content(batch_client, job.output_file)) == RECURRING_REQUESTS


def test_airflow_dag_run_survives_a_scheduler_restart(e2e_stack, batch_client, job_logs, tmp_path):
    """POST /api/v2/dags/batch_inference/dagRuns with a conf makes a job; the scheduler is
    stopped and started again while it runs, and the job still completes."""
    batch = long_batch(tmp_path / "airflow.jsonl", 30, first_tokens=8, step=1)
    file_id = batch_client.upload(batch)
    job_id = f"e2e_airflow_{uuid.uuid4().hex[:12]}"
    hold_shards(job_id, 2)  # the restart lands mid-shard by construction
    job_logs.append(job_id)
    conf = {"job_id": job_id, "input_file_ids": [file_id], "endpoint": "/v1/chat/completions", "model": MODEL,
            "owner": "admin"}
    response = httpx.post(
        f"{e2e_stack.base_url}/api/v2/dags/batch_inference/dagRuns",
        headers={"Authorization": f"Bearer {e2e_stack.airflow_token()}"},
        json={"logical_date": None, "conf": conf},
        timeout=30,
    )
    assert response.status_code in (200, 201), response.text
    # The run's register task creates the job: until then the API does not know it.
    wait_until(f"job {job_id} to run", lambda: _status_or_none(batch_client, job_id) == "RUNNING", JOB_TIMEOUT)

    # Stopped while the shard runs: its task is interrupted and must be retried.
    wait_until(f"shard 0 of {job_id} held", lambda: shard_held(job_id, 0, 2), JOB_TIMEOUT, poll=0.2)
    e2e_stack.stop_component("scheduler")
    time.sleep(3)
    e2e_stack.start_component("scheduler")
    release_shards(job_id)

    job = batch_client.wait(job_id, timeout=JOB_TIMEOUT)
    assert job.status == "SUCCEEDED", job
    assert (job.total, job.succeeded, job.failed) == (30, 30, 0)
    assert _job_ids(_content(batch_client, job.output_file)) == [f"req-{i:04d}" for i in range(30)]


def test_cancel_mid_run_keeps_partial_results(e2e_stack, batch_client, job_logs, tmp_path):
    batch = long_batch(tmp_path / "cancel.jsonl", 150, first_tokens=8, step=0)
    # The shard holds after its first 3 results (the worker's hold point): the cancel lands
    # mid-run by construction, whatever the machine's speed.
    job = batch_client.submit(batch, endpoint="/v1/chat/completions", model=MODEL,
                              model_config=FEW_SEQS)
    hold_shards(job.id, 3)
    job_logs.append(job.id)
    _wait_for_progress(batch_client, job.id)
    wait_until(f"shard 0 of {job.id} held", lambda: shard_held(job.id, 0, 3), JOB_TIMEOUT, poll=0.2)

    assert batch_client.cancel(job.id).status in ("CANCELLING", "CANCELLED")
    job = batch_client.wait(job.id, timeout=JOB_TIMEOUT)
    assert job.status == "CANCELLED", job
    outputs, errors = _content(batch_client, job.output_file), _content(batch_client, job.error_file)
    assert 0 < job.succeeded < job.total == 150
    assert job.succeeded + job.failed == job.total
    assert len(outputs) == job.succeeded and len(errors) == job.failed
    assert sorted(_job_ids(outputs) + _job_ids(errors)) == [f"req-{i:04d}" for i in range(150)]
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}


def test_killed_worker_is_retried_and_resumes(e2e_stack, cli_env, job_logs, tmp_path):
    """Two shards, few sequences at a time (``llm-batch submit --shards 2 --model-config
    '{"engine_args": {"max_num_seqs": 2}}'``), then the CLI: kill -9 the shards' workers
    mid-shard; the task retries, the worker resumes, and every request has one result."""
    from llm_batch.core.layout import JobLayout
    from llm_batch.infra.api_client import BatchClient
    from llm_batch.infra.results import count_results

    # Small: on the stack's warm engine both shards share one engine, two sequences at a time.
    batch = long_batch(tmp_path / "kill.jsonl", 16, first_tokens=8, step=1)
    with BatchClient.from_env(cli_env) as client:
        job_id = client.submit(batch, endpoint="/v1/chat/completions", model=MODEL, shards=2,
                               model_config=FEW_SEQS).id
        # Each shard's first attempt holds after 2 results (the worker's hold point): the
        # kill lands mid-shard by construction; the retries resume and are never held.
        hold_shards(job_id, 2)
        job_logs.append(job_id)
        shard = JobLayout(e2e_stack.settings.work_uri, job_id).shard(1)
        wait_until(f"shard 1 of {job_id} held", lambda: shard_held(job_id, 1, 2), JOB_TIMEOUT, poll=0.2)
        for pid in shard_pids(e2e_stack, job_id):
            os.killpg(pid, signal.SIGKILL)  # the worker or warm engine and the engine processes it spawned
        assert count_results(shard.results) < 8, "shard 1 ended before the kill"
        release_shards(job_id)  # shard 0, if it was not killed held

        waited = _cli(cli_env, "job", job_id, "--wait", timeout=JOB_TIMEOUT)
        assert waited.returncode == 0, waited.stdout + waited.stderr
        job = client.job(job_id)
    assert (job.status, job.total, job.succeeded, job.failed) == ("SUCCEEDED", 16, 16, 0)

    results = tmp_path / "results.jsonl"
    fetched = _cli(cli_env, "results", job_id, "-o", str(results))
    assert fetched.returncode == 0, fetched.stderr
    # Exactly one result per request, in input order, under the file's custom_ids.
    assert _job_ids(read_jsonl(results.read_bytes())) == [f"req-{i:04d}" for i in range(16)]
    listed = _cli(cli_env, "jobs", "--limit", "50")
    assert listed.returncode == 0, listed.stderr
    assert re.search(rf"^{job_id}\s+SUCCEEDED\s", listed.stdout, re.MULTILINE), listed.stdout
    tries = _shard_tries(e2e_stack, job_id)
    assert max(tries) >= 2, f"no shard task was retried: {tries}"


def _shard_tries(stack, job_id: str) -> list[int]:
    headers = {"Authorization": f"Bearer {stack.airflow_token()}"}
    runs = httpx.get(f"{stack.base_url}/api/v2/dags/batch_inference/dagRuns", headers=headers,
                     params={"limit": 100}, timeout=30).json()["dag_runs"]
    run_id = next(r["dag_run_id"] for r in runs if job_id in r["dag_run_id"] or (r.get("conf") or {}).get("job_id") == job_id)
    instances = httpx.get(f"{stack.base_url}/api/v2/dags/batch_inference/dagRuns/{run_id}/taskInstances",
                          headers=headers, params={"limit": 100}, timeout=30).json()["task_instances"]
    return [ti["try_number"] for ti in instances if ti["task_id"].startswith("run_shard") and ti["map_index"] >= 0]


def test_deadline_mid_run_times_out_with_partial_results(e2e_stack, batch_client, job_logs, tmp_path):
    # Request i generates 20 + i tokens: they finish one after another, so the shard's hold
    # point (after 3 results) stops it mid-run by construction whatever the engine's seats.
    batch = long_batch(tmp_path / "deadline.jsonl", 400, first_tokens=20, step=1)
    # One-line jobs first: the first loads the stack's warm engine if it is not, the second's
    # submit-to-end time is what the deadline job takes to its first results (validation,
    # planning, scheduling) on it.
    warm_up = long_batch(tmp_path / "warm-up.jsonl", 1, first_tokens=2, step=0)
    for _ in range(2):
        submitted = time.monotonic()
        ready = batch_client.submit(warm_up, endpoint="/v1/chat/completions", model=MODEL, new=True)
        job_logs.append(ready.id)
        assert batch_client.wait(ready.id, timeout=JOB_TIMEOUT).status == "SUCCEEDED"
    # Past the first results, with a margin for the machine's load; the shard then holds
    # until the deadline finds it.
    deadline = int(max(20.0, 2 * (time.monotonic() - submitted) + 10))
    print(f"deadline {deadline} s")
    job = batch_client.submit(batch, endpoint="/v1/chat/completions", model=MODEL, max_runtime_sec=deadline)
    hold_shards(job.id, 3)
    job_logs.append(job.id)
    job = batch_client.wait(job.id, timeout=deadline + JOB_TIMEOUT)
    assert job.status == "TIMEOUT_EXCEEDED", job
    outputs, errors = _content(batch_client, job.output_file), _content(batch_client, job.error_file)
    assert 0 < job.succeeded < job.total == 400, job
    assert job.succeeded + job.failed == job.total
    assert len(outputs) == job.succeeded and len(errors) == job.failed
    assert sorted(_job_ids(outputs) + _job_ids(errors)) == [f"req-{i:04d}" for i in range(400)]
