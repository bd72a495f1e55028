"""The hostile probe's scheduler stop, on the real stack: what Python's JSON parser admits and
Airflow cannot serialise, sent to the batch API and to Airflow's own REST API, is refused at
the edge; the scheduler keeps its pid, every user can still list runs, and a job submitted
afterwards runs to its end."""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.conftest import MODEL, long_batch, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.engine, pytest.mark.airflow]

SURROGATE_MODEL_CONFIG = (
    '{"model": "%s", "endpoint": "/v1/chat/completions", "requests": [{"custom_id": "a", "body": {"messages": '
    '[{"role": "user", "content": "hi"}]}}], "model_config": {"labels": {"x": "\\ud800"}}}' % MODEL
)
SURROGATE_CONF = '{"logical_date": null, "conf": {"model": "%s", "model_config": {"x": "\\ud800"}}}' % MODEL


def test_what_stopped_the_scheduler_is_refused_and_the_stack_keeps_working(e2e_stack, airflow, batch_client,
                                                                          job_logs, tmp_path):
    scheduler = e2e_stack.running()["scheduler"]
    key = {"Authorization": f"Bearer {e2e_stack.ensure_api_key()}", "content-type": "application/json"}
    batch = httpx.post(f"{e2e_stack.base_url}/batch/v1/jobs", headers=key, content=SURROGATE_MODEL_CONFIG, timeout=30)
    assert batch.status_code == 400 and "lone surrogate" in batch.text, batch.text
    run = httpx.post(f"{e2e_stack.base_url}/api/v2/dags/batch_inference/dagRuns",
                     headers={**airflow.headers, "content-type": "application/json"}, content=SURROGATE_CONF, timeout=30)
    assert run.status_code == 400 and "lone surrogate" in run.text, run.text

    assert airflow.send("GET", "/dags/~/dagRuns").status_code == 200
    job = batch_client.submit(long_batch(tmp_path / "after.jsonl", 2, first_tokens=4, step=1),
                              endpoint="/v1/chat/completions", model=MODEL).id
    job_logs.append(job)
    done = wait_until(f"job {job} to end", lambda: (lambda j: j if j.terminal else None)(batch_client.job(job)), 420)
    assert (done.status, done.succeeded, done.failed) == ("SUCCEEDED", 2, 0)
    assert e2e_stack.running()["scheduler"] == scheduler, "the scheduler was restarted: it had stopped"
