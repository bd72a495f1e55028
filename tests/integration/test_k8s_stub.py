"""KubernetesShardOperator's pod lifecycle against a small Kubernetes API stub on 127.0.0.1.

No Kubernetes API server can run here, so a stdlib HTTP server (tests/fixtures/kube_stub.py,
which benchmarks/k8s_overhead.py uses too) answers the calls the unpatched provider makes
(create, list, get, log, patch, delete pod; events), pointed to by a kubeconfig file. Pods
move Pending -> Running -> Succeeded/Failed (with the worker's exit code) as they are polled.
Covered: the sync path to success, exit codes 3/1 (cancelled: a good end; failure: raise
for retry), kill -> the pod is deleted, and the deferrable path: the shard stop watch ends
the wait after the grace and the pod is deleted; a worker's exit code read at re-entry (the
pod the provider hands to the on_pod_completion callback).
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("airflow.providers.cncf.kubernetes")

from llm_batch.core.config import get_settings  # noqa: E402
from llm_batch.pipeline.shard_task import ShardTask  # noqa: E402
from tests.fixtures.kube_stub import KubeStub, serve, write_kubeconfig  # noqa: E402

pytestmark = [pytest.mark.airflow]


@pytest.fixture
def kube(tmp_path: Path):
    """(stub, kubeconfig path) with the stub serving on a free 127.0.0.1 port."""
    stub = KubeStub()
    server, url = serve(stub)
    yield stub, str(write_kubeconfig(tmp_path / "kubeconfig", url))
    server.shutdown()


def one_second_grace():
    """The session's settings with a 1 s cancel grace (the deferred kill waits that long)."""
    return get_settings().model_copy(update={"cancel_grace_seconds": 1})


@pytest.fixture
def job_store():
    from llm_batch.infra.jobstore import get_job_store

    return get_job_store(get_settings().database_url)


def _shard(store, job_id: str) -> dict[str, Any]:
    if store.get_job(job_id) is None:
        store.create_job(id=job_id, dialect="airflow", endpoint="/v1/chat/completions", model="m", owner="t",
                         max_runtime_sec=3600)
    root = f"{get_settings().work_uri}/{job_id}"
    return ShardTask(
        job_id=job_id, shard=0, requests_uri=f"{root}/shards/00000/requests.jsonl",
        results_uri=f"{root}/shards/00000/results", progress_uri=f"{root}/shards/00000/progress.json",
        cancel_marker=f"{root}/cancel", endpoint="/v1/chat/completions", model_config_json='{"model": "m"}',
        deadline="2099-01-01T00:00:00+00:00", gpu_type="nvidia-tesla-t4",
    ).model_dump()


def _context() -> dict[str, Any]:
    ti = SimpleNamespace(dag_id="batch_inference", task_id="run_shard", map_index=0, try_number=1,
                         xcom_push=lambda **kw: None, start_date=None)
    return {"ti": ti, "task_instance": ti, "run_id": "manual__stub", "dag": SimpleNamespace()}


def _operator(shard: dict[str, Any], kubeconfig: str, **kwargs: Any):
    from llm_batch.airflow.operators.kubernetes import KubernetesShardOperator

    overrides = {"config_file": kubeconfig, "in_cluster": False, "poll_interval": 0.2, **kwargs}
    return KubernetesShardOperator(task_id="run_shard", shard_task=shard, pod_overrides=overrides, settings=one_second_grace())


def test_pod_runs_to_success_and_is_deleted(kube, job_store):
    stub, config = kube
    operator = _operator(_shard(job_store, "job_k8s_ok"), config, deferrable=False)

    outcome = operator.execute(_context())

    assert outcome["state"] == "done"
    assert len(stub.created) == 1 and stub.deleted == stub.created
    assert stub.reads[stub.created[0]] > stub.reads_to_finish  # it was seen running, then done


@pytest.mark.parametrize(("exit_code", "state"), [(3, "cancelled"), (4, "deadline")])
def test_worker_stopped_on_purpose_is_a_good_end(kube, job_store, exit_code, state):
    stub, config = kube
    stub.exit_code = exit_code
    outcome = _operator(_shard(job_store, f"job_k8s_{state}"), config, deferrable=False).execute(_context())
    assert outcome["state"] == state and outcome["exit_code"] == exit_code
    assert stub.deleted == stub.created


def test_worker_failure_raises_for_a_retry(kube, job_store):
    from airflow.sdk.exceptions import AirflowException, AirflowFailException

    stub, config = kube
    stub.exit_code = 1
    with pytest.raises(AirflowException, match="a retry resumes"):
        _operator(_shard(job_store, "job_k8s_fail"), config, deferrable=False).execute(_context())
    stub.exit_code = 2  # usage: retrying cannot help
    with pytest.raises(AirflowFailException):
        _operator(_shard(job_store, "job_k8s_usage"), config, deferrable=False).execute(_context())
    assert stub.deleted == stub.created


