"""The shard runners (``shard_operator(runner)`` imports only the one asked for, so a DAG using
the local runner never pays for the Kubernetes client), and users' ``LLMBatchOperator``
(``batch_step``, imported when named).
"""

from __future__ import annotations

from typing import Any


def shard_operator(runner: str) -> type[Any]:
    """The operator class of `runner`: "local" (LocalShardOperator) or "kubernetes" (KubernetesShardOperator)."""
    if runner == "local":
        from llm_batch.airflow.operators.local import LocalShardOperator  # airflow

        return LocalShardOperator
    if runner == "kubernetes":
        from llm_batch.airflow.operators.kubernetes import KubernetesShardOperator  # airflow

        return KubernetesShardOperator
    raise ValueError(f"shard runner {runner!r} is unknown; use 'local' or 'kubernetes'")


def __getattr__(name: str) -> Any:
    if name == "LLMBatchOperator":
        from llm_batch.airflow.operators.batch_step import LLMBatchOperator  # airflow

        return LLMBatchOperator
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
