"""Retry on the real embedded stack: a job cancelled mid-run with a line refused at
validation is retried through the CLI (``llm-batch retry JOB --wait``); the new job runs
only the never-run lines, in input order, and ends SUCCEEDED with those counts."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.e2e.conftest import FEW_SEQS, MODEL, hold_shards, long_batch, read_jsonl, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.engine, pytest.mark.airflow]

JOB_TIMEOUT = 420


def test_cli_retry_runs_only_the_never_run_lines(e2e_stack, cli_env, batch_client, job_logs, tmp_path):
    batch = long_batch(tmp_path / "retry.jsonl", 40, first_tokens=8, step=1)
    with batch.open("ab") as out:
        out.write(b"{not json\n")  # refused at validation: not retried
    job = batch_client.submit(batch, endpoint="/v1/chat/completions", model=MODEL,
                              model_config=FEW_SEQS)
    hold_shards(job.id, 2)  # cancelled mid-run by construction
    job_logs.append(job.id)
    wait_until(f"job {job.id} to finish a request",
               lambda: (lambda j: j if j.completed > 0 or j.terminal else None)(batch_client.job(job.id)),
               JOB_TIMEOUT, poll=0.5)
    batch_client.cancel(job.id)
    job = batch_client.wait(job.id, timeout=JOB_TIMEOUT)
    assert job.status == "CANCELLED", job
    errors = read_jsonl(b"".join(batch_client.file_content(job.error_file)))
    never_run = [e["custom_id"] for e in errors if e["error"]["code"] == "batch_cancelled"]
    assert never_run and len(errors) == len(never_run) + 1  # the bad line is the one other error

    retried = subprocess.run([sys.executable, "-m", "llm_batch.cli.main", "retry", job.id, "--wait"],
                             capture_output=True, text=True, timeout=JOB_TIMEOUT, env=cli_env)
    assert retried.returncode == 0, retried.stderr
    new_id = retried.stdout.split()[0]
    job_logs.append(new_id)
    new = batch_client.get_job(new_id)
    assert new["derived_from"] == {"job_id": job.id, "kind": "retry"}
    assert new["status"] == "SUCCEEDED"
    assert new["counts"] == {"total": len(never_run), "completed": len(never_run), "succeeded": len(never_run),
                             "failed": 0, "invalid_output": 0}
    outputs = read_jsonl(b"".join(batch_client.file_content(new["output_file_id"])))
    assert [o["custom_id"] for o in outputs] == never_run  # only those, in input order
