"""ShardPodOperator: the KubernetesPodOperator behind KubernetesShardOperator (deferrable).

Imported only when a shard task runs (the Kubernetes client takes seconds to import, too
long for DAG parsing). The pod runs ``llm-batch worker ...`` in the inference image
(``Settings.worker_image``); its shape comes from ``pod_spec`` (GPU limits, node selector,
tolerations, labels, priority class, storage Secret, model cache). The pod is deleted when it finishes and when the task
is killed; its logs are followed into the task log.

While the pod runs, the deferred task waits in ``ShardPodTrigger``: the provider's pod
trigger plus the shard's stop watch, which mirrors the job's cancel flag to the cancel
marker the worker reads, and ends the wait with a kill (pod deleted) if the worker is still
running ``cancel_grace_seconds`` after a cancel or the deadline. Worker exits "cancelled"
and "deadline" (exit statuses 3 and 4) end the task well: merge reports what did not run.

Provider contract (``SUPPORTED_PROVIDER``, checked by tests/unit/test_kubernetes_pod_provider.py):
only the provider's public extension points are used - the documented constructor
parameters ``callbacks`` (``KubernetesPodOperatorCallback.on_pod_completion`` hands over the
finished pod, sync and deferrable) and ``trigger_kwargs`` (carries the stop watch's settings
to the trigger, and the provider merges them into every event), the overridable
``trigger_reentry`` and ``BaseOperator.defer`` (to swap in ``ShardPodTrigger``, built from the
provider trigger's own ``serialize()``), and ``KubernetesPodTrigger.run``. No private
attribute (``_fired_event``, ``remote_pod``) is read or written.
"""

from __future__ import annotations

import asyncio
from typing import Any

from airflow.providers.cncf.kubernetes.callbacks import KubernetesPodOperatorCallback
from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator
from airflow.providers.cncf.kubernetes.triggers.pod import KubernetesPodTrigger
from airflow.sdk.exceptions import AirflowException
from airflow.triggers.base import TriggerEvent

from llm_batch.airflow.operators.shard import ShardTaskMixin, shard_stop_of, watch_shard
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
    ShardPodOperator. The provider calls ``on_pod_completion`` once the pod is done: after
    the log follow in the sync path, at re-entry from the trigger in the deferrable one."""

    @staticmethod
    def on_pod_completion(*, pod: Any, operator: Any, **kwargs: Any) -> None:
        if isinstance(operator, ShardPodOperator):
            operator.completed_pod = pod


class ShardPodOperator(ShardTaskMixin, KubernetesPodOperator):
    """Run one shard (``shard_task``: a ``llm_batch.pipeline.shard_task.ShardTask`` as a dict) as a GPU pod.

    Any KubernetesPodOperator argument may be given to override what the settings and
    pod_spec produce. Raises
    ``pod_spec.UnsupportedPodShape`` for shards no single pod can run (nodes_per_worker > 1:
    ``kubernetes_group.ShardGroupOperator`` runs those).
    """

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
        self.bind_job_to_logs()
        self._context = context
        early = self.stop_before_start()
        if early is not None:
            return self.report_outcome(early, context).model_dump()
        try:
            super().execute(context)  # deferrable: raises TaskDeferred, resumes in trigger_reentry
        except AirflowException:
            return self._outcome_of_failed_pod()
        return self.finish(self.outcome(0, None), context)

    def trigger_reentry(self, context: Any, event: dict[str, Any]) -> Any:
        self._context = context
        self._stop_cause = event.get(STOP_KEY)
        try:
            super().trigger_reentry(context, event)
        except AirflowException:
            return self._outcome_of_failed_pod()
        return self.finish(self.outcome(0, None), context)

    def defer(self, *, trigger: Any, method_name: str, kwargs: dict[str, Any] | None = None, timeout: Any = None) -> None:
        """Wait in ShardPodTrigger instead of the provider's trigger: the same trigger, built
        from its own serialized arguments (its trigger_kwargs carry the stop watch's settings)."""
        if isinstance(trigger, KubernetesPodTrigger) and not isinstance(trigger, ShardPodTrigger):
            trigger = ShardPodTrigger(**trigger.serialize()[1])
        super().defer(trigger=trigger, method_name=method_name, kwargs=kwargs, timeout=timeout)

    # -- outcomes ---------------------------------------------------------------------

    def _outcome_of_failed_pod(self) -> dict[str, Any]:
        """A pod that did not succeed: stopped on purpose (a good end), or a failure."""
        if self._stop_cause is not None:
            return self.finish(self.outcome(None, self._stop_cause), self._context)
        outcome = self.outcome(_exit_code(self.completed_pod, self.base_container_name), None)
        if outcome.state == "done":  # the worker exited 0, yet the pod failed: the attempt fails
            self.report_outcome(outcome, self._context)
            raise AirflowException(outcome.message)
        return self.finish(outcome, self._context)


def _exit_code(pod: Any, container: str) -> int | None:
    statuses = (pod.status.container_statuses if pod is not None and pod.status else None) or []
    for status in statuses:
        if status.name == container and status.state and status.state.terminated:
            return status.state.terminated.exit_code
    return None


class ShardPodTrigger(KubernetesPodTrigger):
    """The provider's pod trigger, plus the shard's stop watch (see the module docstring).

    Takes the provider trigger's arguments; ``trigger_kwargs[SHARD_STOP_KEY]``: {job_id,
    shard, progress_uri, cancel_marker, deadline (ISO), grace_seconds}. The stop watch reads
    the job store of the triggerer's own settings (LLM_BATCH_DATABASE_URL) and this shard's
    progress object only.
    """

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
            # The provider's own events also set its private "event fired" flag; on Airflow
            # 3.3+ it only makes the trigger's on_kill (a user kill while run() still runs)
            # keep the pod. Not set here on purpose: the worker is past its grace, so a kill
            # landing as this event goes out should delete the pod (on_kill_action), as
            # trigger_reentry would.
            yield TriggerEvent(
                {
                    "status": "timeout",
                    "namespace": self.pod_namespace,
                    "name": self.pod_name,
                    "message": f"worker still running {self.shard_stop['grace_seconds']}s after the stop ({cause}): pod deleted",
                    "last_log_time": self.last_log_time,
                    STOP_KEY: cause,
                    **self.trigger_kwargs,
                }
            )
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
