"""The whole OpenAI flow through the `openai` SDK with a real run of batch_inference
(dag.test, the real vLLM engine on the tiny random model): files.create, batches.create,
retrieve until done (polled while the run works), files.content in input order."""

from __future__ import annotations

import threading
import time

import orjson
import pytest

from tests.api.conftest import chat_lines

pytestmark = [pytest.mark.airflow, pytest.mark.engine]

DAG_TEST_USER = "dag_test"  # the triggering user of every dag.test() run


@pytest.fixture(scope="module")
def dag_test_key(api_store) -> str:
    """A key of the user dag.test() triggers its runs as: a run may take over only a job of
    its own user (or the API's own run of it), so the SDK's jobs here are that user's."""
    return api_store.create_api_key(DAG_TEST_USER, "dag.test runs")[1]


def test_openai_sdk_with_a_real_run(live_server, dag_test_key, dag_bag, tiny_model_dir, engine_env):
    from openai import OpenAI

    client = OpenAI(api_key=dag_test_key, base_url=f"{live_server}/batch/v1", max_retries=0)
    content = chat_lines(6) + b"{not json\n"  # one bad line: an error record, not a failed job
    uploaded = client.files.create(file=("e2e.jsonl", content), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")

    seen: list[str] = []
    stop = threading.Event()

    def poll() -> None:  # "retrieve until done", while the run works
        while not stop.is_set():
            status = client.batches.retrieve(batch.id).status
            if not seen or seen[-1] != status:
                seen.append(status)
            if status in ("completed", "failed", "cancelled", "expired"):
                return
            time.sleep(0.5)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    dag = dag_bag.get_dag("batch_inference")
    assert dag is not None, dag_bag.import_errors
    dag.test(run_conf={"job_id": batch.id})
    poller.join(timeout=30)
    stop.set()

    done = client.batches.retrieve(batch.id)
    assert done.status == "completed", (done.status, done.errors)
    assert seen[0] == "validating" and seen[-1] == "completed"
    counts = done.request_counts
    assert counts.total == 7 and counts.completed + counts.failed == 7 and counts.failed >= 1
    results = [orjson.loads(line) for line in client.files.content(done.output_file_id).content.splitlines()]
    assert [r["custom_id"] for r in results] == [f"req-{i}" for i in range(6)][: len(results)]
    assert len(results) == counts.completed
    errors = client.files.content(done.error_file_id).content.splitlines()
    assert len(errors) == counts.failed


def test_scale_sdk_job_with_a_real_run(live_server, dag_test_key, dag_bag, tiny_model_dir, engine_env, llm_batch_home, monkeypatch):
    """Scale's client submits (v1 content), the real run writes the JSON array at
    output_data_path, the v2 job reads completed with final counts."""
    from llmengine import Completion, api_engine
    from llmengine.data_types import CreateBatchCompletionsModelConfig, CreateBatchCompletionsRequestContent

    monkeypatch.setattr(api_engine, "base_path", f"{live_server}/batch/")
    monkeypatch.setattr(api_engine, "api_key", dag_test_key)
    output_path = llm_batch_home / "data" / DAG_TEST_USER / "e2e-scale" / "out.json"
    prompts = [f"Count to {i}" for i in range(5)]
    created = Completion.batch_create(
        output_data_path=str(output_path),
        model_config=CreateBatchCompletionsModelConfig(model="tiny-random-llama", labels={}),
        content=CreateBatchCompletionsRequestContent(prompts=prompts, max_new_tokens=4, temperature=0.0),
    )
    dag_bag.get_dag("batch_inference").test(run_conf={"job_id": created.job_id})

    job = api_engine.APIEngine._get(f"v2/batch-completions/{created.job_id}", timeout=30)["job"]
    assert job["status"] == "completed", job
    assert job["metadata"]["total_requests"] == 5 and job["metadata"]["succeeded_requests"] == 5
    outputs = orjson.loads(output_path.read_bytes())
    assert isinstance(outputs, list) and len(outputs) == len(prompts)
