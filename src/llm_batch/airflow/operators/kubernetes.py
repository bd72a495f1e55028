"""KubernetesShardOperator: one shard on Kubernetes, with the same arguments as the local runner.

A light operator for the DAG (the Kubernetes client takes seconds to import, too long for
parsing): the operator doing the work is built when the task runs (an engine service's, a
LeaderWorkerSet's or a single pod's) and handed every entry point Airflow calls. A small shard
goes to its model's engine service (``llm_batch.runtime.warm_engines``) over TCP, supervised
as the local runner's warm-engine path (a kill leaves the host warm)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperator

from llm_batch.airflow.operators.local import LocalShardOperator
from llm_batch.airflow.operators.shard import ShardTaskMixin
from llm_batch.runtime.warm_engines import WarmShard, service_for, start_service_shard

if TYPE_CHECKING:
    from llm_batch.core.config import Settings


class EngineServiceShardOperator(LocalShardOperator):
    """Run one shard (``shard_task``) on the engine service at ``address`` (host, port)."""

    def __init__(self, *, shard_task: dict[str, Any], address: tuple[str, int], **kwargs: Any) -> None:
        super().__init__(shard_task=shard_task, **kwargs)
        self.address = tuple(address)

    def execute(self, context: Any) -> dict[str, Any]:
        token = self.llm_settings.engine_token
        if token is None or not token.get_secret_value():
            # Configuration, not a passing failure: fails without a retry, saying what to set.
            return self.refuse(f"LLM_BATCH_ENGINE_SERVICES sends this shard to {self.address[0]}:{self.address[1]}, "
                               "but LLM_BATCH_ENGINE_TOKEN is not set on this worker", context)
        return super().execute(context)

    def on_warm_engine(self) -> bool:
        return True

    def _start_warm(self) -> WarmShard:
        token = self.llm_settings.engine_token
        assert token is not None  # execute checked
        self.log.info("handing shard %s to engine service %s:%s", self.shard.shard, *self.address)
        return start_service_shard(self.address, token.get_secret_value(), self.shard.worker_args(), self._log_line)


class KubernetesShardOperator(ShardTaskMixin, BaseOperator):
    """Run one shard (``shard_task``: a ``steps.shard_ref`` or a whole ShardTask, as a dict).

    ``pod_overrides``: KubernetesPodOperator arguments that replace what the settings produce
    (e.g. ``config_file``, ``deferrable``; a multi-node shard takes the connection's,
    ``deferrable`` and ``poll_interval``). ``settings``: what it and the operator it builds run
    on (default: ``get_settings()``). Returns the shard's outcome dict; a worker failure raises
    (retry resumes), a usage error fails without retry.
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
        """The operator running this shard, built once per task process."""
        if self._pod_operator is None:
            # The runners take the shard task itself.
            args = {"task_id": self.task_id, "shard_task": self.shard.model_dump(), "retries": self.retries,
                    "settings": self.llm_settings}
            if (address := service_for(self.shard, self.llm_settings)) is not None:
                self._pod_operator = EngineServiceShardOperator(address=address, **args)
            elif self.shard.nodes_per_worker > 1:
                from llm_batch.airflow.operators.kubernetes_group import ShardGroupOperator  # kubernetes

                self._pod_operator = ShardGroupOperator(**args, **self.pod_overrides)
            else:
                from llm_batch.airflow.operators.kubernetes_pod import ShardPodOperator  # kubernetes

                self._pod_operator = ShardPodOperator(**args, **self.pod_overrides)
        return self._pod_operator

    def execute(self, context: Any) -> dict[str, Any] | None:
        # Deferrable: raises TaskDeferred naming trigger_reentry, which Airflow calls on us.
        return self.pod_operator().execute(context)

    def trigger_reentry(self, context: Any, event: dict[str, Any]) -> Any:
        return self.pod_operator().trigger_reentry(context, event)

    def on_kill(self) -> None:
        if self._pod_operator is not None:
            self._pod_operator.on_kill()
