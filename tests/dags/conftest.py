"""Settings for the DAG tests, set before the DAG files are parsed: short grace and retry
delay so cancel, deadline and retry paths finish in seconds; the batch DAG and the job
store the DAG tests share."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("LLM_BATCH_CANCEL_GRACE_SECONDS", "20")
os.environ.setdefault("LLM_BATCH_SHARD_RETRY_DELAY_SECONDS", "1")
os.environ.setdefault("LLM_BATCH_SHARD_RUNNER", "local")
os.environ.setdefault("LLM_BATCH_LOCAL_POOL_SLOTS", "2")

from llm_batch.core.config import get_settings  # noqa: E402

get_settings.cache_clear()


@pytest.fixture(scope="module")
def batch_dag(dag_bag):
    assert not dag_bag.import_errors, dag_bag.import_errors
    return dag_bag.get_dag("batch_inference")


@pytest.fixture(scope="module")
def store():
    from llm_batch.infra.jobstore import get_job_store

    return get_job_store(get_settings().database_url)
