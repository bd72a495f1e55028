"""A batch run is its job owner's in Airflow's own REST API too, on the real stack (with the
users a deployment names, LLM_BATCH_AIRFLOW_USERS): another user's PATCH of a running job's
run (state, note) and clear are refused 403 and the job runs on as it was; its owner annotates
it and marks it failed, which fails her job (the admin's way: test_run_job_agreement.py). What a
viewer reads of the run (its conf, prepare's XCom) carries ids and counts."""

from __future__ import annotations

import uuid

import httpx
import pytest

from tests.e2e.conftest import MODEL, hold_shards, shard_pids, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.engine, pytest.mark.airflow]

JOB_TIMEOUT = 420
DAG = "batch_inference"


def _job(batch: str, token: str, job_id: str) -> dict:
    answer = httpx.get(f"{batch}/v1/jobs/{job_id}", headers={"Authorization": f"Bearer {token}"}, timeout=30)
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_only_the_owner_ends_or_annotates_her_batch_run(e2e_stack, airflow, job_logs):
    from llm_batch.core.run_conf import api_run_id

    alice, bob = (e2e_stack.airflow_token(user) for user in ("alice", "bob"))
    as_alice, as_bob = ({"Authorization": f"Bearer {token}"} for token in (alice, bob))
    batch, api = f"{e2e_stack.base_url}/batch", f"{e2e_stack.base_url}/api/v2"
    job_id = f"e2e_owner_{uuid.uuid4().hex[:12]}"
    hold_shards(job_id, 1)  # still running while bob tries, by construction
    job_logs.append(job_id)
    # Lengths apart: r0 ends steps before the rest, so the hold after one result lands mid-shard
    # (requests ending in the same step would end the shard before the hold point is reached).
    requests = [{"custom_id": f"r{i}", "body": {"messages": [{"role": "user", "content": f"count {i}"}],
                                                "max_tokens": 4 + 4 * i, "ignore_eos": True}} for i in range(6)]
    made = httpx.post(f"{batch}/v1/jobs", headers=as_alice, timeout=30,
                      json={"id": job_id, "requests": requests, "model": MODEL, "labels": {"team": "alices"}})
    assert made.status_code == 200 and made.json()["owner"] == "alice", made.text
    wait_until(f"job {job_id} to run", lambda: _job(batch, alice, job_id)["status"] == "RUNNING", JOB_TIMEOUT)
    run = f"{api}/dags/{DAG}/dagRuns/{api_run_id(job_id)}"
    before = _job(batch, alice, job_id)

    for method, url, body in [("PATCH", run, {"state": "failed"}), ("PATCH", run, {"note": "bob's now"}),
                              ("POST", f"{api}/dags/{DAG}/clearTaskInstances",
                               {"dag_run_id": api_run_id(job_id), "dry_run": False, "only_failed": False})]:
        refused = httpx.request(method, url, headers=as_bob, json=body, timeout=30)
        assert refused.status_code == 403, (method, url, refused.text)
        assert "another user's batch job" in refused.json()["detail"], refused.text
    after = _job(batch, alice, job_id)
    assert (after["status"], after["status_reason"]) == (before["status"], before["status_reason"]), after
    seen = airflow.call("GET", f"/dags/{DAG}/dagRuns/{api_run_id(job_id)}")
    assert seen["state"] == "running" and "bob" not in (seen.get("note") or ""), seen

    # What every viewer reads of her run carries ids and counts: no labels or model config
    # in its conf, no work path in prepare's XCom.
    as_vic = {"Authorization": f"Bearer {e2e_stack.airflow_token('vic')}"}
    conf = httpx.get(run, headers=as_vic, timeout=30).json()["conf"]
    assert conf["job_id"] == job_id and not {"labels", "model_config", "input_uri", "output_uri"} & set(conf), conf
    # The job reads RUNNING from its run's start; prepare's XCom exists once prepare has ended.
    xcom = wait_until("prepare's XCom", lambda: (lambda r: r if r.status_code == 200 else None)(httpx.get(
        f"{run}/taskInstances/prepare/xcomEntries/return_value", headers=as_vic, timeout=30,
        params={"deserialize": True})), JOB_TIMEOUT)
    shards = xcom.json()["value"]
    assert shards == [{"job_id": job_id, "shard": 0, "requests": len(requests)}], shards

    noted = httpx.patch(run, headers=as_alice, json={"note": "alice's batch"}, timeout=30)
    assert noted.status_code == 200 and noted.json()["note"] == "alice's batch", noted.text
    ended = httpx.patch(run, headers=as_alice, json={"state": "failed"}, timeout=30)
    assert ended.status_code == 200, ended.text
    job = wait_until(f"job {job_id} to end", lambda: (lambda j: j if j["status"] == "FAILED" else None)(
        _job(batch, alice, job_id)), 60, 0.5)
    assert f"a user marked the DAG run {api_run_id(job_id)} failed" in job["status_reason"], job
    wait_until(f"the workers of {job_id} to stop", lambda: not shard_pids(e2e_stack, job_id), 60)
