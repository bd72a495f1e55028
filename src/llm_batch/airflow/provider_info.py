"""What Airflow's ProvidersManager reads from this package (entry point
``apache_airflow_provider``): the ``@task.llm_batch`` decorator, the hook's connection
type, the batch-step operator and trigger."""

from __future__ import annotations

from typing import Any


def get_provider_info() -> dict[str, Any]:
    return {
        "package-name": "llm-batch",
        "name": "llm-batch",
        "description": "Batch LLM inference on vLLM: a batch as a step of your DAG "
        "(LLMBatchOperator, @task.llm_batch) through the llm-batch REST API.",
        "task-decorators": [{"name": "llm_batch", "class-name": "llm_batch.airflow.decorators.llm_batch.llm_batch_task"}],
        "operators": [{"integration-name": "llm-batch", "python-modules": ["llm_batch.airflow.operators.batch_step"]}],
        "hooks": [{"integration-name": "llm-batch", "python-modules": ["llm_batch.airflow.hooks.llm_batch"]}],
        "triggers": [{"integration-name": "llm-batch", "python-modules": ["llm_batch.airflow.triggers.batch_job"]}],
    }
