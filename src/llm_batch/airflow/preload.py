"""The task code an Airflow worker process imports once, before it forks its tasks (each task
then has it for free: ~1.2 s for the Kubernetes pod operator and its client). Celery workers
preload at ``worker_init`` (``celery_config``), the embedded LocalExecutor before it forks.
Only imports: nothing that opens a connection or starts a thread, since a fork follows.
"""

from __future__ import annotations

import importlib
import logging
import time

from llm_batch.core.config import get_settings

log = logging.getLogger("llm_batch.airflow.preload")

# What the batch DAG's file and its tasks import (the DAG file is parsed again in each task).
TASK_MODULES = (
    "llm_batch.pipeline.steps", "llm_batch.core.run_conf", "llm_batch.core.input_formats", "llm_batch.core.placement",
    "llm_batch.core.endpoints", "llm_batch.infra.jobstore", "llm_batch.infra.storage", "llm_batch.pipeline.shard_task",
    "llm_batch.pipeline.validation", "llm_batch.pipeline.sharding", "llm_batch.pipeline.merge",
    "llm_batch.airflow.lanes", "boto3", "botocore.session",
)
RUNNER_MODULES = {
    "local": ("llm_batch.airflow.operators.local",),
    "kubernetes": ("llm_batch.airflow.operators.kubernetes_pod", "llm_batch.airflow.operators.kubernetes_group"),
}


def preload_modules(runner: str) -> list[str]:
    """The modules a worker imports up front for shard tasks of ``runner``."""
    return [*TASK_MODULES, *RUNNER_MODULES.get(runner, ())]


def preload(runner: str | None = None) -> list[str]:
    """Import the task code of ``runner`` (default: the configured one); returns what was imported.
    A module that fails is left out with a warning: the task imports it again and says why."""
    started = time.monotonic()
    loaded = []
    for name in preload_modules(runner if runner is not None else get_settings().shard_runner):
        try:
            importlib.import_module(name)
            loaded.append(name)
        except Exception as exc:  # noqa: BLE001
            log.warning("llm-batch: not preloaded %s: %s", name, exc)
    log.info("llm-batch: task code preloaded (%d modules, %.1f s)", len(loaded), time.monotonic() - started)
    return loaded
