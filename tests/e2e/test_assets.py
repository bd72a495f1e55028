"""Asset events on the real stack: a SUCCEEDED job's finalize emits one event on the fixed
asset ``llm-batch://results`` and one on its result file through the alias
``llm-batch-results`` (extra: job id, status, counts, labels, output URIs); the example
consumer DAG ``llm_batch_on_batch_done`` (scheduled on the fixed asset, paused at creation)
runs on it and sees each batch once; a consumer DAG added later gets no batch completed
before it. A CANCELLED job's run ends success (a cancel is not a failure of the pipeline)
and emits nothing."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.e2e.conftest import FEW_SEQS, MODEL, AirflowAPI, hold_shards, long_batch, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.engine, pytest.mark.airflow]

JOB_TIMEOUT = 420
CONSUMER = "llm_batch_on_batch_done"
RESULTS_ASSET = "llm-batch://results"


class Airflow(AirflowAPI):
    def asset_events(self, path: str, **params: Any) -> list[dict[str, Any]]:
        """Airflow 3.3.2 answers 500 for asset events while a run they created is queued (its
        start_date is still null: apache/airflow#71360, fixed after 3.3.2): asked again, for
        up to a minute, until that run starts."""
        def answered() -> tuple[list[dict[str, Any]]] | None:
            response = httpx.get(f"{self.api}{path}", headers=self.headers, params=params, timeout=30)
            if response.status_code == 500:
                return None
            assert response.status_code < 300, f"GET {path}: {response.status_code} {response.text[:500]}"
            return (response.json()["asset_events"],)
        return wait_until(f"GET {path} without a 500", answered, 60, poll=1)[0]

    def events_of(self, job_id: str) -> list[dict[str, Any]]:
        events = self.asset_events("/assets/events", limit=100, order_by="-timestamp")
        return [e for e in events if (e.get("extra") or {}).get("job_id") == job_id]


@pytest.fixture(scope="module")
def airflow(e2e_stack) -> Airflow:
    return Airflow(e2e_stack)


def _two(events: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """A succeeded job's two events (the fixed asset's and its result file's), once both are in."""
    return events if len(events) >= 2 else None


def _consumer_runs(airflow: Airflow) -> list[dict[str, Any]]:
    return airflow.call("GET", f"/dags/{CONSUMER}/dagRuns", params={"limit": 100})["dag_runs"]


def test_succeeded_job_emits_an_event_and_runs_the_consumer(e2e_stack, airflow, batch_client, job_logs, tmp_path):
    airflow.wait_parsed(CONSUMER)
    dag = airflow.call("GET", f"/dags/{CONSUMER}")
    assert dag["is_paused"], "the example consumer must start paused"
    airflow.call("PATCH", f"/dags/{CONSUMER}", json={"is_paused": False})
    runs_before = {r["dag_run_id"] for r in _consumer_runs(airflow)}

    batch = long_batch(tmp_path / "assets.jsonl", 5, first_tokens=8, step=2)
    job = batch_client.submit(batch, endpoint="/v1/chat/completions", model=MODEL)
    job_logs.append(job.id)
    job = batch_client.wait(job.id, timeout=JOB_TIMEOUT)
    assert (job.status, job.total, job.succeeded, job.failed) == ("SUCCEEDED", 5, 5, 0), job

    events = wait_until(f"the asset events of job {job.id}", lambda: _two(airflow.events_of(job.id)), 60, poll=2)
    # Airflow writes a URI without a path with a "/" (llm-batch://results/).
    by_uri = {event["uri"].rstrip("/"): event for event in events}
    fixed = by_uri.pop(RESULTS_ASSET)
    [(file_uri, on_file)] = by_uri.items()
    extra = fixed["extra"]
    assert extra["job_id"] == job.id
    assert extra["status"] == "SUCCEEDED"
    assert (extra["total"], extra["succeeded"], extra["failed"]) == (5, 5, 0)
    assert extra["output_uri"], extra
    assert on_file["extra"] == extra and file_uri.endswith(extra["output_uri"].split("://")[-1]), (file_uri, extra)
    for event in events:
        assert event["source_dag_id"] == "batch_inference" and event["source_task_id"] == "finalize"

    def new_consumer_run() -> dict[str, Any] | None:
        return next((r for r in _consumer_runs(airflow) if r["dag_run_id"] not in runs_before), None)

    run = wait_until(f"a run of {CONSUMER}", new_consumer_run, 120, poll=2)
    consumed = airflow.asset_events(f"/dags/{CONSUMER}/dagRuns/{run['dag_run_id']}/upstreamAssetEvents")
    assert job.id in {(e.get("extra") or {}).get("job_id") for e in consumed}, consumed

    def finished() -> str | None:
        state = airflow.call("GET", f"/dags/{CONSUMER}/dagRuns/{run['dag_run_id']}")["state"]
        return state if state in ("success", "failed") else None

    assert wait_until(f"{CONSUMER} run to finish", finished, 180, poll=2) == "success"
    # The consumer saw each batch once (Airflow lists an event under its asset and its alias:
    # reading every key would see each twice).
    entry = airflow.call("GET", f"/dags/{CONSUMER}/dagRuns/{run['dag_run_id']}/taskInstances/report_batches"
                                "/xcomEntries/return_value", params={"deserialize": True})
    seen = [batch["job_id"] for batch in entry["value"]]
    assert job.id in seen and len(seen) == len(set(seen)), seen


def test_a_new_consumer_gets_no_batch_completed_before_it(e2e_stack, airflow, batch_client, job_logs, tmp_path):
    """A consumer DAG added after batches have completed: its first run carries the batches
    completed since, not the earlier ones (a consumer of the alias would get every one)."""
    earlier = batch_client.submit(long_batch(tmp_path / "before.jsonl", 2, first_tokens=4, step=1),
                                  endpoint="/v1/chat/completions", model=MODEL)
    job_logs.append(earlier.id)
    assert batch_client.wait(earlier.id, timeout=JOB_TIMEOUT).status == "SUCCEEDED"
    wait_until(f"the events of job {earlier.id}", lambda: _two(airflow.events_of(earlier.id)), 60, poll=2)

    consumer = "e2e_new_results_consumer"
    (e2e_stack.settings.home / "dags" / f"{consumer}.py").write_text(
        "from datetime import datetime\n"
        "from airflow.sdk import DAG, Asset\n"
        "from airflow.providers.standard.operators.empty import EmptyOperator\n"
        f"with DAG({consumer!r}, schedule=Asset({RESULTS_ASSET!r}), start_date=datetime(2025, 1, 1),\n"
        "         catchup=False):\n"
        "    EmptyOperator(task_id='noop')\n")
    airflow.wait_parsed(consumer)
    airflow.call("PATCH", f"/dags/{consumer}", json={"is_paused": False})  # the stack's DAGs start paused
    later = batch_client.submit(long_batch(tmp_path / "after.jsonl", 2, first_tokens=4, step=1),
                                endpoint="/v1/chat/completions", model=MODEL, new=True)  # same lines, a new job
    job_logs.append(later.id)
    assert batch_client.wait(later.id, timeout=JOB_TIMEOUT).status == "SUCCEEDED"

    first_run = wait_until(f"a run of {consumer}", lambda: next(iter(
        airflow.call("GET", f"/dags/{consumer}/dagRuns", params={"limit": 1, "order_by": "run_after"})["dag_runs"]),
        None), 120, poll=2)
    consumed = [e for e in airflow.asset_events(f"/dags/{consumer}/dagRuns/{first_run['dag_run_id']}/upstreamAssetEvents")
                if e["uri"].rstrip("/") == RESULTS_ASSET]
    jobs = [(e.get("extra") or {}).get("job_id") for e in consumed]
    assert later.id in jobs and earlier.id not in jobs, jobs
    assert len(jobs) == len(set(jobs)), jobs


def test_cancelled_job_emits_no_event(e2e_stack, airflow, batch_client, job_logs, tmp_path):
    batch = long_batch(tmp_path / "cancelled.jsonl", 60, first_tokens=8, step=1)
    job = batch_client.submit(batch, endpoint="/v1/chat/completions", model=MODEL,
                              model_config=FEW_SEQS)
    hold_shards(job.id, 2)  # still running when the cancel comes, by construction
    job_logs.append(job.id)
    wait_until(f"job {job.id} to run", lambda: batch_client.job(job.id).status == "RUNNING", JOB_TIMEOUT)
    batch_client.cancel(job.id)
    job = batch_client.wait(job.id, timeout=JOB_TIMEOUT)
    assert job.status == "CANCELLED", job

    headers = airflow.headers
    runs = httpx.get(f"{airflow.api}/dags/batch_inference/dagRuns", headers=headers, params={"limit": 100},
                     timeout=30).json()["dag_runs"]
    run = next(r for r in runs if (r.get("conf") or {}).get("job_id") == job.id or job.id in r["dag_run_id"])

    def finalize_done() -> str | None:
        ti = airflow.call("GET", f"/dags/batch_inference/dagRuns/{run['dag_run_id']}/taskInstances/finalize")
        return ti["state"] if ti["state"] in ("success", "failed", "upstream_failed", "skipped") else None

    # A CANCELLED job's run is not a red failed run: finalize is skipped (the grid shows it
    # apart; partial results are served), the run ends success with a note saying CANCELLED,
    # and no results event.
    assert wait_until("finalize of the cancelled job", finalize_done, 120, poll=2) == "skipped"

    def run_ended() -> dict | None:
        found = airflow.call("GET", f"/dags/batch_inference/dagRuns/{run['dag_run_id']}")
        return found if found["state"] in ("success", "failed") and found.get("note") else None

    ended = wait_until("the cancelled job's run to end with its note", run_ended, 60, poll=2)
    assert ended["state"] == "success" and "CANCELLED" in ended["note"], ended
    assert airflow.events_of(job.id) == []
