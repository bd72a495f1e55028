"""The Celery configuration of llm-batch's workers: Airflow's own, plus the task code imported
in each worker's main process at ``worker_init``, before the pool forks (``preload``). Set
``[celery] celery_config_options = llm_batch.airflow.celery_config.CELERY_CONFIG``.
"""

from __future__ import annotations

from airflow.providers.celery.executors.default_celery import DEFAULT_CELERY_CONFIG
from celery.signals import worker_init

from llm_batch.airflow.preload import preload

CELERY_CONFIG = DEFAULT_CELERY_CONFIG


@worker_init.connect
def _preload(**_: object) -> None:
    preload()
