"""The stack's supervisor on the real stack: a killed scheduler comes back by itself.

Uses the session's stack (tests/e2e/conftest.py). The scheduler's leader is killed with
SIGKILL, which leaves its children (``serve-logs`` on the log-server port, the LocalExecutor
workers) in its process group: the supervisor must clear those, start a new scheduler on the
same ports within seconds, leave the other three components untouched and record the
restart; a job submitted afterwards completes, and ``up`` then finds nothing to do.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import datetime
from typing import TYPE_CHECKING

import pytest

from llm_batch.devstack.stack import COMPONENTS
from llm_batch.devstack.supervisor import read_restarts
from llm_batch.infra.processes import group_members
from tests.e2e.conftest import MODEL, long_batch, stack_logs, wait_until

if TYPE_CHECKING:
    import httpx

pytestmark = [pytest.mark.e2e, pytest.mark.airflow, pytest.mark.engine]

# The supervisor looks every second and starts a component that ran a minute at once (one
# that dies younger waits 1 s, then 2, 4 ...).
RESTART_BOUND_S = 30


def test_a_killed_scheduler_is_started_again_by_the_supervisor(e2e_stack, cli_env, batch_client, job_logs,
                                                               tmp_path):
    before = e2e_stack.running()
    assert all(before.values()) and e2e_stack.supervisor_pid(), before
    restarts = read_restarts(e2e_stack).get("scheduler", {}).get("restarts", 0)
    old = before["scheduler"]
    killed_at = datetime.now().astimezone()
    started = time.monotonic()
    os.kill(old, signal.SIGKILL)  # the leader only, as a crash would
    try:
        after = wait_until("the supervisor to start the scheduler again",
                           lambda: (s := e2e_stack.running())["scheduler"] not in (None, old) and s,
                           RESTART_BOUND_S, poll=0.1)
    except AssertionError:
        print(stack_logs(e2e_stack))
        raise
    print(f"the killed scheduler was started again after {time.monotonic() - started:.1f} s")

    assert {c: pid for c, pid in after.items() if c != "scheduler"} == {c: pid for c, pid in before.items() if c != "scheduler"}
    assert group_members(old) == []  # the dead scheduler's leftovers are gone
    record = read_restarts(e2e_stack)["scheduler"]
    assert (record["restarts"], record["reason"]) == (restarts + 1, "killed by SIGKILL")

    def fresh_heartbeat():
        beat = (e2e_stack.monitor_health().get("scheduler") or {}).get("latest_scheduler_heartbeat")
        return beat and datetime.fromisoformat(beat) > killed_at

    wait_until("the new scheduler to heartbeat", fresh_heartbeat, 120)
    status = subprocess.run([sys.executable, "-m", "llm_batch.cli.main", "status"], capture_output=True, text=True,
                            timeout=60, env=cli_env)
    assert status.returncode == 0, status.stdout + status.stderr
    line = next(line for line in status.stdout.splitlines() if line.startswith("scheduler "))
    assert f"running (pid {after['scheduler']})" in line and f"{restarts + 1} restart" in line, line
    assert line.endswith(": killed by SIGKILL"), line

    # The new scheduler runs jobs.
    job = batch_client.submit(long_batch(tmp_path / "after-restart.jsonl", 4, first_tokens=8, step=2),
                              endpoint="/v1/chat/completions", model=MODEL)
    job_logs.append(job.id)
    job = batch_client.wait(job.id, timeout=420)
    assert (job.status, job.total, job.succeeded) == ("SUCCEEDED", 4, 4), job

    result = e2e_stack.up(timeout=180)  # nothing left to do
    assert (result.started, result.restarted, result.already_running) == ((), (), COMPONENTS)
    assert e2e_stack.running() == after


def test_the_users_dags_and_specs_under_home_become_dags(e2e_stack, airflow):
    """A DAG file dropped into $LLM_BATCH_HOME/dags (the second DAG bundle) and a spec into
    $LLM_BATCH_HOME/recurring appear in Airflow's /api/v2/dags, beside the repo's DAGs."""
    import yaml  # optional

    from tests.fixtures.airflow import DAGS_FOLDER

    home = e2e_stack.settings.home
    (home / "dags" / "e2e_user_dag.py").write_text(
        "from airflow.sdk import DAG\nfrom airflow.providers.standard.operators.empty import EmptyOperator\n"
        "with DAG('e2e_user_dag', schedule=None):\n    EmptyOperator(task_id='noop')\n")
    spec = yaml.safe_load((DAGS_FOLDER / "recurring_specs" / "example.yaml").read_text())
    (home / "recurring" / "e2e_mine.yaml").write_text(yaml.safe_dump({**spec, "name": "e2e_mine"}))
    airflow.wait_parsed("e2e_user_dag")
    airflow.wait_parsed("recurring__e2e_mine")
    assert airflow.call("GET", "/dags/e2e_user_dag")["bundle_name"] == "user-dags"
    assert airflow.call("GET", "/dags/batch_inference")["bundle_name"] == "dags-folder"


def test_form_triggers_and_api_creates_at_once_get_no_server_error(e2e_stack, batch_client, job_logs):
    """The form's Trigger (/api/v2 with the form's conf) and the batch API's create, eight of
    each at once, no client retries: every answer is 2xx in time and none says "database is
    locked" (Airflow on SQLite answered the form 500 after 60 s under such load). Every job of
    one line is cancelled once it exists (a form run's at register), so little engine runs."""
    import uuid
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    assert e2e_stack.database == "postgres", "the embedded stack's default database"
    n, tag = 8, uuid.uuid4().hex[:8]
    airflow_headers = {"Authorization": f"Bearer {e2e_stack.airflow_token()}"}
    api_headers = {"Authorization": f"Bearer {e2e_stack.ensure_api_key()}"}
    line = {"body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}}

    def trigger(i: int) -> tuple[httpx.Response, float]:
        conf = {"job_id": f"form-{tag}-{i}", "input_requests": [line], "model": MODEL, "labels": {"e2e": tag}}
        return timed(lambda: httpx.post(f"{e2e_stack.base_url}/api/v2/dags/batch_inference/dagRuns", timeout=90,
                                        headers=airflow_headers, json={"logical_date": None, "conf": conf}))

    def create(i: int) -> tuple[httpx.Response, float]:
        body = {"model": MODEL, "endpoint": "/v1/chat/completions", "requests": [line], "labels": {"e2e": tag}}
        return timed(lambda: httpx.post(f"{e2e_stack.base_url}/batch/v1/jobs", timeout=90, headers=api_headers,
                                        json=body))

    with ThreadPoolExecutor(2 * n) as pool:
        triggers = [pool.submit(trigger, i) for i in range(n)]
        creates = [pool.submit(create, i) for i in range(n)]
        answers = [f.result() for f in (*triggers, *creates)]
    made = [response.json()["id"] for response, _ in answers[n:] if response.status_code < 300]
    job_logs.extend(made)
    for job_id in made:
        batch_client.cancel(job_id)
    for response, took in answers:
        assert response.status_code < 300, f"{response.request.url}: {response.status_code} {response.text[:500]}"
        assert "database is locked" not in response.text
        assert took < 30, f"{response.request.url} answered after {took:.1f} s"
    form_jobs = [f"form-{tag}-{i}" for i in range(n)]
    job_logs.extend(form_jobs)
    for job_id in form_jobs:  # each is made when its run registers
        wait_until(f"job {job_id}", lambda: batch_client.list_jobs(q=job_id)["data"], 180, poll=1)
        batch_client.cancel(job_id)
    wait_until("every job ended", lambda: all(batch_client.job(j).terminal for j in (*made, *form_jobs)), 180, poll=2)
    assert {batch_client.job(j).status for j in made} == {"CANCELLED"}
    # A form job may have finished its one line before its cancel came.
    assert {batch_client.job(j).status for j in form_jobs} <= {"CANCELLED", "SUCCEEDED"}


def timed(send) -> tuple[httpx.Response, float]:
    started = time.monotonic()
    response = send()
    return response, time.monotonic() - started