def test_kill_deletes_the_running_pod(kube, job_store):
    stub, config = kube
    stub.exit_code = None  # runs until deleted
    operator = _operator(_shard(job_store, "job_k8s_kill"), config, deferrable=False)
    runner = threading.Thread(target=lambda: _swallow(operator.execute, _context()), daemon=True)
    runner.start()
    deadline = time.monotonic() + 30
    while not (stub.created and stub.reads.get(stub.created[0], 0) > 1) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert stub.created, "the pod was never created"

    operator.on_kill()

    assert stub.deleted == stub.created
    runner.join(timeout=30)


def _swallow(func, *args):
    try:
        func(*args)
    except Exception:  # noqa: BLE001 - the killed task's own error is not under test
        pass


def test_deferred_wait_kills_pod_after_cancel_grace(kube, job_store):
    """Deferrable path: the task defers to ShardPodTrigger; a cancel in the store is
    mirrored to the marker, and after the grace the trigger ends the wait; re-entry deletes
    the pod and returns the cancelled outcome."""
    from airflow.sdk.exceptions import TaskDeferred

    from llm_batch.airflow.operators.kubernetes_pod import SHARD_STOP_KEY, STOP_KEY, ShardPodTrigger
    from llm_batch.infra import storage

    stub, config = kube
    stub.exit_code = None
    shard = _shard(job_store, "job_k8s_defer")
    operator = _operator(shard, config, deferrable=True)
    context = _context()
    with pytest.raises(TaskDeferred) as deferred:
        operator.execute(context)
    trigger = deferred.value.trigger
    assert isinstance(trigger, ShardPodTrigger)
    classpath, kwargs = trigger.serialize()
    assert classpath == "llm_batch.airflow.operators.kubernetes_pod.ShardPodTrigger"
    assert kwargs["trigger_kwargs"][SHARD_STOP_KEY]["job_id"] == "job_k8s_defer"  # the provider's own parameter
    assert "shard_stop" not in kwargs  # the provider trigger's arguments only

    job_store.request_cancel("job_k8s_defer", reason="test")

    async def first_event():
        async for event in ShardPodTrigger(**kwargs).run():
            return event.payload

    event = asyncio.run(asyncio.wait_for(first_event(), timeout=60))
    assert event["status"] == "timeout" and event[STOP_KEY] == "cancelled"
    assert storage.exists(ShardTask.model_validate(shard).cancel_marker)  # mirrored for the worker

    outcome = operator.trigger_reentry(context, event)

    assert outcome["state"] == "cancelled"
    assert stub.deleted == stub.created


def test_deferred_exit_code_comes_from_the_completed_pod(kube, job_store):
    """Deferrable path, the worker exits 3 (cancelled) by itself: the provider's trigger
    reports the failed container; at re-entry the exit code is read from the pod the
    provider hands to the on_pod_completion callback, so the task ends well."""
    from llm_batch.airflow.operators.kubernetes_pod import STOP_KEY

    stub, config = kube
    stub.exit_code = 3
    operator = _operator(_shard(job_store, "job_k8s_defer_exit"), config, deferrable=True)
    context = _context()
    event = _deferred_first_event(operator, context)
    assert event["status"] == "failed" and STOP_KEY not in event

    outcome = operator.trigger_reentry(context, event)

    assert outcome["state"] == "cancelled" and outcome["exit_code"] == 3
    assert stub.deleted == stub.created


def test_pod_ending_on_the_clock_deferred(kube, job_store):
    """The stub's benchmark mode (benchmarks/k8s_overhead.py): a pod ends `run_seconds`
    after its creation however often it is read; the deferrable path then ends well with
    the pod created once and deleted once."""
    stub, config = kube
    stub.run_seconds, stub.reads_to_finish = 1.0, 10**6
    operator = _operator(_shard(job_store, "job_k8s_clock"), config, deferrable=True)
    context = _context()
    event = _deferred_first_event(operator, context)
    name = stub.created[0]
    assert event["status"] == "success"
    assert stub.ended_seen_at[name] - stub.created_at[name] >= 1.0

    outcome = operator.trigger_reentry(context, event)

    assert outcome["state"] == "done"
    assert stub.summary()["created"] == stub.summary()["deleted"] == 1 and not stub.summary()["left"]
    assert stub.log_read_at[name] <= stub.deleted_at[name]


def _deferred_first_event(operator, context) -> dict[str, Any]:
    """Run the operator until it defers, then its trigger until the first event's payload."""
    from airflow.sdk.exceptions import TaskDeferred

    from llm_batch.airflow.operators.kubernetes_pod import ShardPodTrigger

    with pytest.raises(TaskDeferred) as deferred:
        operator.execute(context)
    _, kwargs = deferred.value.trigger.serialize()

    async def first_event():
        async for event in ShardPodTrigger(**kwargs).run():
            return event.payload

    return asyncio.run(asyncio.wait_for(first_event(), timeout=60))
