"""The batch step in users' DAGs on the real stack: the example DAGs (dags/examples/) run
@task.llm_batch / LLMBatchOperator through the connection `llm_batch_default` that `up`
made. Structure, counts and order only (never model text): the downstream task sees N
results in input order; clearing the finished step re-attaches (same job, one job); a bad
model fails the step with the API's message and creates no job; mapping makes one job per
input file."""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import orjson
import pytest

from llm_batch.airflow.operators.batch_step import step_job_id
from tests.e2e.conftest import MODEL, AirflowAPI, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.airflow]

TIMEOUT = 420
PROMPTS_DAG, MAPPED_DAG = "llm_batch_example_prompts", "llm_batch_example_mapped"


class Airflow(AirflowAPI):
    def trigger(self, dag_id: str, conf: dict[str, Any]) -> str:
        self.wait_parsed(dag_id)
        self.call("PATCH", f"/dags/{dag_id}", json={"is_paused": False})
        return super().trigger(dag_id, conf)

    def finished(self, dag_id: str, run_id: str) -> str:
        def state() -> str | None:
            current = self.call("GET", f"/dags/{dag_id}/dagRuns/{run_id}")["state"]
            return current if current in ("success", "failed") else None

        return wait_until(f"{dag_id} run {run_id} to finish", state, TIMEOUT, poll=2)

    def task(self, dag_id: str, run_id: str, task_id: str, map_index: int = -1) -> dict[str, Any]:
        suffix = f"/{map_index}" if map_index >= 0 else ""
        return self.call("GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}{suffix}")

    def xcom(self, dag_id: str, run_id: str, task_id: str, key: str = "return_value") -> Any:
        entry = self.call("GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/xcomEntries/{key}",
                          params={"deserialize": True})
        value = entry["value"]
        return orjson.loads(value) if isinstance(value, str) and value[:1] in "[{" else value


@pytest.fixture(scope="module")
def airflow(e2e_stack) -> Airflow:
    return Airflow(e2e_stack)


def _native_job(batch_client, job_id: str) -> httpx.Response:
    return batch_client._http.get(f"/v1/jobs/{job_id}")


def test_prompts_step_results_in_order_and_a_cleared_step_reattaches(e2e_stack, airflow, batch_client, job_logs):
    count = 5
    run_id = airflow.trigger(PROMPTS_DAG, {"count": count, "model": MODEL})
    assert airflow.finished(PROMPTS_DAG, run_id) == "success", airflow.task(PROMPTS_DAG, run_id, "generate")
    job_id = step_job_id(PROMPTS_DAG, run_id, "generate", -1, e2e_stack.ensure_api_key())  # the connection's key
    job_logs.append(job_id)
    manifest = airflow.xcom(PROMPTS_DAG, run_id, "generate")
    assert manifest["job_id"] == job_id and manifest["status"] == "SUCCEEDED"
    assert (manifest["request_count"], manifest["succeeded"], manifest["errored"], manifest["missing"]) == (count, count, 0, 0)
    seen = airflow.xcom(PROMPTS_DAG, run_id, "read_results")
    assert seen == {"job_id": job_id, "count": count, "custom_ids": [str(i) for i in range(count)]}

    # Clear the step and its downstream: the new try re-attaches to the same, ended job.
    airflow.call("POST", f"/dags/{PROMPTS_DAG}/clearTaskInstances", json={
        "dry_run": False, "dag_run_id": run_id, "task_ids": ["generate", "read_results"], "only_failed": False,
        "reset_dag_runs": True})
    wait_until("the cleared try", lambda: airflow.task(PROMPTS_DAG, run_id, "generate")["try_number"] >= 2, 120)
    assert airflow.finished(PROMPTS_DAG, run_id) == "success"
    assert airflow.xcom(PROMPTS_DAG, run_id, "generate")["job_id"] == job_id
    listed = batch_client._http.get("/v1/jobs", params={"label": f"llm-batch.io/dag-id={PROMPTS_DAG}", "limit": 1000}).json()
    assert [j["id"] for j in listed["data"]].count(job_id) == 1
    assert _native_job(batch_client, job_id).json()["dag_run_id"] == manifest["dag_run_id"]


def test_bad_model_fails_the_step_and_creates_no_job(e2e_stack, airflow, batch_client):
    run_id = airflow.trigger(PROMPTS_DAG, {"count": 2, "model": "no-such-model"})
    assert airflow.finished(PROMPTS_DAG, run_id) == "failed"
    step = airflow.task(PROMPTS_DAG, run_id, "generate")
    assert step["state"] == "failed" and step["try_number"] == 1  # a refusal is not retried
    assert _native_job(batch_client, step_job_id(PROMPTS_DAG, run_id, "generate", -1,
                                                 e2e_stack.ensure_api_key())).status_code == 404


def test_mapped_step_makes_one_job_per_file(e2e_stack, airflow, batch_client, job_logs, llm_batch_home):
    folder = llm_batch_home / "data" / f"e2e-mapped-{uuid.uuid4().hex[:8]}"
    folder.mkdir(parents=True)
    sizes = [2, 3]
    uris = []
    for n, size in enumerate(sizes):
        path = folder / f"in-{n}.jsonl"
        path.write_bytes(b"".join(orjson.dumps({"custom_id": f"f{n}-{i}", "body": {
            "messages": [{"role": "user", "content": f"say {i}"}], "max_tokens": 4}}) + b"\n" for i in range(size)))
        uris.append(str(path))
    run_id = airflow.trigger(MAPPED_DAG, {"input_uris": uris, "model": MODEL})
    assert airflow.finished(MAPPED_DAG, run_id) == "success"
    summary = airflow.xcom(MAPPED_DAG, run_id, "summarize")
    ids = [step_job_id(MAPPED_DAG, run_id, "batch", i, e2e_stack.ensure_api_key()) for i in range(len(sizes))]
    job_logs.extend(ids)
    assert [s["job_id"] for s in summary] == ids and [s["succeeded"] for s in summary] == sizes
    assert all(s["status"] == "SUCCEEDED" for s in summary)
