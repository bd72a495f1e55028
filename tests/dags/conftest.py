"""The batch DAG and the job store the DAG tests share (the DAG files are parsed with the
suite's settings: tests/conftest.py)."""

from __future__ import annotations

import pytest

from llm_batch.core.config import get_settings


@pytest.fixture(scope="module")
def batch_dag(dag_bag):
    assert not dag_bag.import_errors, dag_bag.import_errors
    return dag_bag.get_dag("batch_inference")


@pytest.fixture(scope="module")
def store():
    from llm_batch.infra.jobstore import get_job_store

    return get_job_store(get_settings().database_url)
