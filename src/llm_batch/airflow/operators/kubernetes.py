"""KubernetesShardOperator: one shard as a GPU pod, with the same arguments as the local runner.

What the DAG holds is this light operator: importing the Kubernetes client and the pod
operator takes seconds, too long for DAG parsing, so the KubernetesPodOperator doing the
work (``kubernetes_pod.ShardPodOperator``: pod shape, deferral, logs, deletion) is built
only when the task runs, and every entry point Airflow calls is handed to it. A shard whose
worker spans several nodes (``nodes_per_worker > 1``) is handed to
``kubernetes_group.ShardGroupOperator`` instead: a LeaderWorkerSet, watched from the triggerer.
A small shard of a model with an engine service (``llm_batch.runtime.engine_service``) runs there,
on a warm engine, instead of a pod of its own (``engine_service.EngineServiceShardOperator``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperator

from llm_batch.airflow.operators.engine_service import EngineServiceShardOperator
from llm_batch.airflow.operators.shard import ShardTaskMixin
from llm_batch.runtime.engine_service import service_for

if TYPE_CHECKING:
    from llm_batch.core.config import Settings


class KubernetesShardOperator(ShardTaskMixin, BaseOperator):
    """Run one shard (``shard_task``: a ``llm_batch.pipeline.shard_task.ShardTask`` as a dict) as a GPU pod.

    ``pod_overrides``: KubernetesPodOperator arguments that replace what the settings
    produce (e.g. ``config_file``, ``deferrable``; a multi-node shard takes the connection's,
    ``deferrable`` and ``poll_interval``). Returns the shard's outcome dict; a worker failure raises (retry
    resumes), a usage error fails without retry. ``settings``: what it and the operator it
    builds run on (default: ``get_settings()``).
    """

    template_fields = ("shard_task",)
    ui_color = "#e8eef8"

    def __init__(self, *, shard_task: dict[str, Any], pod_overrides: dict[str, Any] | None = None,
                 settings: Settings | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.use_settings(settings)
        self.shard_task = shard_task
        self.pod_overrides = pod_overrides or {}
        self._pod_operator: Any = None

    def pod_operator(self) -> Any:
        """The operator running this shard (built once per task process): an
        EngineServiceShardOperator when its model's engine service takes it, else a
        KubernetesPodOperator, or a ShardGroupOperator for a multi-node worker."""
        if self._pod_operator is None:
            whole = self.shard.model_dump()  # the runners take the shard task itself
            if (address := service_for(self.shard, self.llm_settings)) is not None:
                self._pod_operator = EngineServiceShardOperator(
                    task_id=self.task_id, shard_task=whole, address=address, retries=self.retries,
                    settings=self.llm_settings,
                )
                self._pod_operator.llm_settings = self.llm_settings  # the settings that routed it
                return self._pod_operator
            if self.shard.nodes_per_worker > 1:
                from llm_batch.airflow.operators.kubernetes_group import ShardGroupOperator as runner  # kubernetes
            else:
                from llm_batch.airflow.operators.kubernetes_pod import ShardPodOperator as runner  # kubernetes

            self._pod_operator = runner(
                task_id=self.task_id, shard_task=whole, retries=self.retries, settings=self.llm_settings,
                **self.pod_overrides,
            )
        return self._pod_operator

    def execute(self, context: Any) -> dict[str, Any] | None:
        # Deferrable: raises TaskDeferred naming trigger_reentry, which Airflow calls on us.
        return self.pod_operator().execute(context)

    def trigger_reentry(self, context: Any, event: dict[str, Any]) -> Any:
        return self.pod_operator().trigger_reentry(context, event)

    def on_kill(self) -> None:
        if self._pod_operator is not None:
            self._pod_operator.on_kill()
