"""Fair, visible queues on the real stack: jobs made by the Trigger form, the batch API and a
recurring spec's schedule wait for the local pool's one slot in submission order, a higher
band jumps ahead of them, each shows its place while it waits, and a cancel of a job that
has not started ends it without it ever getting the slot. The Batch jobs page, in a real
browser, shows the same places.

The local pool is closed (0 slots, as an admin would through Airflow's pools API) while
the jobs are made, one after the other, so none can start and no engine competes with the
scheduler meanwhile; once every one of them shows a place, the pool opens again with its
slot and the shard tasks' start times (Airflow's task instances) say in which order they
got it.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest

from tests.e2e.conftest import MODEL, RECURRING_REQUESTS, RECURRING_SPEC, SHOTS, logged_in, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.engine, pytest.mark.airflow]

JOB_TIMEOUT = 900
CHAT = "/v1/chat/completions"


def _form_conf(tag: str) -> dict[str, Any]:
    """What Airflow's Trigger form sends for a small inline batch (dags/batch_inference.py PARAMS)."""
    return {"job_id": None, "input_uri": None, "input_file_ids": None, "input_format": "jsonl",
            "input_requests": [{"custom_id": f"form-{tag}", "body": {"messages": [{"role": "user", "content": "hi"}],
                                                                    "max_tokens": 4}}],
            "output_uri": None, "endpoint": CHAT, "model": MODEL, "model_config": {}, "data_parallelism": 1,
            "max_runtime_sec": 1800, "priority": None, "labels": {"queue-test": tag}}


def _native(batch_client, job_id: str) -> dict[str, Any] | None:
    try:
        return batch_client.get_job(job_id)
    except Exception:  # noqa: BLE001 (not registered yet)
        return None


def _shard_start(airflow, run_id: str) -> datetime | None:
    got = airflow.send("GET", f"/dags/batch_inference/dagRuns/{run_id}/taskInstances/run_shard/0")
    start = got.json().get("start_date") if got.status_code == 200 else None
    return datetime.fromisoformat(start) if start else None


def _set_slots(airflow, pool: dict[str, Any], slots: int) -> None:
    airflow.call("PATCH", f"/pools/{pool['name']}", json={
        "pool": pool["name"], "slots": slots, "description": pool.get("description"),
        "include_deferred": pool.get("include_deferred", False)})


@pytest.fixture
def closed_pool(e2e_stack, airflow) -> Iterator[dict[str, Any]]:
    """The local pool with no slot while the test runs; its slots given back however it ends."""
    pool = airflow.call("GET", f"/pools/{e2e_stack.settings.local_pool}")
    _set_slots(airflow, pool, 0)
    try:
        yield pool
    finally:
        _set_slots(airflow, pool, pool["slots"])


