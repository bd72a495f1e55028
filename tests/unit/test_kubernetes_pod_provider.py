"""The provider contract of src/llm_batch/airflow/operators/kubernetes_pod.py, checked without a cluster.

Fails loudly when the installed apache-airflow-providers-cncf-kubernetes leaves
``SUPPORTED_PROVIDER`` or changes one of the extension points ShardPodOperator and
ShardPodTrigger are built on (documented parameters, callbacks, overridable methods). The
behaviour behind them (the provider calling the callback, deferring through ``defer``, the
event keys ``trigger_reentry`` reads) is exercised against the API stub in
tests/integration/test_k8s_stub.py.
"""

from __future__ import annotations

import inspect
from datetime import UTC, datetime
from importlib.metadata import version

import pytest

pytest.importorskip("airflow.providers.cncf.kubernetes")

from packaging.specifiers import SpecifierSet  # noqa: E402
from packaging.version import Version  # noqa: E402

pytestmark = [pytest.mark.airflow]

PROVIDER = "apache-airflow-providers-cncf-kubernetes"
MOVED = "the provider changed an extension point kubernetes_pod.py relies on: adapt it, then SUPPORTED_PROVIDER"


def _keyword_params(func) -> set[str]:
    return {
        name for name, p in inspect.signature(func).parameters.items()
        if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
    }


def _accepts_any_keyword(func) -> bool:
    return any(p.kind is p.VAR_KEYWORD for p in inspect.signature(func).parameters.values())


def test_installed_provider_is_in_the_supported_range():
    from llm_batch.airflow.operators.kubernetes_pod import SUPPORTED_PROVIDER

    installed = version(PROVIDER)
    assert Version(installed) in SpecifierSet(SUPPORTED_PROVIDER), (
        f"{PROVIDER} {installed} is outside SUPPORTED_PROVIDER {SUPPORTED_PROVIDER!r}: check the "
        "extension points in this file against it, then move SUPPORTED_PROVIDER and the pyproject.toml pin"
    )


def test_operator_parameters_and_overridden_methods():
    from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator
    from airflow.sdk import BaseOperator

    assert {"callbacks", "trigger_kwargs"} <= _keyword_params(KubernetesPodOperator.__init__), MOVED
    assert list(inspect.signature(KubernetesPodOperator.trigger_reentry).parameters) == ["self", "context", "event"], MOVED
    # ShardPodOperator.defer keeps BaseOperator's keyword-only signature.
    defer = inspect.signature(BaseOperator.defer).parameters
    assert list(defer) == ["self", "trigger", "method_name", "kwargs", "timeout"], MOVED
    assert all(defer[name].kind is inspect.Parameter.KEYWORD_ONLY for name in list(defer)[1:]), MOVED


def test_on_pod_completion_callback_hands_over_pod_and_operator():
    from airflow.providers.cncf.kubernetes.callbacks import KubernetesPodOperatorCallback

    from llm_batch.airflow.operators.kubernetes_pod import _KeepCompletedPod

    provider = inspect.signature(KubernetesPodOperatorCallback.on_pod_completion).parameters
    assert {"pod", "operator"} <= {n for n, p in provider.items() if p.kind is p.KEYWORD_ONLY}, MOVED
    assert isinstance(inspect.getattr_static(KubernetesPodOperatorCallback, "on_pod_completion"), staticmethod), MOVED
    # Ours takes whatever else the provider passes (client, mode, context, ...).
    assert _accepts_any_keyword(_KeepCompletedPod.on_pod_completion)


def test_trigger_parameters_are_kept_as_public_attributes():
    """ShardPodTrigger's stop event reads these, each a documented constructor parameter."""
    from airflow.providers.cncf.kubernetes.triggers.pod import KubernetesPodTrigger

    wanted = {"pod_name", "pod_namespace", "poll_interval", "last_log_time", "trigger_kwargs"}
    assert wanted <= _keyword_params(KubernetesPodTrigger.__init__), MOVED
    trigger = KubernetesPodTrigger(
        pod_name="p", pod_namespace="ns", trigger_start_time=datetime.now(UTC), base_container_name="base",
        poll_interval=0.5, trigger_kwargs={"k": "v"},
    )
    assert (trigger.pod_name, trigger.pod_namespace, trigger.poll_interval) == ("p", "ns", 0.5), MOVED
    assert trigger.last_log_time is None and trigger.trigger_kwargs == {"k": "v"}, MOVED
    assert trigger.serialize()[1]["trigger_kwargs"] == {"k": "v"}, MOVED  # what ShardPodTrigger is built from


def _provider_trigger_kwargs(**trigger_kwargs):
    from airflow.providers.cncf.kubernetes.triggers.pod import KubernetesPodTrigger

    return KubernetesPodTrigger(
        pod_name="p", pod_namespace="ns", trigger_start_time=datetime.now(UTC), base_container_name="base",
        trigger_kwargs=trigger_kwargs,
    ).serialize()[1]


STOP = {"job_id": "j", "shard": 0, "progress_uri": "file:///p", "cancel_marker": "file:///c",
        "deadline": "2099-01-01T00:00:00+00:00", "grace_seconds": 1}


def test_shard_trigger_is_the_provider_trigger_with_our_classpath():
    from llm_batch.airflow.operators.kubernetes_pod import SHARD_STOP_KEY, ShardPodTrigger

    kwargs = _provider_trigger_kwargs(**{SHARD_STOP_KEY: STOP, "_redefer_count": 1})
    classpath, again = ShardPodTrigger(**kwargs).serialize()
    assert classpath == "llm_batch.airflow.operators.kubernetes_pod.ShardPodTrigger"
    assert again == kwargs  # nothing added: the provider's own arguments round-trip
    assert ShardPodTrigger(**again).shard_stop == STOP


def test_shard_trigger_serialized_by_the_previous_version_still_loads():
    """Deferred tasks from before the stop watch moved into trigger_kwargs carry `shard_stop`."""
    from llm_batch.airflow.operators.kubernetes_pod import SHARD_STOP_KEY, ShardPodTrigger

    trigger = ShardPodTrigger(shard_stop=STOP, **_provider_trigger_kwargs())
    assert trigger.shard_stop == STOP
    assert trigger.serialize()[1]["trigger_kwargs"] == {SHARD_STOP_KEY: STOP}


def test_operator_adds_its_callback_and_trigger_kwargs_to_overrides():
    from airflow.providers.cncf.kubernetes.callbacks import KubernetesPodOperatorCallback

    from llm_batch.airflow.operators.kubernetes_pod import SHARD_STOP_KEY, ShardPodOperator, _KeepCompletedPod
    from llm_batch.pipeline.shard_task import ShardTask

    class Theirs(KubernetesPodOperatorCallback):
        pass

    shard = ShardTask(
        job_id="j", shard=0, requests_uri="file:///r", results_uri="file:///res", progress_uri="file:///p",
        cancel_marker="file:///c", endpoint="/v1/chat/completions", model_config_json='{"model": "m"}',
        deadline="2099-01-01T00:00:00+00:00", gpu_type="nvidia-tesla-t4",
    ).model_dump()
    operator = ShardPodOperator(task_id="t", shard_task=shard, callbacks=Theirs, trigger_kwargs={"k": "v"})
    assert operator.callbacks == [Theirs, _KeepCompletedPod]
    assert operator.trigger_kwargs["k"] == "v" and operator.trigger_kwargs[SHARD_STOP_KEY]["job_id"] == "j"
    assert operator.completed_pod is None

    _KeepCompletedPod.on_pod_completion(pod="the pod", operator=operator, client=None, mode="sync", context={})
    assert operator.completed_pod == "the pod"
