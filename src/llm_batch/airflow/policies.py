"""A cluster policy that puts each shard task instance of a batch_inference run in the run's
lane (pool and priority weight) and charges a multi-node shard a pool slot per node.

Airflow fixes a task's pool and priority_weight at parse time; ``task_instance_mutation_hook``
is the public way to route a task instance on its run's conf. It runs inside the scheduler's
transaction: no database access, and it never raises."""

from __future__ import annotations

import logging
from functools import cache
from typing import Any

import pluggy

from llm_batch.airflow.lanes import lane_of_run
from llm_batch.core.config import Settings, get_settings
from llm_batch.core.run_conf import BATCH_DAG_ID, SHARD_TASK_ID

log = logging.getLogger(__name__)

# airflow.policies.hookimpl, made here: importing airflow from this module would start
# Airflow's initialisation, which loads this entry point while it is half imported.
hookimpl = pluggy.HookimplMarker("airflow.policy")


@cache
def _settings() -> Settings:
    return get_settings()


@hookimpl
def task_instance_mutation_hook(task_instance: Any, dag_run: Any) -> None:
    if task_instance.task_id != SHARD_TASK_ID or task_instance.dag_id != BATCH_DAG_ID or dag_run is None:
        return
    try:
        lane = lane_of_run(_settings(), dag_run.conf)
    except Exception:  # noqa: BLE001 - a policy must never break the scheduler's loop
        log.exception("llm-batch: could not read the lane of run %s; the DAG's default lane stays", dag_run.run_id)
        return
    task_instance.pool = lane.pool
    task_instance.priority_weight = lane.priority_weight
    task_instance.pool_slots = pool_slots_of_run(_settings(), dag_run.conf)


def pool_slots_of_run(settings: Settings, conf: Any) -> int:
    """A shard's pool slots: a GPU pool counts nodes, so a worker of ``nodes_per_worker`` nodes
    takes that many (at most the whole pool, or it would never be scheduled); 1 otherwise."""
    if settings.shard_runner != "kubernetes" or not isinstance(conf, dict):
        return 1
    try:
        nodes = int(conf.get("nodes_per_worker") or 1)
    except (TypeError, ValueError):
        return 1
    return max(1, min(nodes, settings.gpu_pool_slots))