def test_jobs_start_by_band_then_submission_time_whichever_way_in(e2e_stack, batch_client, airflow, closed_pool,
                                                                   job_logs, browser_context):
    from llm_batch.core.run_conf import run_job_id

    tag = uuid.uuid4().hex[:8]

    def create(**extra: Any) -> str:
        return batch_client.create_job({"model": MODEL, "endpoint": CHAT, "labels": {"queue-test": tag}, **extra,
                                        "requests": [{"custom_id": "one", "body": {
                                            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}}]})["id"]

    # 1. The Trigger form (its run's logical date is the time it was triggered).
    form_run = f"manual__queue_{tag}"
    sent = airflow.send("POST", "/dags/batch_inference/dagRuns", json={
        "dag_run_id": form_run, "logical_date": datetime.now(UTC).isoformat(), "conf": _form_conf(tag)})
    assert sent.status_code < 300, sent.text
    form = run_job_id({}, form_run)
    wait_until("the form's job", lambda: _native(batch_client, form), 120)
    time.sleep(1)
    # 2. The batch API.
    api = create()
    time.sleep(1)
    # 3. A recurring spec's schedule: its DAG unpaused makes one run now (catchup off), whose
    #    TriggerDagRunOperator starts a batch_inference run; paused again at once.
    recurring = f"recurring__{RECURRING_SPEC}"
    airflow.call("PATCH", f"/dags/{recurring}", json={"is_paused": False})

    def scheduled() -> str | None:
        runs = airflow.call("GET", "/dags/batch_inference/dagRuns", params={"limit": 100, "order_by": "-run_after"})
        for run in runs["dag_runs"]:
            conf = run.get("conf") or {}
            if conf.get("metadata", {}).get("recurring") == RECURRING_SPEC and run["state"] in ("queued", "running"):
                return run_job_id(conf, run["dag_run_id"])
        return None

    try:
        spec = wait_until("the schedule's job", scheduled, 180, poll=2)
    finally:
        airflow.call("PATCH", f"/dags/{recurring}", json={"is_paused": True})
    wait_until("the schedule's job registered", lambda: _native(batch_client, spec), 120)
    time.sleep(1)
    # 4. A higher band, submitted last; 5. one more, cancelled while it waits.
    high = create(priority="high")
    time.sleep(1)
    dropped = create()
    job_logs.extend([form, api, spec, high, dropped])
    order = [high, form, api, spec, dropped]

    # Every waiting job shows its place: band first, then submission time, whichever way in.
    seen: list[Any] = []

    def places() -> list[int] | None:
        jobs = [_native(batch_client, j) or {} for j in order]
        seen[:] = [(j.get("id"), j.get("status"), j.get("queue")) for j in jobs]
        queues = [j.get("queue") for j in jobs]
        if not all(q and q["pool"] for q in queues):
            return None
        return [q["position"] for q in queues]

    try:
        positions = wait_until("every job to wait in the pool", places, 300, poll=2)
    except AssertionError:
        print("last seen (id, status, queue):", seen)
        raise
    # In this order; a job someone else made meanwhile (the spec's next minute) may stand
    # between two of them, never before one made earlier.
    assert positions[0] == 1 and positions == sorted(positions) and len(set(positions)) == 5, positions
    place = _native(batch_client, api)["queue"]
    name = closed_pool["name"]
    assert place["pool"] == name and place["waiting_for"] == f"a slot of pool {name} (0 of 0 in use)", place
    assert batch_client.job(api).shown_status == f"WAITING #{positions[2]} in queue"

    # The Batch jobs page in a browser says the same: each row WAITING with its place, in order.
    page = logged_in(browser_context, e2e_stack.base_url, json.loads(e2e_stack.passwords_file.read_text())["admin"])
    page.goto(f"{e2e_stack.base_url}/batch/ui/jobs", wait_until="domcontentloaded")

    def shown_places() -> list[int] | None:  # one read of the rows (the page re-renders them every 2 s)
        rows = page.eval_on_selector_all("tr.job", """rows => Object.fromEntries(rows.map(r => [r.dataset.id,
            [r.querySelector('.status')?.textContent, r.querySelector('.queue')?.textContent]]))""")
        shown = [rows.get(j) or [None, None] for j in order]
        if not all(word == "WAITING" and place for word, place in shown):
            return None
        return [int(re.fullmatch(r" #(\d+) in queue", place).group(1)) for _, place in shown]

    on_page = wait_until("the page to show every place", shown_places, 60, poll=0.5)
    assert on_page[0] == 1 and on_page == sorted(on_page) and len(set(on_page)) == 5, on_page
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / "jobs-waiting.png"))

    # A cancel of a job that has not started: it ends without ever getting the slot (its
    # shard task skipped), its line accounted for as never run.
    batch_client.cancel(dropped)
    cancelled_at = time.monotonic()
    ended = batch_client.wait(dropped, timeout=JOB_TIMEOUT)
    took = time.monotonic() - cancelled_at
    assert ended.status == "CANCELLED" and (ended.total, ended.failed, ended.succeeded) == (1, 1, 0), ended
    assert not any(_shard_start(airflow, _native(batch_client, j)["dag_run_id"]) for j in order[:4])  # pool shut
    assert took < 120, f"the cancel of a waiting job took {took:.0f} s"
    dropped_run = _native(batch_client, dropped)["dag_run_id"]
    assert _shard_start(airflow, dropped_run) is None or airflow.call(
        "GET", f"/dags/batch_inference/dagRuns/{dropped_run}/taskInstances/run_shard/0")["state"] == "skipped"

    # One slot: the jobs start one after another, so their start times show the order (two
    # slots start two tasks in one scheduler loop, in whichever order their processes come up).
    _set_slots(airflow, closed_pool, 1)
    done = {j: batch_client.wait(j, timeout=JOB_TIMEOUT) for j in order[:4]}
    assert all(d.status == "SUCCEEDED" for d in done.values()), done
    assert done[spec].total == RECURRING_REQUESTS
    starts = [_shard_start(airflow, _native(batch_client, j)["dag_run_id"]) for j in order[:4]]
    assert all(starts), starts
    assert starts == sorted(starts), list(zip(["high", "form", "api", "schedule"], starts, strict=True))
    print("cancel of a waiting job ended it in", round(took, 1), "s; shard starts:", starts)
