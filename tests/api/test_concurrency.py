"""200 submissions at once through the API: every one answered, each a distinct job with
its own DAG run, none lost or duplicated."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.api.conftest import dag_run_of

pytestmark = pytest.mark.airflow


def test_200_concurrent_submissions(live_server, creds, api_store):
    body = {
        "requests": [{"custom_id": "0", "body": {"messages": [{"role": "user", "content": "hi"}]}}],
        "endpoint": "/v1/chat/completions",
        "model": "tiny-random-llama",
        "metadata": {"wave": "concurrency"},
    }
    with httpx.Client(base_url=f"{live_server}/batch", headers=creds.key("bob"), timeout=120) as client:

        def submit(_: int) -> httpx.Response:
            return client.post("/v1/batch/jobs", json=body)

        with ThreadPoolExecutor(max_workers=20) as pool:
            responses = list(pool.map(submit, range(200)))

    assert [r.status_code for r in responses] == [200] * 200, {r.status_code: r.text for r in responses if r.status_code != 200}
    ids = [r.json()["id"] for r in responses]
    assert len(set(ids)) == 200
    jobs, total = api_store.list_jobs(owner="bob", metadata={"wave": "concurrency"}, limit=1000)
    assert total == 200 and {j.id for j in jobs} == set(ids)
    not_started = [j for j in jobs if j.dag_run_id is None or j.status.value == "FAILED"]
    assert not not_started, [(j.id, j.status, j.status_reason) for j in not_started[:3]]
    assert all(dag_run_of(job_id) is not None for job_id in ids[:20])
