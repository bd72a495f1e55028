"""The Celery configuration of llm-batch's Celery workers: Airflow's own, plus the task code
imported once in each worker's main process.

Set ``[celery] celery_config_options = llm_batch_operators.celery_config.CELERY_CONFIG`` (the Celery
shape and docker-compose.yaml do). Airflow runs each task in a process forked from the
worker's pool process, which is itself forked from the main process, so what the main
process has imported every task has for free. Without it every task imports the job store,
the S3 client and the shard operator itself: about 0.2 s for the store and 1.2 s for the
Kubernetes pod operator and its client on these cores, twice per Kubernetes shard (its
start and its resume after the deferral; docs/benchmarks.md).

Only imports happen here, in the main process before the pool forks (Celery's
``worker_init``), nothing that opens a connection or starts a thread. The schedulers and
api-servers that read this configuration import nothing more.
"""

from __future__ import annotations

import importlib
import logging
import time

from airflow.providers.celery.executors.default_celery import DEFAULT_CELERY_CONFIG
from celery.signals import worker_init

log = logging.getLogger("llm_batch_operators.celery_config")

CELERY_CONFIG = DEFAULT_CELERY_CONFIG

# What the batch DAG's tasks import when they run (not when the DAG file is parsed).
TASK_MODULES = (
    "llm_batch.steps",
    "llm_batch.jobstore",
    "llm_batch.storage",
    "llm_batch.shard_task",
    "boto3",
    "botocore.session",
)
RUNNER_MODULES = {
    "local": ("llm_batch_operators.local",),
    "kubernetes": ("llm_batch_operators.kubernetes_pod", "llm_batch_operators.kubernetes_group"),
}


def preload_modules(runner: str) -> list[str]:
    """The modules a worker imports up front for shard tasks of ``runner``."""
    return [*TASK_MODULES, *RUNNER_MODULES.get(runner, ())]


@worker_init.connect
def _preload(**_: object) -> None:
    from llm_batch.config import get_settings

    started = time.monotonic()
    names = preload_modules(get_settings().shard_runner)
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 (the task imports it again and reports why)
            log.warning("llm-batch: not preloaded %s: %s", name, exc)
    log.info("llm-batch: task code preloaded (%d modules, %.1f s)", len(names), time.monotonic() - started)
