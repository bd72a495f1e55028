"""Pools and lanes: where the DAG's shard tasks queue (Airflow pools) and at which
priority. No Airflow import here: the embedded stack and the tests create the pools."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from llm_batch.config import Settings
from llm_batch.placement import GPU_TYPES, priority_band, priority_bands
from llm_batch.shard_task import ShardTask


@dataclass(frozen=True)
class PoolSpec:
    """An Airflow pool the shard tasks use; created by the embedded stack and tests."""

    name: str
    slots: int
    description: str


def gpu_pool(settings: Settings, gpu_type: str) -> str:
    return f"{settings.gpu_pool_prefix}{gpu_type.replace('-', '_')}"


def pool_specs(settings: Settings) -> list[PoolSpec]:
    """Every pool the batch DAG may name under either runner, with its configured size (a
    static pools file such as docker-compose's, whose runner is chosen at start)."""
    pools = [PoolSpec(settings.local_pool, settings.local_pool_slots, "llm-batch local shard workers")]
    pools += [
        PoolSpec(gpu_pool(settings, g), settings.gpu_pool_slots, f"llm-batch shards on {g}")
        for g in GPU_TYPES
    ]
    return pools


def runner_pool_specs(settings: Settings) -> list[PoolSpec]:
    """The pools the configured runner's lanes use: a local (CPU-only) stack gets its one
    pool and no GPU pools."""
    used = {lane.pool for lane in lanes(settings)}
    return [pool for pool in pool_specs(settings) if pool.name in used]


@dataclass(frozen=True)
class Lane:
    """One mapped shard task of the DAG: a pool and a priority band.

    Airflow fixes a mapped task's pool and priority_weight when the DAG is parsed, not per
    run, so the DAG has one mapped shard task per (pool, priority band) and ``plan`` puts a
    job's shards in the lane of its gpu_type and priority; the other lanes expand to zero
    tasks (skipped).
    """

    name: str
    pool: str
    priority: str
    priority_weight: int


def lanes(settings: Settings) -> list[Lane]:
    pools = (
        [("local", settings.local_pool)]
        if settings.shard_runner == "local"
        else [(g.replace("-", "_"), gpu_pool(settings, g)) for g in GPU_TYPES]
    )
    return [
        Lane(f"{pool_key}__{band}", pool, band, weight)
        for pool_key, pool in pools
        for band, weight in priority_bands(settings)
    ]



def lane_for(settings: Settings, gpu_type: str | None, priority: str | int | None) -> str:
    band = priority_band(settings, priority)
    if settings.shard_runner == "local":
        return f"local__{band}"
    return f"{(gpu_type or GPU_TYPES[0]).replace('-', '_')}__{band}"



def group_by_lane(settings: Settings, tasks: Iterable[ShardTask]) -> dict[str, list[dict[str, Any]]]:
    """The shard tasks of a job by lane name, every lane of the DAG a key (most empty):
    what the DAG's per-lane pickers read."""
    grouped: dict[str, list[dict[str, Any]]] = {lane.name: [] for lane in lanes(settings)}
    for task in tasks:
        grouped[lane_for(settings, task.gpu_type, task.priority)].append(task.model_dump())
    return grouped
