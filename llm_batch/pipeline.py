"""The steps of one batch job as plain functions: the DAG's tasks are thin wrappers.

No Airflow and no vLLM here: every step takes the job store, settings and the job's
layout, so it is tested without a scheduler and reused by the housekeeping DAG and CLI.
"""

from __future__ import annotations

from dataclasses import dataclass

from llm_batch.config import Settings

# The Scale contract's gpu_type enum: the values the DAG form and the pod renderer accept.
GPU_TYPES: tuple[str, ...] = (
    "nvidia-tesla-t4",
    "nvidia-ampere-a10",
    "nvidia-ampere-a100",
    "nvidia-ampere-a100e",
    "nvidia-hopper-h100",
    "nvidia-hopper-h100-1g20gb",
    "nvidia-hopper-h100-3g40gb",
)


@dataclass(frozen=True)
class PoolSpec:
    """An Airflow pool the shard tasks use; created by the embedded stack and tests."""

    name: str
    slots: int
    description: str


def gpu_pool(settings: Settings, gpu_type: str) -> str:
    return f"{settings.gpu_pool_prefix}{gpu_type.replace('-', '_')}"


def shard_pool(settings: Settings, gpu_type: str | None) -> str:
    """The pool a shard task waits in: the local pool, or the pool of its gpu_type."""
    if settings.shard_runner == "local" or not gpu_type:
        return settings.local_pool
    return gpu_pool(settings, gpu_type)


def pool_specs(settings: Settings) -> list[PoolSpec]:
    """Every pool the batch DAG may name, with its configured size."""
    pools = [PoolSpec(settings.local_pool, settings.local_pool_slots, "llm-batch local shard workers")]
    pools += [
        PoolSpec(gpu_pool(settings, g), settings.gpu_pool_slots, f"llm-batch shards on {g}")
        for g in GPU_TYPES
    ]
    return pools
