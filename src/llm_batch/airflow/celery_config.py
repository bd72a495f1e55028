"""The Celery configuration of llm-batch's Celery workers: Airflow's own, plus the task code
imported once in each worker's main process (``preload``).

Set ``[celery] celery_config_options = llm_batch.airflow.celery_config.CELERY_CONFIG`` (the Celery
shape and docker-compose.yaml do). Airflow runs each task in a process forked from the
worker's pool process, which is itself forked from the main process, so what the main
process has imported every task has for free. The import happens at Celery's
``worker_init``, in the main process before the pool forks. The schedulers and api-servers
that read this configuration import nothing more.
"""

from __future__ import annotations

from airflow.providers.celery.executors.default_celery import DEFAULT_CELERY_CONFIG
from celery.signals import worker_init

from llm_batch.airflow.preload import preload

CELERY_CONFIG = DEFAULT_CELERY_CONFIG


@worker_init.connect
def _preload(**_: object) -> None:
    preload()
