"""The cluster policy that puts each shard task instance in its run's lane."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from llm_batch.airflow import policies as shard_routing


def _ti(dag_id="batch_inference", task_id="run_shard"):
    return SimpleNamespace(dag_id=dag_id, task_id=task_id, map_index=0, pool="default_pool", priority_weight=1,
                           pool_slots=1)


def _run(conf):
    return SimpleNamespace(run_id="r1", conf=conf)


def test_the_policy_is_installed_for_airflow():
    from airflow.settings import get_policy_plugin_manager

    impls = get_policy_plugin_manager().hook.task_instance_mutation_hook.get_hookimpls()
    assert shard_routing.__name__ in [getattr(impl.plugin, "__name__", None) for impl in impls]


def test_a_shard_task_instance_takes_its_runs_lane():
    ti = _ti()
    shard_routing.task_instance_mutation_hook(ti, _run({"priority": "high", "job_id": "j"}))
    assert (ti.pool, ti.priority_weight) == ("llm_batch_local", 100)
    shard_routing.task_instance_mutation_hook(ti, _run({}))
    assert (ti.pool, ti.priority_weight) == ("llm_batch_local", 10)


@pytest.mark.parametrize("ti", [_ti(dag_id="users_own_dag"), _ti(task_id="merge"), _ti(task_id="run_shard_other")])
def test_other_tasks_and_dags_are_left_alone(ti):
    shard_routing.task_instance_mutation_hook(ti, _run({"priority": "high"}))
    assert (ti.pool, ti.priority_weight) == ("default_pool", 1)


@pytest.mark.parametrize("conf", [None, "high", ["high"], {"priority": {"$ne": 1}}, {"gpu_type": ["x"]}])
def test_no_run_or_an_odd_conf_never_raises(conf):
    ti = _ti()
    shard_routing.task_instance_mutation_hook(ti, None)  # early construction: no run yet
    assert (ti.pool, ti.priority_weight) == ("default_pool", 1)
    shard_routing.task_instance_mutation_hook(ti, _run(conf))
    assert (ti.pool, ti.priority_weight) == ("llm_batch_local", 10)


def test_a_conf_that_breaks_the_lane_logs_and_leaves_the_default(monkeypatch, caplog):
    class Exploding(dict):
        def get(self, *args):
            raise RuntimeError("boom")

    ti = _ti()
    shard_routing.task_instance_mutation_hook(ti, _run(Exploding(priority="high")))
    assert (ti.pool, ti.priority_weight) == ("default_pool", 1)
    assert "could not read the lane" in caplog.text


def test_a_multi_node_shard_takes_a_pool_slot_per_node():
    from llm_batch.core.config import Settings

    k8s = Settings(shard_runner="kubernetes", gpu_pool_slots=8)
    assert [shard_routing.pool_slots_of_run(k8s, {"nodes_per_worker": n}) for n in (None, 1, 4, 16)] == [1, 1, 4, 8]
    assert shard_routing.pool_slots_of_run(k8s, {"nodes_per_worker": "x"}) == 1
    assert shard_routing.pool_slots_of_run(Settings(), {"nodes_per_worker": 4}) == 1  # local: refused anyway
    ti = _ti()
    shard_routing.task_instance_mutation_hook(ti, _run({"nodes_per_worker": 2}))
    assert ti.pool_slots == 1  # this session's settings: the local runner
