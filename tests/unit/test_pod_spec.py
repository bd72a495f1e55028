"""Shard pods rendered offline for every gpu_type and validated strictly against the
Kubernetes schema (kubernetes-validate), plus the shape rules of pod_spec."""

from __future__ import annotations

import pytest

pytest.importorskip("airflow.providers.cncf.kubernetes")

import kubernetes_validate  # noqa: E402
from kubernetes.client import ApiClient  # noqa: E402

from llm_batch.airflow.operators.kubernetes import KubernetesShardOperator  # noqa: E402
from llm_batch.airflow.specs import pod_spec  # noqa: E402
from llm_batch.core.config import Settings  # noqa: E402
from llm_batch.core.placement import GPU_TYPES
from llm_batch.pipeline.shard_task import ShardTask  # noqa: E402

K8S_VERSION = "1.37.0"


def _task(**changes) -> ShardTask:
    values = dict(
        job_id="job_0123abcd",
        shard=3,
        requests_uri="s3://work/job_0123abcd/shards/00003/requests.jsonl",
        results_uri="s3://work/job_0123abcd/shards/00003/results",
        progress_uri="s3://work/job_0123abcd/shards/00003/progress.json",
        cancel_marker="s3://work/job_0123abcd/cancel",
        endpoint="/v1/chat/completions",
        model_config_json='{"model": "smollm2-135m-instruct", "num_shards": 2}',
        deadline="2030-01-01T00:00:00+00:00",
        gpus=2,
        gpu_type="nvidia-ampere-a100",
        priority="high",
        labels={"team": "search ranking", "cost/center": "42"},
    )
    return ShardTask(**{**values, **changes})


@pytest.fixture
def settings() -> Settings:
    return Settings(work_uri="s3://work", priority_classes={"high": "llm-batch-high"},
                    gpu_node_label_key="cloud.example.com/accelerator",
                    gpu_node_label_values={"nvidia-tesla-t4": "t4"})


def _render(task: ShardTask, settings: Settings) -> dict:
    operator = KubernetesShardOperator(task_id="run_shard", shard_task=task.model_dump(), settings=settings)
    pod = operator.pod_operator().build_pod_request_obj(dry_run=True)  # no cluster: nothing may call it
    return ApiClient().sanitize_for_serialization(pod)


@pytest.mark.parametrize("gpu_type", GPU_TYPES)
def test_pod_for_every_gpu_type_is_valid_strict(settings, gpu_type):
    task = _task(gpu_type=gpu_type)
    pod = _render(task, settings)
    kubernetes_validate.validate(pod, K8S_VERSION, strict=True)

    spec = pod["spec"]
    container = spec["containers"][0]
    resource = pod_spec.MIG_RESOURCES.get(gpu_type, "nvidia.com/gpu")
    assert container["resources"]["limits"] == {resource: "2"}
    assert container["image"] == settings.worker_image
    assert container["command"] == ["llm-batch"]
    assert container["args"][:5] == ["worker", "--job-id", "job_0123abcd", "--shard", "3"]
    assert spec["nodeSelector"] == {
        "cloud.example.com/accelerator": "t4" if gpu_type == "nvidia-tesla-t4" else gpu_type
    }
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    assert spec["priorityClassName"] == "llm-batch-high"
    labels = pod["metadata"]["labels"]
    assert labels["llm-batch.io/job"] == "job_0123abcd" and labels["llm-batch.io/shard"] == "3"
    assert labels["llm-batch.io.user/team"] == "search-ranking"
    # Credentials only by reference to the Secret, never as values.
    assert container["envFrom"] == [{"secretRef": {"name": settings.storage_secret_name}}]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["LLM_BATCH_JOB_ID"] == "job_0123abcd" and env["LLM_BATCH_SHARD"] == "3"
    assert not any("SECRET" in name or "KEY" in name for name in env)
    assert spec["volumes"][0]["persistentVolumeClaim"]["claimName"] == settings.model_cache_claim
    assert container["volumeMounts"][0]["mountPath"] == settings.model_cache_mount_path


def test_a_single_pod_refuses_a_multi_node_shard(settings):
    """nodes_per_worker > 1 goes to the group runner (tests/unit/test_group_spec.py); the pod
    operator itself never spans nodes."""
    from llm_batch.airflow.operators.kubernetes_group import ShardGroupOperator
    from llm_batch.airflow.operators.kubernetes_pod import ShardPodOperator

    task = _task(nodes_per_worker=2).model_dump()
    operator = KubernetesShardOperator(task_id="run_shard", shard_task=task, settings=settings)
    assert isinstance(operator.pod_operator(), ShardGroupOperator)
    with pytest.raises(pod_spec.UnsupportedPodShape, match="nodes_per_worker=2: one pod cannot span nodes"):
        ShardPodOperator(task_id="run_shard", shard_task=task, settings=settings)


def test_label_values_are_made_valid():
    assert pod_spec.label_value("a b/c" * 30).endswith("c") or len(pod_spec.label_value("a b/c" * 30)) <= 63
    assert len(pod_spec.label_value("x" * 100)) == 63
    assert pod_spec.label_value("-job_1-") == "job_1"


def test_no_gpu_type_means_no_node_selector(settings):
    pod = _render(_task(gpu_type=None, gpus=1), settings)
    kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
    assert not pod["spec"].get("nodeSelector")
    assert pod["spec"]["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "1"}


def test_operator_is_deferrable_and_deletes_its_pod(settings):
    operator = KubernetesShardOperator(task_id="run_shard", shard_task=_task().model_dump(),
                                       settings=settings).pod_operator()
    assert operator.deferrable is True
    assert operator.on_finish_action.value == "delete_pod"
    assert operator.get_logs is True
