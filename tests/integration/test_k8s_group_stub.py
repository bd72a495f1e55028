"""A multi-node shard (nodes_per_worker > 1) as a LeaderWorkerSet, against the Kubernetes
API stub (tests/fixtures/kube_stub.py), which serves LeaderWorkerSets, plays their
controller (the group's pods, StatefulSet-style restarts) and refuses a set the pinned LWS
CRD's schema refuses (422).

Covered, each both ways the group is waited for (``mode``: "deferred", the default: the task
defers to ShardGroupTrigger, rebuilt from its serialized form and run until its event, then
a fresh operator resumes in trigger_reentry, as Airflow does; "task": deferrable=False, the
rounds in the task): the group is created, the leader's exit decides (done; cancelled by
the worker); a follower dying fails the shard (its log's error in the message) and its
retry makes a fresh group; a pod of the group deleted mid-run fails it too; a cancel past
the grace deletes the whole group. Also: a kill deletes it (the task's on_kill; the
trigger's while deferred); a set left by a killed attempt is deleted before the retry's
group is made; a cluster without the LWS API fails the shard for good.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("airflow.providers.cncf.kubernetes")

from tests.fixtures.kube_stub import KubeStub, serve, write_kubeconfig  # noqa: E402
from tests.fixtures.lws_schema import lws_errors  # noqa: E402
from tests.integration import test_k8s_stub as single  # noqa: E402
from tests.integration.test_k8s_stub import _context, _shard, _swallow  # noqa: E402

pytestmark = [pytest.mark.airflow]
NODES = 3
job_store = single.job_store  # the same job store as the single-pod tests, and their 1 s cancel grace


@pytest.fixture
def kube(tmp_path: Path):
    stub = KubeStub(lws_validator=lws_errors)
    server, url = serve(stub)
    yield stub, str(write_kubeconfig(tmp_path / "kubeconfig", url))
    server.shutdown()


def _group_shard(store, job_id: str) -> dict:
    return {**_shard(store, job_id), "nodes_per_worker": NODES, "gpus": 2}


@pytest.fixture(params=["deferred", "task"])
def mode(request) -> str:
    return request.param


def _operator(shard: dict, kubeconfig: str, mode: str = "deferred"):
    from llm_batch.airflow.operators.kubernetes import KubernetesShardOperator

    return KubernetesShardOperator(task_id="run_shard", shard_task=shard, retries=2, settings=single.one_second_grace(),
                                   pod_overrides={"config_file": kubeconfig, "in_cluster": False, "poll_interval": 0.1,
                                                  "deferrable": mode == "deferred"})


def _run(operator, context: dict[str, Any] | None = None) -> dict[str, Any]:
    """One attempt as Airflow runs it: execute; if it defers, the trigger rebuilt from its
    serialized form runs to its event, and a fresh operator (a new task process) resumes."""
    from airflow.sdk.exceptions import TaskDeferred

    from llm_batch.airflow.operators.kubernetes_group import ShardGroupTrigger

    context = context or _context()
    try:
        return operator.execute(context)
    except TaskDeferred as deferred:
        classpath, kwargs = deferred.trigger.serialize()
        assert classpath == "llm_batch.airflow.operators.kubernetes_group.ShardGroupTrigger"
        event = asyncio.run(_first_event(ShardGroupTrigger(**kwargs)))
        resumed = type(operator)(task_id=operator.task_id, shard_task=operator.shard_task, retries=operator.retries,
                                 pod_overrides=operator.pod_overrides, settings=operator.llm_settings)
        return getattr(resumed, deferred.method_name)(context, event)


async def _first_event(trigger) -> dict[str, Any]:
    async for event in trigger.run():
        return event.payload
    raise AssertionError("the trigger ended without an event")


def _group_pods(stub: KubeStub, set_name: str) -> list[str]:
    return sorted(n for n, labels in stub.pod_labels.items() if labels.get("leaderworkerset.sigs.k8s.io/name") == set_name)


def test_group_runs_to_success_and_is_deleted(kube, job_store, mode):
    stub, config = kube

    outcome = _run(_operator(_group_shard(job_store, f"job_grp_ok_{mode}"), config, mode))

    assert outcome["state"] == "done"
    (name,) = stub.sets_created
    assert stub.sets_deleted == [name] and not stub.sets  # the set went, and with it ...
    pods = _group_pods(stub, name)
    assert pods == [f"{name}-0", f"{name}-0-1", f"{name}-0-2"]
    assert sorted(stub.deleted) == pods and not stub.pods  # ... every pod of the group
    assert stub.requests["POST lws"] == 1 and stub.requests["POST pod"] == 0  # the operator made no pod itself


def test_leader_exit_code_decides_even_after_its_restart(kube, job_store, mode):
    """The leader's container exits 3 (it saw the cancel marker) and the kubelet restarts it
    (StatefulSet pods always restart): the exit is read from lastState, a good end."""
    stub, config = kube
    stub.exit_code = 3
    outcome = _run(_operator(_group_shard(job_store, f"job_grp_cancelled_{mode}"), config, mode))
    assert outcome["state"] == "cancelled" and outcome["exit_code"] == 3
    assert not stub.sets and not stub.pods


def test_follower_failure_fails_the_shard_and_the_retry_makes_a_fresh_group(kube, job_store, mode):
    from airflow.sdk.exceptions import AirflowException

    stub, config = kube
    stub.exit_code = None  # the leader would run on ...
    stub.follower_exit_codes = {2: 1}  # ... but follower 2 dies
    stub.log_of = lambda pod: b"loading\nERROR gloo: Connection reset by peer\n" if pod.endswith("-0-2") else b"ok\n"
    shard = _group_shard(job_store, f"job_grp_follower_{mode}")
    with pytest.raises(AirflowException, match=r"follower 2 \(.*-0-2\) exited with code 1.*a retry makes a new group"
                                               r".*: ERROR gloo: Connection reset by peer"):
        _run(_operator(shard, config, mode))
    (first,) = stub.sets_created
    # Its log was read from the exited container (the kubelet had restarted it), before the group went.
    assert stub.log_reads == [(f"{first}-0-2", True)]
    assert stub.sets_deleted == [first] and not stub.pods  # the whole group went, the leader too
    (row,) = job_store.shard_records(f"job_grp_follower_{mode}")  # merge tells the requests it never ran why
    assert row.state == "failed" and "follower 2" in row.reason and "attempt 1 of 3" in row.reason

    # The retry (a new task attempt: a new operator) makes a new group, which succeeds.
    stub.exit_code, stub.follower_exit_codes = 0, {}
    outcome = _run(_operator(shard, config, mode))
    assert outcome["state"] == "done"
    assert len(stub.sets_created) == 2 and stub.sets_created[1] != first
    assert stub.sets_deleted == stub.sets_created and not stub.sets and not stub.pods


def test_cancel_past_the_grace_deletes_the_whole_group(kube, job_store, mode):
    from llm_batch.infra import storage
    from llm_batch.pipeline.shard_task import ShardTask

    stub, config = kube
    stub.exit_code = None  # the leader ignores the cancel marker
    shard = _group_shard(job_store, f"job_grp_cancel_{mode}")
    operator = _operator(shard, config, mode)
    outcome: dict = {}
    runner = threading.Thread(target=lambda: outcome.update(_run(operator)), daemon=True)
    runner.start()
    _wait_for_the_group(stub)
    job_store.request_cancel(f"job_grp_cancel_{mode}", reason="test")
    cancelled_at = time.monotonic()
    runner.join(timeout=30)

    assert outcome["state"] == "cancelled" and "killed" in outcome["message"]
    assert time.monotonic() - cancelled_at >= 1.0  # the grace (cancel_grace_seconds=1) was given
    assert storage.exists(ShardTask.model_validate(shard).cancel_marker)  # mirrored for the leader's worker
    (name,) = stub.sets_created
    assert stub.sets_deleted == [name] and not stub.pods


def _wait_for_the_group(stub: KubeStub) -> None:
    deadline = time.monotonic() + 30
    while not (stub.sets_created and stub.requests["GET lws"] >= 2) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stub.sets_created, "the group was never created"


def test_kill_deletes_the_group(kube, job_store):
    stub, config = kube
    stub.exit_code = None
    operator = _operator(_group_shard(job_store, "job_grp_kill"), config, "task")
    runner = threading.Thread(target=lambda: _swallow(operator.execute, _context()), daemon=True)
    runner.start()
    _wait_for_the_group(stub)

    operator.on_kill()

    assert stub.sets_deleted == stub.sets_created and not stub.pods
    runner.join(timeout=30)
    assert not runner.is_alive()


def test_a_kill_of_the_deferred_task_deletes_the_group(kube, job_store):
    """While the task is deferred there is no task process: a user's kill (mark failed,
    clear) reaches the trigger's on_kill, which deletes the group."""
    from airflow.sdk.exceptions import TaskDeferred

    from llm_batch.airflow.operators.kubernetes_group import ShardGroupTrigger

    stub, config = kube
    stub.exit_code = None
    with pytest.raises(TaskDeferred) as deferred:
        _operator(_group_shard(job_store, "job_grp_kill_deferred"), config).execute(_context())
    trigger = ShardGroupTrigger(**deferred.value.trigger.serialize()[1])

    async def wait_then_kill() -> None:
        waiting = asyncio.ensure_future(_first_event(trigger))
        while stub.requests["GET lws"] < 2:  # the trigger is watching
            await asyncio.sleep(0.05)
        await trigger.on_kill()
        waiting.cancel()  # as the triggerer cancels a killed trigger's run

    asyncio.run(wait_then_kill())
    (name,) = stub.sets_created
    assert stub.sets_deleted == [name] and not stub.sets and not stub.pods


