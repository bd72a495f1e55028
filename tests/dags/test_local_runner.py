"""LocalShardOperator's supervision with a stand-in worker program (seconds, no engine):
cancel mirrored to the marker, a worker that ignores it killed after the grace, exit codes
read, on_kill terminating the worker. The real worker runs in test_batch_inference.py."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from llm_batch.core.config import get_settings
from llm_batch.infra import storage
from llm_batch.infra.jobstore import get_job_store
from llm_batch.pipeline.shard_task import ShardTask

pytestmark = [pytest.mark.airflow]

# Stand-in worker: `fake.py MODE worker --job-id ... --cancel-marker URI ...`; MODE its behaviour.
FAKE_WORKER = """
import os, signal, sys, time
mode, args = sys.argv[1], sys.argv[2:]
marker = args[args.index("--cancel-marker") + 1]
if mode == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("fake worker started", flush=True)
if mode.startswith("exit"):
    sys.exit(int(mode[4:]))
while True:
    if mode == "obedient" and os.path.exists(marker):
        print("cancel marker seen", flush=True)
        sys.exit(3)
    time.sleep(0.2)
"""


@pytest.fixture
def operator_for(tmp_path):
    from llm_batch.airflow.operators.local import LocalShardOperator

    script = tmp_path / "fake_worker.py"
    script.write_text(FAKE_WORKER)
    # A worker of its own (the fake), not a warm engine; killed 1 s after a cancel it ignores.
    settings = get_settings().model_copy(update={"warm_engines": False, "cancel_grace_seconds": 1})
    store = get_job_store(settings.database_url)

    def make(job_id: str, mode: str):
        if store.get_job(job_id) is None:
            store.create_job(id=job_id, dialect="airflow", endpoint="/v1/chat/completions", model="m",
                             owner="t", max_runtime_sec=3600)
        root = f"{settings.work_uri}/{job_id}"
        shard = ShardTask(
            job_id=job_id, shard=0, requests_uri=f"{root}/r.jsonl", results_uri=f"{root}/results",
            progress_uri=f"{root}/progress.json", cancel_marker=f"{root}/cancel",
            endpoint="/v1/chat/completions", model_config_json="{}", deadline="2099-01-01T00:00:00+00:00",
        )
        operator = LocalShardOperator(task_id="run_shard", shard_task=shard.model_dump())
        operator.llm_settings = settings
        operator.worker_command = (sys.executable, str(script), mode)
        operator.term_seconds = 1.0
        return store, shard, operator

    return make


def _cancel_soon(store, job_id: str, after: float = 1.0) -> threading.Thread:
    def cancel() -> None:
        time.sleep(after)
        store.request_cancel(job_id, reason="test")

    thread = threading.Thread(target=cancel, daemon=True)
    thread.start()
    return thread


def test_cancel_flag_reaches_the_worker_through_the_marker(operator_for):
    store, shard, operator = operator_for("job_local_obedient", "obedient")
    _cancel_soon(store, shard.job_id)
    outcome = operator.execute({})
    assert (outcome["state"], outcome["exit_code"]) == ("cancelled", 3)
    assert storage.exists(shard.cancel_marker)


def test_worker_ignoring_cancel_is_killed_after_the_grace(operator_for):
    store, shard, operator = operator_for("job_local_stubborn", "stubborn")
    _cancel_soon(store, shard.job_id)
    started = time.monotonic()
    outcome = operator.execute({})
    assert outcome["state"] == "cancelled" and outcome["message"].startswith("killed")
    assert time.monotonic() - started < 30
    assert operator._process.poll() is not None


@pytest.mark.parametrize(("mode", "error"), [("exit1", "AirflowException"), ("exit2", "AirflowFailException")])
def test_worker_failures_raise(operator_for, mode, error):
    _, _, operator = operator_for(f"job_local_{mode}", mode)
    with pytest.raises(Exception) as raised:
        operator.execute({})
    assert type(raised.value).__name__ == error


def test_on_kill_terminates_the_worker(operator_for):
    _, _, operator = operator_for("job_local_kill", "stubborn")
    runner = threading.Thread(target=lambda: _ignore_errors(operator.execute, {}), daemon=True)
    runner.start()
    deadline = time.monotonic() + 30
    while operator._process is None and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)
    operator.on_kill()
    assert operator._process.wait(timeout=10) is not None
    runner.join(timeout=30)


def _ignore_errors(func, *args) -> None:
    try:
        func(*args)
    except Exception:  # noqa: BLE001 - the killed task's own error is not under test
        pass


def test_a_failed_worker_says_why_in_the_outcome(operator_for):
    store, shard, operator = operator_for("job_local_why", "exit1")
    operator.worker_command = (sys.executable, "-c",
                               "import sys; print('INFO starting'); "
                               "print(\"ERROR llm_batch.runtime.worker: model 'gpt-4o-mini' is not in the registry\"); sys.exit(1)")
    with pytest.raises(Exception, match="model 'gpt-4o-mini' is not in the registry"):
        operator.execute({})
    [record] = [r for r in store.shard_records(shard.job_id) if r.shard == 0]
    assert "model 'gpt-4o-mini' is not in the registry" in record.reason and len(record.reason) < 1000


def test_a_cleared_shard_of_an_ended_job_starts_no_worker(operator_for):
    from llm_batch.core.jobs import JobStatus

    store, shard, operator = operator_for("job_local_ended", "obedient")
    store.end_job(shard.job_id, JobStatus.SUCCEEDED, "done before")
    outcome = operator.execute({})
    assert outcome["state"] == "ended" and "already ended (SUCCEEDED)" in outcome["message"]
    assert operator._process is None  # no worker started
    assert store.get_job(shard.job_id).status_reason == "done before"


def test_user_marking_the_run_ends_its_job_with_that_reason(operator_for):
    from types import SimpleNamespace

    from llm_batch.api import listeners
    from llm_batch.core.jobs import JobStatus

    store, shard, _ = operator_for("job_marked_failed", "obedient")
    run = SimpleNamespace(dag_id="batch_inference", run_id="manual__marked", conf={"job_id": shard.job_id})
    listeners.on_dag_run_failed(dag_run=run, msg="Dag Run's state was manually set to `failed`.")
    job = store.get_job(shard.job_id)
    assert job.status == JobStatus.FAILED and "a user marked the DAG run manual__marked failed" in job.status_reason
    assert storage.exists(shard.cancel_marker)  # any worker left behind stops
    store2, shard2, _ = operator_for("job_marked_success", "obedient")
    run2 = SimpleNamespace(dag_id="batch_inference", run_id="manual__ok", conf={"job_id": shard2.job_id})
    listeners.on_dag_run_success(dag_run=run2, msg="Dag Run's state was manually set to `success`.")
    job2 = store2.get_job(shard2.job_id)
    assert job2.status == JobStatus.CANCELLED and "marked the DAG run manual__ok success" in job2.status_reason
    assert "CANCELLED" in listeners.run_note(job2) and "/batch/ui/jobs#job=job_marked_success" in listeners.run_note(job2)


def test_a_run_a_user_marked_failed_stays_failed_when_the_scheduler_ends_it_success(operator_for):
    """SQLite has no row locks: the scheduler may end success a run whose failed mark it
    did not see yet. The job kept the user's mark, and the run goes back to failed."""
    from types import SimpleNamespace

    from airflow.utils.state import DagRunState

    from llm_batch.api import listeners
    from llm_batch.core.jobs import JobStatus

    states = []
    store, shard, _ = operator_for("job_marked_then_success", "obedient")
    run = SimpleNamespace(dag_id="batch_inference", run_id="manual__raced", conf={"job_id": shard.job_id},
                          set_state=states.append)
    listeners.on_dag_run_failed(dag_run=run, msg="Dag Run's state was manually set to `failed`.")
    listeners.on_dag_run_success(dag_run=run, msg="success")  # the scheduler, a moment later
    assert states == [DagRunState.FAILED]
    job = store.get_job(shard.job_id)
    assert job.status == JobStatus.FAILED and "a user marked the DAG run manual__raced failed" in job.status_reason
    # A user marking it success afterwards is their choice; a run that ended by itself is not touched.
    listeners.on_dag_run_success(dag_run=run, msg="Dag Run's state was manually set to `success`.")
    other = SimpleNamespace(dag_id="batch_inference", run_id="manual__other", conf={"job_id": shard.job_id},
                            set_state=states.append)
    listeners.on_dag_run_success(dag_run=other, msg="success")
    assert states == [DagRunState.FAILED]


def test_a_shard_starting_while_the_store_restarts_waits_for_it(operator_for, monkeypatch):
    """The store refusing connections at the task's start (a PostgreSQL restart) is asked
    again (src/llm_batch/airflow/operators/shard.py STORE_WAIT_S) instead of failing the try."""
    from sqlalchemy.exc import OperationalError

    store, shard, operator = operator_for("job_local_store_restart", "exit0")
    real, calls = store.get_job, []

    def restarting(job_id, *args, **kwargs):
        calls.append(job_id)
        if len(calls) <= 2:
            raise OperationalError("SELECT", {}, Exception("the database system is shutting down"))
        return real(job_id, *args, **kwargs)

    monkeypatch.setattr(store, "get_job", restarting)
    monkeypatch.setattr("llm_batch.airflow.operators.shard.STORE_RETRY_S", 0.01)
    operator.__dict__["job_store"] = store  # the cached_property, set to the patched store
    outcome = operator.execute({})
    assert outcome["state"] == "done" and len(calls) >= 3
