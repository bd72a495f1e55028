"""An engine service's Kubernetes objects (``llm_batch.runtime.warm_engines``): a Deployment of
warm engine hosts for one model and GPU type, its Service, and a NetworkPolicy that lets only
Airflow's workers in (no Airflow here; docs/orchestration.md, "Engine services")."""

from __future__ import annotations

import hashlib
import re
from typing import Any

from kubernetes.client import ApiClient
from kubernetes.client import models as k8s

from llm_batch.airflow.specs import pod_spec
from llm_batch.core.config import Settings
from llm_batch.runtime.warm_engines import DEFAULT_PORT

TOKEN_KEY = "token"
DEFAULT_CLIENT_LABELS = {"component": "worker", "tier": "airflow"}  # Airflow's Helm chart's workers
_NAME_MAX = 63


def service_name(model: str, gpu_type: str | None) -> str:
    """A DNS-1123 label for the model and GPU type (hashed when too long to stay unique)."""
    base = re.sub(r"[^a-z0-9-]+", "-", f"llm-batch-engine-{model}-{gpu_type or 'any'}".lower()).strip("-")
    if len(base) <= _NAME_MAX:
        return base
    digest = hashlib.sha256(base.encode()).hexdigest()[:8]
    return f"{base[:_NAME_MAX - 9].rstrip('-')}-{digest}"


def manifests(settings: Settings, model: str, gpu_type: str | None = None, *, gpus: int = 1, replicas: int = 1,
              seats: int = 2, port: int = DEFAULT_PORT, token_secret: str = "llm-batch-engine-token",
              client_labels: dict[str, str] | None = None, grace_seconds: int = 120,
              preload: str | None = "{}") -> list[dict[str, Any]]:
    """Deployment, Service and NetworkPolicy, as the API server takes them. ``preload``: the
    model_config overrides (JSON) its engine loads at start (None: with the first shard)."""
    name = service_name(model, gpu_type)
    labels = {"app.kubernetes.io/name": "llm-batch-engine", "app.kubernetes.io/component": "engine-service",
              f"{pod_spec.LABEL_PREFIX}/model": pod_spec.label_value(model),
              f"{pod_spec.LABEL_PREFIX}/engine-service": name}
    selector = {f"{pod_spec.LABEL_PREFIX}/engine-service": name}
    listening = k8s.V1TCPSocketAction(port=port)
    token = k8s.V1EnvVar(name="LLM_BATCH_ENGINE_TOKEN", value_from=k8s.V1EnvVarSource(
        secret_key_ref=k8s.V1SecretKeySelector(name=token_secret, key=TOKEN_KEY)))
    container = {
        "name": "engine",
        "args": ["engine-host", "--listen", f"0.0.0.0:{port}", "--model", model, "--seats", str(seats),
                 *(["--preload", preload] if preload is not None else [])],
        "ports": [k8s.V1ContainerPort(name="shards", container_port=port)],
        "env": [*pod_spec.storage_env(settings), token],
        "startup_probe": k8s.V1Probe(tcp_socket=listening, period_seconds=10, failure_threshold=90),
        "readiness_probe": k8s.V1Probe(tcp_socket=listening, period_seconds=10),
        "liveness_probe": k8s.V1Probe(tcp_socket=listening, period_seconds=30, failure_threshold=4),
    }
    deployment = k8s.V1Deployment(
        api_version="apps/v1", kind="Deployment",
        metadata=k8s.V1ObjectMeta(name=name, namespace=settings.k8s_namespace, labels=labels),
        spec=k8s.V1DeploymentSpec(
            replicas=replicas,
            selector=k8s.V1LabelSelector(match_labels=selector),
            template=k8s.V1PodTemplateSpec(
                metadata=k8s.V1ObjectMeta(labels=labels),
                spec=pod_spec.gpu_pod(settings, gpu_type, gpus, container, termination_grace_period_seconds=grace_seconds),
            ),
        ),
    )
    service = k8s.V1Service(
        api_version="v1", kind="Service",
        metadata=k8s.V1ObjectMeta(name=name, namespace=settings.k8s_namespace, labels=labels),
        spec=k8s.V1ServiceSpec(selector=selector, ports=[k8s.V1ServicePort(name="shards", port=port,
                                                                           target_port="shards")]),
    )
    policy = k8s.V1NetworkPolicy(
        api_version="networking.k8s.io/v1", kind="NetworkPolicy",
        metadata=k8s.V1ObjectMeta(name=name, namespace=settings.k8s_namespace, labels=labels),
        spec=k8s.V1NetworkPolicySpec(
            pod_selector=k8s.V1LabelSelector(match_labels=selector),
            policy_types=["Ingress"],
            ingress=[k8s.V1NetworkPolicyIngressRule(
                _from=[k8s.V1NetworkPolicyPeer(pod_selector=k8s.V1LabelSelector(
                    match_labels=client_labels or DEFAULT_CLIENT_LABELS))],
                ports=[k8s.V1NetworkPolicyPort(port=port, protocol="TCP")],
            )],
        ),
    )
    return [ApiClient().sanitize_for_serialization(obj) for obj in (deployment, service, policy)]


def services_entry(settings: Settings, model: str, gpu_type: str | None, port: int = DEFAULT_PORT) -> dict[str, str]:
    """The LLM_BATCH_ENGINE_SERVICES entry that sends the model's small shards to this service."""
    key = f"{model}@{gpu_type}" if gpu_type else model
    return {key: f"{service_name(model, gpu_type)}.{settings.k8s_namespace}.svc:{port}"}
