"""Pools and lanes: where a job's shard tasks queue (an Airflow pool: its GPU type's, or the local
pool under the local runner) and at which priority weight (its priority band's). The cluster
policy (``policies``) moves each shard task instance to its run's lane. No Airflow import here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from llm_batch.core.config import Settings
from llm_batch.core.placement import GPU_TYPES, priority_band


@dataclass(frozen=True)
class PoolSpec:
    """An Airflow pool the shard tasks use; created by the embedded stack and tests."""

    name: str
    slots: int
    description: str


GPU_POOL_PREFIX = "llm_batch_gpu_"


def gpu_pool(gpu_type: str) -> str:
    return f"{GPU_POOL_PREFIX}{gpu_type.replace('-', '_')}"


def pool_specs(settings: Settings) -> list[PoolSpec]:
    """Every pool the batch DAG may name under either runner (a static pools file, whose runner is
    chosen at start)."""
    return [
        PoolSpec(settings.local_pool, settings.local_shard_slots, "llm-batch local shard workers"),
        *(PoolSpec(gpu_pool(g), settings.gpu_pool_slots, f"llm-batch shards on {g}") for g in GPU_TYPES),
    ]


def runner_pool_specs(settings: Settings) -> list[PoolSpec]:
    """The pools the configured runner uses (a local stack: its one pool, no GPU pools)."""
    if settings.shard_runner == "local":
        return [pool for pool in pool_specs(settings) if pool.name == settings.local_pool]
    return [pool for pool in pool_specs(settings) if pool.name != settings.local_pool]


@dataclass(frozen=True)
class Lane:
    """Where a job's shard tasks wait: an Airflow pool, and a priority band and its weight."""

    pool: str
    priority: str
    priority_weight: int


def lane_for(settings: Settings, gpu_type: str | None, priority: str | int | None) -> Lane:
    """The lane of a job with this GPU type and priority (unknown or none: the first GPU type and
    the middle band)."""
    band = priority_band(settings, priority)
    if settings.shard_runner == "local":
        pool = settings.local_pool
    else:
        pool = gpu_pool(gpu_type if gpu_type in GPU_TYPES else GPU_TYPES[0])
    return Lane(pool, band, settings.priority_weights[band])


def lane_of_run(settings: Settings, conf: Mapping[str, Any] | None) -> Lane:
    """The lane of a batch_inference run from its conf (gpu_type and priority)."""
    conf = conf if isinstance(conf, Mapping) else {}
    gpu_type = conf.get("gpu_type")
    priority = conf.get("priority")
    return lane_for(settings, gpu_type if isinstance(gpu_type, str) else None,
                    priority if isinstance(priority, (str, int)) and not isinstance(priority, bool) else None)


def default_lane(settings: Settings) -> Lane:
    """The lane the DAG's shard task names at parse time (a run's conf may move it)."""
    return lane_for(settings, None, None)