def test_a_set_left_by_a_killed_attempt_is_deleted_before_the_retry(kube, job_store):
    """An attempt killed with no time to clean up (kill -9) leaves its set; the retry deletes
    it before making its own, so two groups never work on one shard."""
    from llm_batch.airflow.specs import group_spec
    from llm_batch.pipeline.shard_task import ShardTask

    stub, config = kube
    shard = _group_shard(job_store, "job_grp_stale")
    task = ShardTask.model_validate(shard)
    from llm_batch.core.config import get_settings

    stale = group_spec.leader_worker_set(task, get_settings(), group_spec.set_name(task))
    assert stub.create_set("default", stale)[0] == 201

    outcome = _run(_operator(shard, config))

    assert outcome["state"] == "done"
    assert stub.sets_deleted[0] == stale["metadata"]["name"]
    assert len(stub.sets_created) == 2 and not stub.sets and not stub.pods


def test_a_pod_of_the_group_deleted_mid_run_fails_the_shard(kube, job_store, mode):
    """A node drained or lost under a follower: its pod goes (a controller would make a new
    one, which could not rejoin the running engine): the attempt fails and the group goes."""
    stub, _ = kube
    name, error = _broken_mid_run(kube, job_store, mode, f"job_grp_drained_{mode}", lambda name: stub.delete(f"{name}-0-1"))
    assert "pod 1 of the group was deleted or replaced" in error


