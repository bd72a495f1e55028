"""/v1/responses in an OpenAI batch through the `openai` SDK, with a real run of
batch_inference (dag.test, the tiny random model): each output line's response.body parses
as the SDK's Response, in input order; an unsupported option is an error-file line naming it;
the batch's usage sums the Responses usage names."""

from __future__ import annotations

import orjson
import pytest

from tests.api.test_end_to_end import DAG_TEST_USER

pytestmark = [pytest.mark.airflow, pytest.mark.engine]


@pytest.fixture(scope="module")
def dag_test_key(api_store) -> str:
    return api_store.create_api_key(DAG_TEST_USER, "dag.test runs (responses)")[1]


def _line(custom_id: str, body: dict) -> bytes:
    return orjson.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/responses", "body": body}) + b"\n"


def test_a_responses_batch_with_a_real_run(live_server, dag_test_key, dag_bag, tiny_model_dir, engine_env):
    from openai import OpenAI
    from openai.types.responses import Response

    client = OpenAI(api_key=dag_test_key, base_url=f"{live_server}/batch/v1", max_retries=0)
    content = (
        _line("r-0", {"model": "tiny-random-llama", "input": "say 0", "max_output_tokens": 4})
        + _line("r-1", {"input": [{"role": "user", "content": [{"type": "input_text", "text": "say 1"}]}],
                        "instructions": "Be brief.", "max_output_tokens": 4, "metadata": {"k": "v"}})
        + _line("r-2", {"input": "say 2", "previous_response_id": "resp_abc"})
        + _line("r-3", {"input": "say 3", "max_output_tokens": 3})
    )
    uploaded = client.files.create(file=("responses.jsonl", content), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/responses", completion_window="24h")
    assert batch.endpoint == "/v1/responses"

    dag = dag_bag.get_dag("batch_inference")
    assert dag is not None, dag_bag.import_errors
    dag.test(run_conf={"job_id": batch.id})

    done = client.batches.retrieve(batch.id)
    assert done.status == "completed", (done.status, done.errors)
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (4, 3, 1)
    lines = [orjson.loads(line) for line in client.files.content(done.output_file_id).content.splitlines()]
    assert [line["custom_id"] for line in lines] == ["r-0", "r-1", "r-3"]
    parsed = [Response.model_validate(line["response"]["body"]) for line in lines]
    assert all(line["response"]["status_code"] == 200 for line in lines)
    assert all(p.object == "response" and p.output[0].role == "assistant" for p in parsed)
    assert parsed[1].metadata == {"k": "v"} and parsed[1].instructions == "Be brief."
    assert all(p.usage.total_tokens == p.usage.input_tokens + p.usage.output_tokens for p in parsed)
    (error,) = [orjson.loads(line) for line in client.files.content(done.error_file_id).content.splitlines()]
    assert error["custom_id"] == "r-2"
    assert "previous_response_id is not supported" in orjson.dumps(error).decode()
    assert done.usage is not None  # the batch's usage: the sum of the Responses usage names
    assert done.usage.input_tokens == sum(p.usage.input_tokens for p in parsed)
    assert done.usage.output_tokens == sum(p.usage.output_tokens for p in parsed)
