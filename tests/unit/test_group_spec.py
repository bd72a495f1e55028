"""The LeaderWorkerSet of a multi-node shard worker, rendered offline for every gpu_type and
validated strictly against the LWS CRD's schema (pinned release, tests/fixtures/lws/) and
its pod templates against the Kubernetes schema the single pod is validated against."""

from __future__ import annotations

import pytest

pytest.importorskip("airflow.providers.cncf.kubernetes")

from llm_batch.airflow.specs import group_spec, pod_spec  # noqa: E402
from llm_batch.core.placement import GPU_TYPES  # noqa: E402
from tests.fixtures.lws_schema import lws_errors  # noqa: E402
from tests.unit.test_pod_spec import _task, settings  # noqa: E402,F401 - the same shard and settings


def _containers(body: dict) -> tuple[dict, dict]:
    template = body["spec"]["leaderWorkerTemplate"]
    return (template["leaderTemplate"]["spec"]["containers"][0], template["workerTemplate"]["spec"]["containers"][0])


@pytest.mark.parametrize("gpu_type", GPU_TYPES)
def test_group_for_every_gpu_type_is_valid_strict(settings, gpu_type):  # noqa: F811
    task = _task(gpu_type=gpu_type, gpus=4, nodes_per_worker=2)
    body = group_spec.leader_worker_set(task, settings, group_spec.set_name(task))

    assert lws_errors(body) == []
    template = body["spec"]["leaderWorkerTemplate"]
    assert (body["spec"]["replicas"], template["size"], template["restartPolicy"]) == (1, 2, "None")
    resource = pod_spec.MIG_RESOURCES.get(gpu_type, "nvidia.com/gpu")
    leader, follower = _containers(body)
    for role, key, container in (("leader", "leaderTemplate", leader), ("follower", "workerTemplate", follower)):
        assert container["resources"]["limits"] == {resource: "4"}  # GPUs per pod: tensor parallel inside it
        assert container["command"] == ["llm-batch"] and container["image"] == settings.worker_image
        assert container["envFrom"] == [{"secretRef": {"name": settings.storage_secret_name}}]
        assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
        pod = template[key]
        assert pod["metadata"]["labels"]["llm-batch.io/job"] == "job_0123abcd"
        assert pod["metadata"]["labels"]["llm-batch.io/role"] == role
        assert pod["spec"]["priorityClassName"] == "llm-batch-high"
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["spec"]["tolerations"]
    # The leader runs the shard worker, node 0 of the group; the follower joins it.
    assert leader["args"][:5] == ["worker", "--job-id", "job_0123abcd", "--shard", "3"]
    assert _flags(leader["args"]) >= {"--nnodes": "2", "--master-addr": "$(LWS_LEADER_ADDRESS)", "--gpus-per-node": "4"}.items()
    assert follower["args"][0] == "worker-follower"
    assert _flags(follower["args"]) >= {"--node-rank": "$(LWS_WORKER_INDEX)", "--nnodes": "2",
                                        "--master-addr": "$(LWS_LEADER_ADDRESS)", "--endpoint": "/v1/chat/completions",
                                        "--model-config": task.model_config_json}.items()


def _flags(args: list[str]) -> set[tuple[str, str]]:
    return {(flag, value) for flag, value in zip(args, args[1:], strict=False) if flag.startswith("--")}


def test_the_schema_check_is_strict(settings):  # noqa: F811
    """The validator refuses what an API server with the CRD would: an unknown field in
    the set, a bad enum, an unknown field in a pod template."""
    task = _task(nodes_per_worker=3)
    body = group_spec.leader_worker_set(task, settings, "llm-batch-x-3-abc123")
    assert lws_errors(body) == []
    body["spec"]["leaderWorkerTemplate"]["restartPolicy"] = "Sometimes"
    body["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["gpus"] = 1
    body["spec"]["surprise"] = True
    errors = " | ".join(lws_errors(body))
    assert "'Sometimes' is not one of" in errors and "'surprise' was unexpected" in errors
    assert "'gpus' was unexpected" in errors
    assert any("DNS-1035" in e for e in lws_errors({**body, "metadata": {"name": "3-starts-with-a-digit"}}))


def test_a_topology_key_keeps_the_group_in_one_domain(settings):  # noqa: F811
    task = _task(nodes_per_worker=2)
    assert "annotations" not in group_spec.leader_worker_set(task, settings, "llm-batch-a")["metadata"]
    racked = settings.model_copy(update={"group_topology_key": "cloud.example.com/rack"})
    body = group_spec.leader_worker_set(task, racked, "llm-batch-a")
    assert body["metadata"]["annotations"] == {"leaderworkerset.sigs.k8s.io/exclusive-topology": "cloud.example.com/rack"}
    assert lws_errors(body) == []


def test_set_names_are_fresh_and_short(settings):  # noqa: F811
    task = _task(job_id="job_" + "x" * 80, nodes_per_worker=16)
    names = {group_spec.set_name(task) for _ in range(5)}
    assert len(names) == 5
    assert all(len(name) <= 45 and pod_spec.label_value(name) == name for name in names)
    body = group_spec.leader_worker_set(task, settings, names.pop())
    assert lws_errors(body) == []
