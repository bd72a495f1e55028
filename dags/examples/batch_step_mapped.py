"""### llm_batch_example_mapped: one llm-batch job per input file (dynamic task mapping)

`LLMBatchOperator.partial(...).expand(input_uri=...)`: one mapped task, hence one job (with its
own id: a retry re-attaches to its file's job only), per JSONL file of the `input_uris` param.
`summarize` gathers the manifests. New DAGs start paused.
"""

from __future__ import annotations

from datetime import datetime

from airflow.sdk import DAG, Param, task

from llm_batch.airflow.operators.batch_step import LLMBatchOperator

with DAG(
    dag_id="llm_batch_example_mapped",
    description="Example: one llm-batch job per input file",
    schedule=None,
    start_date=datetime(2025, 1, 1),
    catchup=False,
    is_paused_upon_creation=True,
    tags=["llm-batch", "example"],
    params={
        "input_uris": Param([], type="array", items={"type": "string"}, description="JSONL files of requests"),
        "model": Param("smollm2-135m-instruct", type="string", description="A model of the registry"),
    },
    doc_md=__doc__,
) as dag:

    @task
    def input_uris(params=None) -> list[str]:
        return list(params["input_uris"])

    batches = LLMBatchOperator.partial(
        task_id="batch", model="{{ params.model }}", labels={"example": "mapped"}, poll_interval=2,
    ).expand(input_uri=input_uris())

    @task
    def summarize(manifests: list[dict]) -> list[dict]:
        return [{"job_id": m["job_id"], "status": m["status"], "succeeded": m["succeeded"]} for m in manifests]

    summarize(batches.output)
