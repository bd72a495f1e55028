"""Where and in what order a job's shards may run: the GPU types a deployment knows, the
resources a worker may ask for, and the priority bands jobs fall into."""

from __future__ import annotations

from llm_batch.config import Settings
from llm_batch.jobs import JobRejected

# The GPU node types runners can place a shard on (node pools and Airflow pools per type).
# The names are the Scale contract's gpu_type values, which its API edge accepts as they are.
GPU_TYPES: tuple[str, ...] = (
    "nvidia-tesla-t4",
    "nvidia-ampere-a10",
    "nvidia-ampere-a100",
    "nvidia-ampere-a100e",
    "nvidia-hopper-h100",
    "nvidia-hopper-h100-1g20gb",
    "nvidia-hopper-h100-3g40gb",
)


def priority_bands(settings: Settings) -> list[tuple[str, int]]:
    return sorted(settings.priority_weights.items(), key=lambda item: item[1])


def priority_band(settings: Settings, priority: str | int | None) -> str:
    """The band of a job priority: a band name, or a number mapped to the nearest band
    at or below it; no priority (None, "", 0: the store's "not given") and unknown names
    are "normal" (or the middle band)."""
    bands = priority_bands(settings)
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


def check_resources(nodes_per_worker: int | None, gpu_type: str | None) -> None:
    """Refuse what no runner can honour, before anything runs."""
    if nodes_per_worker not in (None, 1):
        raise JobRejected(
            f"nodes_per_worker={nodes_per_worker} is not supported: a shard worker runs on one "
            "node (tensor parallel over its gpus); use data_parallelism for more workers"
        )
    if gpu_type is not None and gpu_type not in GPU_TYPES:
        raise JobRejected(f"gpu_type {gpu_type!r} is unknown; use one of {', '.join(GPU_TYPES)}")

