"""Engine services: warm engines on Kubernetes, shared by the small shards of many jobs.

On the Kubernetes runner every shard is a pod of its own by default, and a pod's engine start
is nearly all of a small shard's time. An engine service is a Deployment per model and GPU
type (``llm-batch engine-service manifest`` renders it, with its Service and NetworkPolicy)
whose pods run ``llm-batch engine-host --listen``: the warm engine host of the local runner
(``llm_batch.runtime.warm_engines``), on TCP. The shard task, on an Airflow worker, hands a small
shard to it (``warm_engines.start_service_shard``) and supervises it as the local runner
supervises a warm shard: log lines into the task log, cancel and deadline, progress.

Which shards go there (``service_for``): the Kubernetes runner's, of a model listed in
``LLM_BATCH_ENGINE_SERVICES`` (``<model>@<gpu_type>`` before ``<model>``), on one node, with at
most ``engine_service_max_requests`` requests. A large job still gets its own data-parallel
pods. The guarantees are the local warm engine's: each shard runs with ``run_worker``, results
resume after the last published part, a lost host (pod killed, node gone) fails the attempt
and its retry resumes on another pod (exactly once).

Trust: a service runs a shard for a client that sends its token (``LLM_BATCH_ENGINE_TOKEN``, a
Secret shared with the Airflow workers; compared in constant time) and only of the model it
serves; the shard's URIs must be under the host's own allowed roots and buckets, as in a
worker pod. The NetworkPolicy admits only pods labelled as Airflow workers. The connection
is not encrypted: keep it inside the cluster network (or put a service mesh's mTLS on it).
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
    model = _model_of(task)
    address = settings.engine_services.get(f"{model}@{task.gpu_type}") or settings.engine_services.get(model)
    return parse_address(address) if address else None


def _model_of(task: ShardTask) -> str:
    return str(orjson.loads(task.model_config_json).get("model", ""))
