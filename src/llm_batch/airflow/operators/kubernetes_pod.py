"""ShardPodOperator: the deferrable KubernetesPodOperator behind KubernetesShardOperator
(docs/orchestration.md, "Shard runners"); the pod's shape is ``pod_spec``'s. While the pod
runs, the task waits in ``ShardPodTrigger``: the provider's pod trigger plus the shard's stop watch.

Provider contract (``SUPPORTED_PROVIDER``, tests/unit/test_kubernetes_pod_provider.py): only
public extension points are used (``callbacks``, ``trigger_kwargs``, ``trigger_reentry``,
``BaseOperator.defer``, ``KubernetesPodTrigger.run``); no private attribute is read or written."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from functools import partial
from typing import Any

from airflow.providers.cncf.kubernetes.callbacks import KubernetesPodOperatorCallback
from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator
from airflow.providers.cncf.kubernetes.triggers.pod import KubernetesPodTrigger
from airflow.sdk.exceptions import AirflowException
from airflow.triggers.base import TriggerEvent

from llm_batch.airflow.operators.shard import ShardTaskMixin, exit_code_of, shard_stop_of, watch_shard
from llm_batch.airflow.specs import pod_spec
from llm_batch.core.config import Settings, get_settings
from llm_batch.pipeline.shard_task import ShardTask

#: The apache-airflow-providers-cncf-kubernetes versions this module is written and tested
#: against (the pin of the ``airflow`` extra in pyproject.toml).
SUPPORTED_PROVIDER = ">=10.25.0,<11"

STOP_KEY = "llm_batch_stop"  # in the stop watch's event: the stop cause
SHARD_STOP_KEY = "llm_batch_shard_stop"  # in trigger_kwargs: the stop watch's settings


class _KeepCompletedPod(KubernetesPodOperatorCallback):
    """Keeps the finished pod (its container statuses hold the worker's exit code) on the
    ShardPodOperator: after the log follow (sync), at re-entry from the trigger (deferrable)."""

    @staticmethod
    def on_pod_completion(*, pod: Any, operator: Any, **kwargs: Any) -> None:
        if isinstance(operator, ShardPodOperator):
            operator.completed_pod = pod


class ShardPodOperator(ShardTaskMixin, KubernetesPodOperator):
    """Run one shard (``shard_task``) as a GPU pod; any KubernetesPodOperator argument overrides
    what the settings and pod_spec make. Raises ``pod_spec.UnsupportedPodShape`` for a shard no
    single pod can run."""

    template_fields = KubernetesPodOperator.template_fields
    ui_color = "#e8eef8"

    def __init__(self, *, shard_task: dict[str, Any], settings: Settings | None = None, **kwargs: Any) -> None:
        task, settings = ShardTask.model_validate(shard_task), settings or get_settings()
        pod_spec.check_single_pod(task)
        volumes, mounts = pod_spec.model_cache(settings)
        # Callbacks and trigger_kwargs given as overrides are kept, ours are added.
        callbacks = kwargs.pop("callbacks", None) or []
        callbacks = [*(callbacks if isinstance(callbacks, list) else [callbacks]), _KeepCompletedPod]
        shard_stop = shard_stop_of(task, settings)
        trigger_kwargs = {**(kwargs.pop("trigger_kwargs", None) or {}), SHARD_STOP_KEY: shard_stop}
        pod_args: dict[str, Any] = {
            "name": pod_spec.pod_name(task),
            "random_name_suffix": True,
            "namespace": settings.k8s_namespace,
            "image": settings.worker_image,
            "cmds": ["llm-batch"],
            "arguments": task.worker_args(),
            "env_vars": pod_spec.env_vars(task, settings),
            "env_from": pod_spec.env_from(settings),
            "container_resources": pod_spec.gpu_resources(task.gpu_type, task.gpus),
            "node_selector": pod_spec.node_selector(settings, task.gpu_type),
            "tolerations": pod_spec.gpu_tolerations(task.gpu_type),
            "labels": pod_spec.labels(task),
            "priority_class_name": pod_spec.priority_class(settings, task),
            "volumes": volumes,
            "volume_mounts": mounts,
            "kubernetes_conn_id": settings.k8s_conn_id,
            "on_finish_action": "delete_pod",
            "on_kill_action": "delete_pod",
            "get_logs": True,
            "deferrable": True,
            "do_xcom_push": False,  # the outcome is returned, not read from an XCom sidecar
            "durable": True,  # a restarted task finds its pod again instead of starting a twin
            "termination_grace_period": settings.cancel_grace_seconds,
            "startup_timeout_seconds": 900,  # image pulls of a vLLM image are slow
            "log_events_on_failure": True,
            "callbacks": callbacks,
            "trigger_kwargs": trigger_kwargs,
        }
        super().__init__(**{**pod_args, **kwargs})
        self.use_settings(settings)
        self.shard_task = shard_task
        self.completed_pod: Any = None  # set by _KeepCompletedPod
        self._stop_cause: str | None = None
        self._context: Any = None

    def execute(self, context: Any) -> dict[str, Any] | None:
        self._context = context
        if (ended := self.ended_before_start(context)) is not None:
            return ended
        # Deferrable: raises TaskDeferred, resumes in trigger_reentry.
        return self._outcome_of_pod(partial(super().execute, context))

    def trigger_reentry(self, context: Any, event: dict[str, Any]) -> Any:
        self._context = context
        self._stop_cause = event.get(STOP_KEY)
        return self._outcome_of_pod(partial(super().trigger_reentry, context, event))

    def defer(self, *, trigger: Any, method_name: str, kwargs: dict[str, Any] | None = None, timeout: Any = None) -> None:
        """Wait in ShardPodTrigger, built from the provider trigger's own serialized arguments."""
        if isinstance(trigger, KubernetesPodTrigger) and not isinstance(trigger, ShardPodTrigger):
            trigger = ShardPodTrigger(**trigger.serialize()[1])
        super().defer(trigger=trigger, method_name=method_name, kwargs=kwargs, timeout=timeout)

    def _outcome_of_pod(self, run: Callable[[], Any]) -> dict[str, Any]:
        """The outcome of the provider's `run` of the pod: a pod stopped on purpose ends well;
        one whose worker exited 0 yet failed fails the attempt."""
        try:
            run()
        except AirflowException:
            if self._stop_cause is not None:
                return self.finish(self.outcome(None, self._stop_cause), self._context)
            outcome = self.outcome(exit_code_of(self.completed_pod, self.base_container_name), None)
            if outcome.state == "done":
                self.report_outcome(outcome, self._context)
                raise AirflowException(outcome.message) from None
            return self.finish(outcome, self._context)
        return self.finish(self.outcome(0, None), self._context)


class ShardPodTrigger(KubernetesPodTrigger):
    """The provider's pod trigger plus the shard's stop watch (``trigger_kwargs[SHARD_STOP_KEY]``:
    ``shard_stop_of``'s dict), which reads the triggerer's own job store."""

    def __init__(self, *, shard_stop: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if shard_stop is not None:  # serialized before the settings moved into trigger_kwargs
            kwargs["trigger_kwargs"] = {**(kwargs.get("trigger_kwargs") or {}), SHARD_STOP_KEY: shard_stop}
        super().__init__(**kwargs)

    @property
    def shard_stop(self) -> dict[str, Any]:
        return self.trigger_kwargs[SHARD_STOP_KEY]

    def serialize(self) -> tuple[str, dict[str, Any]]:
        _, kwargs = super().serialize()
        return f"{__name__}.ShardPodTrigger", kwargs

    async def run(self):  # type: ignore[override]
        pod_events = super().run()
        pod_event = asyncio.ensure_future(anext(pod_events))
        stop = asyncio.ensure_future(self._stop_after_grace())
        try:
            done, _ = await asyncio.wait({pod_event, stop}, return_when=asyncio.FIRST_COMPLETED)
            if pod_event in done:
                yield pod_event.result()
                return
            cause = stop.result()
            pod_event.cancel()
            # The provider's private "event fired" flag is not set on purpose: it makes a kill
            # landing now keep the pod (Airflow 3.3+), and a worker past its grace must go.
            message = f"worker still running {self.shard_stop['grace_seconds']}s after the stop ({cause}): pod deleted"
            yield TriggerEvent({"status": "timeout", "namespace": self.pod_namespace, "name": self.pod_name,
                                "message": message, "last_log_time": self.last_log_time, STOP_KEY: cause,
                                **self.trigger_kwargs})
        finally:
            stop.cancel()
            pod_event.cancel()

    async def _stop_after_grace(self) -> str:
        """Returns the cause once a stop (cancel or deadline) is older than the grace."""
        seen_at: float | None = None
        cause: str | None = None
        loop = asyncio.get_running_loop()
        while True:
            if cause is None:
                cause = await asyncio.to_thread(watch_shard, self.shard_stop)
                seen_at = loop.time() if cause else None
            elif loop.time() - (seen_at or 0) >= self.shard_stop["grace_seconds"]:
                return cause
            await asyncio.sleep(self.poll_interval)
