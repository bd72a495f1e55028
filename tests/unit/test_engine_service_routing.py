"""Engine services without an engine: which shards go to them, their settings, the operator's
choice, and the Deployment, Service and NetworkPolicy rendered offline and validated strictly
against the Kubernetes schema (kubernetes-validate). The service itself, with the real engine,
is tested in tests/engine/test_engine_service.py."""

from __future__ import annotations

import re

import orjson
import pytest
import yaml

pytest.importorskip("airflow.providers.cncf.kubernetes")

import kubernetes_validate  # noqa: E402
from airflow.sdk.exceptions import AirflowFailException  # noqa: E402
from pydantic import ValidationError  # noqa: E402

from llm_batch.airflow.operators.kubernetes import EngineServiceShardOperator, KubernetesShardOperator  # noqa: E402
from llm_batch.airflow.operators.kubernetes_pod import ShardPodOperator  # noqa: E402
from llm_batch.airflow.specs.engine_service_spec import manifests, service_name, services_entry  # noqa: E402
from llm_batch.cli.main import main  # noqa: E402
from llm_batch.core.config import Settings, parse_address, settings_from_env  # noqa: E402
from llm_batch.core.placement import GPU_TYPES  # noqa: E402
from llm_batch.pipeline.shard_task import ShardTask  # noqa: E402
from llm_batch.runtime.warm_engines import service_for  # noqa: E402

K8S_VERSION = "1.37.0"
SERVICES = {"smollm2-135m-instruct": "engines.llm.svc:8700",
            "smollm2-135m-instruct@nvidia-hopper-h100": "h100-engines.llm.svc:8701"}


def _task(**changes) -> ShardTask:
    values = dict(job_id="job_1", shard=0, requests_uri="s3://work/job_1/shards/00000/requests.jsonl",
                  results_uri="s3://work/job_1/shards/00000/results",
                  progress_uri="s3://work/job_1/shards/00000/progress.json", cancel_marker="s3://work/job_1/cancel",
                  endpoint="/v1/chat/completions", model_config_json='{"model": "smollm2-135m-instruct"}',
                  deadline="2030-01-01T00:00:00+00:00", gpu_type="nvidia-ampere-a10", requests=24)
    return ShardTask(**{**values, **changes})


def _settings(**changes) -> Settings:
    return Settings(**{"engine_services": SERVICES, "engine_token": "t", **changes})


@pytest.mark.parametrize("text, address", [("engines.llm.svc:8700", ("engines.llm.svc", 8700)),
                                           ("10.0.0.7:1", ("10.0.0.7", 1)), ("[::1]:8700", ("::1", 8700))])
def test_addresses(text, address):
    assert parse_address(text) == address


@pytest.mark.parametrize("text", ["engines", "engines:", ":8700", "engines:http", "engines:0", "engines:70000",
                                  "engines:-1"])
def test_bad_addresses_are_refused_with_what_is_wrong(text):
    with pytest.raises(ValueError, match="host:port"):
        parse_address(text)


def test_a_bad_address_in_the_settings_fails_them_naming_the_entry():
    with pytest.raises(ValidationError, match=r"engine_services\['m'\]"):
        settings_from_env({"LLM_BATCH_ENGINE_SERVICES": '{"m": "engines"}'})
    settings = settings_from_env({"LLM_BATCH_ENGINE_SERVICES": orjson.dumps(SERVICES).decode(),
                                  "LLM_BATCH_ENGINE_TOKEN": "s3cret"})
    assert settings.engine_services == SERVICES and settings.engine_token.get_secret_value() == "s3cret"
    assert "s3cret" not in repr(settings)


def test_small_shards_of_a_served_model_go_to_its_service():
    settings = _settings()
    assert service_for(_task(), settings) == ("engines.llm.svc", 8700)
    assert service_for(_task(gpu_type="nvidia-hopper-h100"), settings) == ("h100-engines.llm.svc", 8701)
    assert service_for(_task(requests=settings.engine_service_max_requests), settings) is not None


@pytest.mark.parametrize("changes, why", [
    ({"requests": 257}, "more requests than engine_service_max_requests: a pod of its own"),
    ({"requests": None}, "planned before shards were counted"),
    ({"nodes_per_worker": 2}, "a multi-node worker"),
    ({"model_config_json": '{"model": "qwen2.5-0.5b-instruct"}'}, "a model without a service"),
])
def test_other_shards_get_pods(changes, why):
    assert service_for(_task(**changes), _settings()) is None, why


def test_no_services_no_routing():
    assert service_for(_task(), Settings()) is None


