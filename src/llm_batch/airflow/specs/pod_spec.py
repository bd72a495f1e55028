"""The parts of a shard worker's pod, from a ShardTask and the settings (no Airflow here;
docs/orchestration.md, "Shard runners", describes the pod).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from kubernetes.client import models as k8s

from llm_batch.core.config import Settings
from llm_batch.core.placement import GPU_TYPES
from llm_batch.pipeline.shard_task import ShardTask

GPU_RESOURCE = "nvidia.com/gpu"
MIG_RESOURCES = {
    "nvidia-hopper-h100-1g20gb": "nvidia.com/mig-1g.20gb",
    "nvidia-hopper-h100-3g40gb": "nvidia.com/mig-3g.40gb",
}
LABEL_PREFIX = "llm-batch.io"
_LABEL_MAX = 63


class UnsupportedPodShape(ValueError):
    """The shard asks for something a single worker pod cannot be."""


def check_supported(task: ShardTask) -> None:
    """What every worker pod needs, alone or in a group."""
    if task.nodes_per_worker < 1:
        raise UnsupportedPodShape(f"nodes_per_worker must be >= 1, got {task.nodes_per_worker}")
    if task.gpu_type is not None and task.gpu_type not in GPU_TYPES:
        raise UnsupportedPodShape(f"gpu_type {task.gpu_type!r} is unknown; use one of {', '.join(GPU_TYPES)}")
    if task.gpus < 1:
        raise UnsupportedPodShape(f"gpus must be >= 1 for a GPU pod, got {task.gpus}")


def check_single_pod(task: ShardTask) -> None:
    check_supported(task)
    if task.nodes_per_worker != 1:
        raise UnsupportedPodShape(f"nodes_per_worker={task.nodes_per_worker}: one pod cannot span nodes; "
                                  "KubernetesShardOperator runs such a shard as a LeaderWorkerSet (group_spec)")


def gpu_resource_name(gpu_type: str | None) -> str:
    return MIG_RESOURCES.get(gpu_type or "", GPU_RESOURCE)


def gpu_resources(gpu_type: str | None, count: int) -> k8s.V1ResourceRequirements:
    gpus = {gpu_resource_name(gpu_type): str(count)}
    return k8s.V1ResourceRequirements(requests=dict(gpus), limits=dict(gpus))


def node_selector(settings: Settings, gpu_type: str | None) -> dict[str, str]:
    if gpu_type is None:
        return {}
    return {settings.gpu_node_label_key: settings.gpu_node_label_values.get(gpu_type, gpu_type)}


def gpu_tolerations(gpu_type: str | None) -> list[k8s.V1Toleration]:
    resource = gpu_resource_name(gpu_type)
    keys = [GPU_RESOURCE] if resource == GPU_RESOURCE else [GPU_RESOURCE, resource]
    return [k8s.V1Toleration(key=key, operator="Exists", effect="NoSchedule") for key in keys]


def label_value(value: object) -> str:
    """A valid label value: [A-Za-z0-9._-], starting and ending alphanumeric, <= 63."""
    cleaned = re.sub(r"[^A-Za-z0-9._-]+", "-", str(value))[:_LABEL_MAX]
    return cleaned.strip("._-")


def _label_key(key: str) -> str | None:
    name = label_value(key.split("/")[-1])
    return f"{LABEL_PREFIX}.user/{name}" if name else None


def labels(task: ShardTask) -> dict[str, str]:
    """The pod's labels: job, shard and component first, then the job's own labels."""
    own = {user_key: label_value(value) for key, value in task.labels.items() if (user_key := _label_key(key))}
    return {
        **own,
        "app.kubernetes.io/name": "llm-batch-worker",
        "app.kubernetes.io/component": "shard",
        f"{LABEL_PREFIX}/job": label_value(task.job_id),
        f"{LABEL_PREFIX}/shard": str(task.shard),
    }


def pod_name(task: ShardTask) -> str:
    """A DNS-1123 name prefix (the operator adds a random suffix)."""
    job = re.sub(r"[^a-z0-9-]+", "-", task.job_id.lower()).strip("-")[:40]
    return f"llm-batch-{job}-{task.shard}".strip("-")


def env_vars(task: ShardTask, settings: Settings) -> list[k8s.V1EnvVar]:
    shard = [k8s.V1EnvVar(name="LLM_BATCH_JOB_ID", value=task.job_id),
             k8s.V1EnvVar(name="LLM_BATCH_SHARD", value=str(task.shard))]
    return shard + storage_env(settings)


def storage_env(settings: Settings) -> list[k8s.V1EnvVar]:
    """Where a worker finds storage and models: every worker pod's, and an engine service's."""
    values = {
        "LLM_BATCH_WORK_URI": settings.work_uri,
        "LLM_BATCH_MODEL_CACHE": settings.model_cache_mount_path,
        "LLM_BATCH_ALLOWED_BUCKETS": ",".join(settings.allowed_buckets),
        "LLM_BATCH_S3_ENDPOINT_URL": settings.s3_endpoint_url,
    }
    return [k8s.V1EnvVar(name=name, value=value) for name, value in values.items() if value]


def env_from(settings: Settings) -> list[k8s.V1EnvFromSource]:
    return [k8s.V1EnvFromSource(secret_ref=k8s.V1SecretEnvSource(name=settings.storage_secret_name))]


def model_cache(settings: Settings) -> tuple[list[k8s.V1Volume], list[k8s.V1VolumeMount]]:
    if not settings.model_cache_claim:
        return [], []
    claim = k8s.V1PersistentVolumeClaimVolumeSource(claim_name=settings.model_cache_claim)
    volume = k8s.V1Volume(name="model-cache", persistent_volume_claim=claim)
    return [volume], [k8s.V1VolumeMount(name="model-cache", mount_path=settings.model_cache_mount_path)]


def gpu_pod(settings: Settings, gpu_type: str | None, gpus: int, container: dict[str, Any],
            volumes: Sequence[k8s.V1Volume] = (), mounts: Sequence[k8s.V1VolumeMount] = (), **spec: Any) -> k8s.V1PodSpec:
    """A pod of one ``llm-batch`` container of the worker image (``container``: its name, args...)
    on ``gpus`` GPUs of ``gpu_type``, with the storage Secret and the model cache."""
    cache, cache_mounts = model_cache(settings)
    main = k8s.V1Container(image=settings.worker_image, command=["llm-batch"], env_from=env_from(settings),
                           resources=gpu_resources(gpu_type, gpus), volume_mounts=[*cache_mounts, *mounts] or None,
                           **container)
    return k8s.V1PodSpec(containers=[main], volumes=[*cache, *volumes] or None, tolerations=gpu_tolerations(gpu_type),
                         node_selector=node_selector(settings, gpu_type) or None, **spec)


def priority_class(settings: Settings, task: ShardTask) -> str | None:
    return settings.priority_classes.get(task.priority)
