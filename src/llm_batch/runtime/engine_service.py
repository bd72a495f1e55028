"""Engine services: warm engines on Kubernetes, shared by the small shards of many jobs.

A Deployment per model and GPU type (``llm-batch engine-service manifest``) whose pods run
the warm engine host on TCP (``llm-batch engine-host --listen``); the shard task hands a
small shard to it (``warm_engines.start_service_shard``). Trust: a client's token
(``LLM_BATCH_ENGINE_TOKEN``), the model it serves, the host's own allowed roots; the
connection is not encrypted. See docs/orchestration.md, "Engine services".
"""

from __future__ import annotations

import orjson

from llm_batch.core.config import Settings, parse_address
from llm_batch.pipeline.shard_task import ShardTask

DEFAULT_PORT = 8700


def service_for(task: ShardTask, settings: Settings) -> tuple[str, int] | None:
    """The engine service that takes this shard, or None (it gets a pod of its own)."""
    if not settings.engine_services or task.nodes_per_worker != 1:
        return None
    if task.requests is None or task.requests > settings.engine_service_max_requests:
        return None
    model = str(orjson.loads(task.model_config_json).get("model", ""))
    address = settings.engine_services.get(f"{model}@{task.gpu_type}") or settings.engine_services.get(model)
    return parse_address(address) if address else None