def test_the_kubernetes_operator_picks_the_service_or_a_pod():
    settings = Settings(engine_services=SERVICES)
    small = KubernetesShardOperator(task_id="run_shard", shard_task=_task().model_dump(), settings=settings)
    big = KubernetesShardOperator(task_id="run_shard", shard_task=_task(requests=10_000).model_dump(),
                                  settings=settings)
    assert isinstance(small.pod_operator(), EngineServiceShardOperator)
    assert small.pod_operator().address == ("engines.llm.svc", 8700)
    assert isinstance(big.pod_operator(), ShardPodOperator)


def test_a_worker_without_the_token_fails_the_shard_saying_what_to_set():
    operator = EngineServiceShardOperator(task_id="run_shard", shard_task=_task().model_dump(),
                                          address=("engines.llm.svc", 8700), settings=Settings(engine_services=SERVICES))
    operator.stop_before_start = lambda: None  # no job store here
    with pytest.raises(AirflowFailException, match="LLM_BATCH_ENGINE_TOKEN is not set"):
        operator.execute({})


@pytest.mark.parametrize("gpu_type", [None, *GPU_TYPES])
def test_manifests_for_every_gpu_type_are_valid_strict(gpu_type):
    settings = Settings(work_uri="s3://work", allowed_buckets="work,inputs", s3_endpoint_url="http://s3:8333")
    deployment, service, policy = manifests(settings, "smollm2-135m-instruct", gpu_type, gpus=2, replicas=3,
                                            seats=4, port=8711)
    for obj in (deployment, service, policy):
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    assert [o["kind"] for o in (deployment, service, policy)] == ["Deployment", "Service", "NetworkPolicy"]
    pod = deployment["spec"]["template"]
    container = pod["spec"]["containers"][0]
    assert container["args"] == ["engine-host", "--listen", "0.0.0.0:8711", "--model", "smollm2-135m-instruct",
                                 "--seats", "4", "--preload", "{}"]
    assert container["startupProbe"]["failureThreshold"] * container["startupProbe"]["periodSeconds"] >= 600
    token = next(e for e in container["env"] if e["name"] == "LLM_BATCH_ENGINE_TOKEN")
    assert "value" not in token and token["valueFrom"]["secretKeyRef"] == {"name": "llm-batch-engine-token",
                                                                           "key": "token"}
    assert sum(int(v) for v in container["resources"]["limits"].values()) == 2
    assert deployment["spec"]["replicas"] == 3
    # The Service and the policy reach exactly the Deployment's pods.
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert selector.items() <= pod["metadata"]["labels"].items()
    assert service["spec"]["selector"] == selector == policy["spec"]["podSelector"]["matchLabels"]
    assert policy["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"] == {"component": "worker",
                                                                                     "tier": "airflow"}
    if gpu_type is not None:
        assert gpu_type in pod["spec"]["nodeSelector"].values()
    (key, address), = services_entry(settings, "smollm2-135m-instruct", gpu_type, 8711).items()
    assert parse_address(address) == (f"{service['metadata']['name']}.default.svc", 8711)
    assert service_for(_task(gpu_type=gpu_type), Settings(engine_services={key: address})) is not None


def test_long_names_stay_valid_and_distinct():
    long_a, long_b = "org/" + "a" * 80 + "-v1", "org/" + "a" * 80 + "-v2"
    names = {service_name(model, "nvidia-hopper-h100-3g40gb") for model in (long_a, long_b)}
    assert len(names) == 2
    assert all(len(name) <= 63 and re.fullmatch(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?", name) for name in names)


def test_the_manifest_command(capsys):
    assert main(["engine-service", "manifest", "--model", "smollm2-135m-instruct", "--gpu-type",
                 "nvidia-ampere-a10", "--replicas", "2", "--client-label", "app=airflow-worker"]) == 0
    out, err = capsys.readouterr()
    objects = list(yaml.safe_load_all(out))
    assert [o["kind"] for o in objects] == ["Deployment", "Service", "NetworkPolicy"]
    assert objects[2]["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"] == {"app": "airflow-worker"}
    assert "LLM_BATCH_ENGINE_SERVICES=" in err and "smollm2-135m-instruct@nvidia-ampere-a10" in err
    assert main(["engine-service", "manifest", "--model", "m", "--no-preload"]) == 0
    assert "--preload" not in yaml.safe_load_all(capsys.readouterr().out).__next__()["spec"]["template"]["spec"][
        "containers"][0]["args"]


@pytest.mark.parametrize("args, what", [(["--gpu-type", "tpu"], "--gpu-type"), (["--seats", "0"], "--seats"),
                                        (["--port", "70000"], "--port"), (["--client-label", "x"], "KEY=VALUE"),
                                        (["--preload-config", "[1]"], "--preload-config"),
                                        (["--preload-config", "{"], "--preload-config")])
def test_the_manifest_command_refuses_bad_flags(capsys, args, what):
    assert main(["engine-service", "manifest", "--model", "m", *args]) == 2
    assert what in capsys.readouterr().err
