"""The embedded stack's executor: Airflow's LocalExecutor, with the task code imported once,
before it forks its workers (and they their tasks): on two cores a job's tasks were bound by
how fast task processes start (docs/benchmarks.md, "Small jobs")."""

from __future__ import annotations

import multiprocessing

from airflow.executors.local_executor import LocalExecutor as AirflowLocalExecutor

from llm_batch.airflow.preload import preload


class LocalExecutor(AirflowLocalExecutor):
    """``start`` imports the task code first (fork start method only: a spawned worker would not inherit it)."""

    def start(self) -> None:
        if multiprocessing.get_start_method() == "fork":
            preload()
        super().start()