def test_an_evicted_leader_fails_the_shard(kube, job_store, mode):
    stub, _ = kube
    name, error = _broken_mid_run(kube, job_store, mode, f"job_grp_evicted_{mode}", lambda name: stub.evicted.add(f"{name}-0"))
    assert f"the leader pod {name}-0 failed (Evicted)" in error


def _broken_mid_run(kube, job_store, mode: str, job_id: str, breaks) -> tuple[str, str]:
    """Run a group whose leader runs on, ``breaks(set name)`` once it runs; (the set's name,
    the error the attempt raised), checking the whole group went."""
    from airflow.sdk.exceptions import AirflowException

    stub, config = kube
    stub.exit_code = None
    operator = _operator(_group_shard(job_store, job_id), config, mode)
    errors: list[Exception] = []

    def run() -> None:
        try:
            _run(operator)
        except Exception as exc:  # noqa: BLE001 - the test reads it
            errors.append(exc)

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    _wait_for_the_group(stub)
    (name,) = stub.sets_created
    breaks(name)
    runner.join(timeout=30)
    assert len(errors) == 1 and isinstance(errors[0], AirflowException), errors
    assert stub.sets_deleted == [name] and not stub.pods
    return name, str(errors[0])


def test_a_cluster_without_the_lws_api_fails_the_shard_for_good(kube, job_store):
    from airflow.sdk.exceptions import AirflowFailException

    stub, config = kube
    stub.lws_installed = False
    with pytest.raises(AirflowFailException, match="serves no LeaderWorkerSet API.*install the LWS controller"):
        _run(_operator(_group_shard(job_store, "job_grp_no_lws"), config))
    assert not stub.pods and stub.requests["POST lws (not installed)"] == 1


def test_the_stub_refuses_a_set_the_crd_refuses(kube):
    stub, _ = kube
    status, answer = stub.create_set("default", {"apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet",
                                                 "metadata": {"name": "bad"}, "spec": {"leaderWorkerTemplate": {}}})
    assert status == 422 and "workerTemplate" in answer["message"]
    assert not stub.pods
