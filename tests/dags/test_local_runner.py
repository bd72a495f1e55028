"""LocalShardOperator's supervision with a stand-in worker program (seconds, no engine):
cancel mirrored to the marker, a worker that ignores it killed after the grace, exit codes
read, on_kill terminating the worker. The real worker runs in test_batch_inference.py."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from llm_batch import storage
from llm_batch.config import get_settings
from llm_batch.jobstore import get_job_store
from llm_batch.shard_task import ShardTask

pytestmark = [pytest.mark.airflow]

# Stand-in worker: `fake.py worker --job-id ... --cancel-marker URI ...`; behaviour by env.
FAKE_WORKER = """
import os, signal, sys, time
args = sys.argv[1:]
marker = args[args.index("--cancel-marker") + 1]
mode = os.environ["FAKE_WORKER_MODE"]
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
def operator_for(tmp_path, monkeypatch):
    from llm_batch_operators.local import LocalShardOperator

    script = tmp_path / "fake_worker.py"
    script.write_text(FAKE_WORKER)
    monkeypatch.setenv("LLM_BATCH_CANCEL_GRACE_SECONDS", "1")
    get_settings.cache_clear()
    store = get_job_store(get_settings().database_url)

    def make(job_id: str, mode: str):
        monkeypatch.setenv("FAKE_WORKER_MODE", mode)
        if store.get_job(job_id) is None:
            store.create_job(id=job_id, dialect="airflow", endpoint="/v1/chat/completions", model="m",
                             owner="t", max_runtime_sec=3600)
        root = f"{get_settings().work_uri}/{job_id}"
        shard = ShardTask(
            job_id=job_id, shard=0, requests_uri=f"{root}/r.jsonl", results_uri=f"{root}/results",
            progress_uri=f"{root}/progress.json", cancel_marker=f"{root}/cancel",
            endpoint="/v1/chat/completions", model_config_json="{}", deadline="2099-01-01T00:00:00+00:00",
        )
        operator = LocalShardOperator(task_id="run_shard", shard_task=shard.model_dump())
        operator.worker_command = (sys.executable, str(script))
        operator.term_seconds = 1.0
        return store, shard, operator

    yield make
    get_settings.cache_clear()


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
