"""Where and in what order a job's shards may run: the GPU types a deployment knows, the
resources a worker may ask for, and the priority bands jobs fall into."""

from __future__ import annotations

from typing import Literal

from llm_batch.core.config import Settings

# The GPU node types runners can place a shard on: the Scale contract's gpu_type values.
GPU_TYPES: tuple[str, ...] = ("nvidia-tesla-t4", "nvidia-ampere-a10", "nvidia-ampere-a100", "nvidia-ampere-a100e",
                              "nvidia-hopper-h100", "nvidia-hopper-h100-1g20gb", "nvidia-hopper-h100-3g40gb")
GpuType = Literal[GPU_TYPES]  # the same names as a type of request models


def priority_band(settings: Settings, priority: str | int | None) -> str:
    """The band of a job priority: a band name, or a number mapped to the nearest band at or
    below it; no priority (None, "", 0) and unknown names are "normal" (or the middle band)."""
    bands = sorted(settings.priority_weights.items(), key=lambda item: item[1])
    names = [name for name, _ in bands]
    default = "normal" if "normal" in names else names[len(names) // 2]
    if priority in (None, "", 0, "0"):
        return default
    if isinstance(priority, str) and priority.strip().lower() in names:
        return priority.strip().lower()
    try:
        number = int(priority)
    except (TypeError, ValueError):
        return default
    below = [name for name, weight in bands if weight <= number]
    return below[-1] if below else names[0]


def priority_name(settings: Settings, weight: int) -> str | None:
    """The band a stored weight is (None: no priority, or a weight no band has)."""
    return next((name for name, w in settings.priority_weights.items() if w == weight and weight), None)


def multi_node_refusal(nodes_per_worker: int | None, shard_runner: str) -> str | None:
    """Why ``shard_runner`` cannot run a worker of ``nodes_per_worker`` nodes, or None."""
    if nodes_per_worker in (None, 1) or shard_runner != "local":
        return None
    return (f"nodes_per_worker={nodes_per_worker} needs the Kubernetes shard runner "
            "(LLM_BATCH_SHARD_RUNNER=kubernetes, a LeaderWorkerSet per shard): the local runner runs each "
            "worker as one process on this machine; give nodes_per_worker=1 and use gpus for a bigger "
            "worker or data_parallelism for more workers")
