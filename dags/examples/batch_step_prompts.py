"""### llm_batch_example_prompts: a batch as one step of your DAG

`make_prompts` builds the prompts, `@task.llm_batch` runs them as one llm-batch job (deferred;
a retry re-attaches to the same job) and returns a manifest, `read_results` reads the results
through `LLMBatchHook` (connection `llm_batch_default`). New DAGs start paused.
"""

from __future__ import annotations

from datetime import datetime

from airflow.sdk import DAG, Param, task

from llm_batch.airflow.hooks.llm_batch import LLMBatchHook

with DAG(
    dag_id="llm_batch_example_prompts",
    description="Example: prompts -> @task.llm_batch -> read the results",
    schedule=None,
    start_date=datetime(2025, 1, 1),
    catchup=False,
    is_paused_upon_creation=True,
    tags=["llm-batch", "example"],
    params={
        "count": Param(4, type="integer", minimum=1, maximum=1000, description="How many prompts"),
        "model": Param("smollm2-135m-instruct", type="string", description="A model of the registry"),
    },
    doc_md=__doc__,
) as dag:

    @task
    def make_prompts(params=None) -> list[str]:
        return [f"Write one word about the number {i}." for i in range(params["count"])]

    @task.llm_batch(model="{{ params.model }}", request_params={"max_tokens": 8, "temperature": 0.0},
                    labels={"example": "prompts"}, poll_interval=2, retries=1)
    def generate(prompts: list[str]) -> list[str]:
        return prompts

    @task
    def read_results(manifest: dict) -> dict:
        results = LLMBatchHook().read_results(manifest["output_file_id"])
        return {"job_id": manifest["job_id"], "count": len(results), "custom_ids": [r["custom_id"] for r in results]}

    read_results(generate(make_prompts()))
