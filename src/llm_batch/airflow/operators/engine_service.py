"""EngineServiceShardOperator: one small shard on its model's engine service
(``llm_batch.runtime.engine_service``), reached over TCP and supervised as the local runner's
warm-engine path (a kill leaves the host warm).
"""

from __future__ import annotations

from typing import Any

from llm_batch.airflow.operators.local import LocalShardOperator
from llm_batch.runtime.warm_engines import WarmShard, start_service_shard


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
