"""The LeaderWorkerSet of a multi-node shard worker (``nodes_per_worker > 1``), from a ShardTask
and the settings (no Airflow here). Its shape and why: docs/orchestration.md, "Multi-node workers"."""

from __future__ import annotations

import secrets
from typing import Any

from kubernetes.client import ApiClient
from kubernetes.client import models as k8s

from llm_batch.airflow.specs import pod_spec
from llm_batch.core.config import Settings
from llm_batch.pipeline.shard_task import ShardTask
from llm_batch.runtime.multinode import DEFAULT_MASTER_PORT

GROUP = "leaderworkerset.x-k8s.io"
VERSION = "v1"
PLURAL = "leaderworkersets"
KIND = "LeaderWorkerSet"
# Labels the LWS controller puts on the group's pods.
SET_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
EXCLUSIVE_TOPOLOGY = "leaderworkerset.sigs.k8s.io/exclusive-topology"
CONTAINER = "base"  # as the single pod's container
SHM_SIZE = "16Gi"
_NAME_MAX = 45  # the controller appends "-0-<i>" for pods and the StatefulSets' hashes stay <= 63


def set_name(task: ShardTask) -> str:
    """A fresh DNS-1123 name for one attempt's set (a retry never reuses a set)."""
    suffix = secrets.token_hex(3)
    return f"{pod_spec.pod_name(task)[:_NAME_MAX - len(suffix) - 1].rstrip('-')}-{suffix}"


def follower_args(task: ShardTask) -> list[str]:
    return [
        "worker-follower",
        "--model-config", task.model_config_json,
        "--endpoint", task.endpoint,
        "--node-rank", "$(LWS_WORKER_INDEX)",
        *_group_args(task),
    ]  # fmt: skip


def _group_args(task: ShardTask) -> list[str]:
    return [
        "--nnodes", str(task.nodes_per_worker),
        "--master-addr", "$(LWS_LEADER_ADDRESS)",
        "--master-port", str(DEFAULT_MASTER_PORT),
        "--gpus-per-node", str(task.gpus),
    ]  # fmt: skip


def _pod_template(task: ShardTask, settings: Settings, args: list[str], role: str) -> k8s.V1PodTemplateSpec:
    shm = k8s.V1Volume(name="dshm", empty_dir=k8s.V1EmptyDirVolumeSource(medium="Memory", size_limit=SHM_SIZE))
    ports = [k8s.V1ContainerPort(name="dist", container_port=DEFAULT_MASTER_PORT)] if role == "leader" else None
    container = {"name": CONTAINER, "args": args, "env": pod_spec.env_vars(task, settings), "ports": ports}
    return k8s.V1PodTemplateSpec(
        metadata=k8s.V1ObjectMeta(labels={**pod_spec.labels(task), f"{pod_spec.LABEL_PREFIX}/role": role}),
        spec=pod_spec.gpu_pod(settings, task.gpu_type, task.gpus, container, volumes=[shm],
                              mounts=[k8s.V1VolumeMount(name="dshm", mount_path="/dev/shm")], restart_policy="Always",
                              priority_class_name=pod_spec.priority_class(settings, task),
                              termination_grace_period_seconds=settings.cancel_grace_seconds),
    )


def leader_worker_set(task: ShardTask, settings: Settings, name: str) -> dict[str, Any]:
    """The LeaderWorkerSet manifest (a dict, as the API takes it)."""
    pod_spec.check_supported(task)
    body = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "metadata": {"name": name, "namespace": settings.k8s_namespace, "labels": pod_spec.labels(task),
                     **({"annotations": {EXCLUSIVE_TOPOLOGY: settings.group_topology_key}}
                        if settings.group_topology_key else {})},
        "spec": {
            "replicas": 1,
            "startupPolicy": "LeaderCreated",
            "leaderWorkerTemplate": {
                "size": task.nodes_per_worker,
                "restartPolicy": "None",
                "leaderTemplate": _pod_template(task, settings, [*task.worker_args(), *_group_args(task)], "leader"),
                "workerTemplate": _pod_template(task, settings, follower_args(task), "follower"),
            },
        },
    }
    return ApiClient().sanitize_for_serialization(body)


def group_selector(name: str) -> str:
    """The label selector of the set's pods."""
    return f"{SET_NAME_LABEL}={name}"


def shard_selector(task: ShardTask) -> str:
    """The label selector of every set of this shard (a killed attempt's included)."""
    return f"{pod_spec.LABEL_PREFIX}/job={pod_spec.label_value(task.job_id)},{pod_spec.LABEL_PREFIX}/shard={task.shard}"
