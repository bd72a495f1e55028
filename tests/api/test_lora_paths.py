"""LoRA adapters by the two remaining ways in, each with a real run of batch_inference
(dag.test, the tiny engine and its random adapters):

- the CLI: ``llm-batch submit`` of a file whose lines name an adapter takes the job's model
  from them; ``--model`` an adapter with lines naming none runs them on it;
- the batch step: ``LLMBatchOperator(model=<adapter>)``'s job body, posted to the native
  route as the step posts it, makes a job whose every line the adapter answers.

Every result says which adapter answered (its body's ``model``).
"""

from __future__ import annotations

import httpx
import orjson
import pytest

from tests.api.test_end_to_end import DAG_TEST_USER, dag_test_key  # noqa: F401 - fixture re-used

pytestmark = [pytest.mark.airflow, pytest.mark.engine]


def _lines(n: int, model: str | None) -> bytes:
    return b"".join(orjson.dumps({"custom_id": f"c{i}", "body": {
        **({"model": model} if model else {}), "messages": [{"role": "user", "content": f"hi {i}"}],
        "max_tokens": 4, "temperature": 0}}) + b"\n" for i in range(n))


def _answered_by(http: httpx.Client, job_id: str) -> list[str]:
    job = http.get(f"/v1/jobs/{job_id}").json()
    assert job["status"] == "SUCCEEDED", job
    content = http.get(f"/v1/files/{job['output_file_id']}/content").content
    return [orjson.loads(line)["response"]["body"]["model"] for line in content.splitlines()]


def test_cli_submit_and_the_batch_step_on_adapters(live_server, dag_test_key, dag_bag, tiny_adapters,  # noqa: F811
                                                   engine_env, cli, capsys, tmp_path):
    from llm_batch.airflow.operators.batch_step import LLMBatchOperator

    main = cli(f"{live_server}/batch", dag_test_key)
    dag = dag_bag.get_dag("batch_inference")
    http = httpx.Client(base_url=f"{live_server}/batch", headers={"Authorization": f"Bearer {dag_test_key}"},
                        timeout=60)

    named = tmp_path / "named.jsonl"
    named.write_bytes(_lines(3, "tiny-lora-a"))
    assert main(["submit", str(named), "--new"]) == 0  # the model from the lines
    from_lines = capsys.readouterr().out.strip().splitlines()[-1]
    plain = tmp_path / "plain.jsonl"
    plain.write_bytes(_lines(2, None))
    assert main(["submit", str(plain), "--model", "tiny-lora-b", "--new"]) == 0
    given = capsys.readouterr().out.strip().splitlines()[-1]

    step = LLMBatchOperator(task_id="lora_step", model="tiny-lora-c", prompts=["one", "two"],
                            request_params={"max_tokens": 4, "temperature": 0})
    body = step.job_body("af-lora-step-" + from_lines[-8:])
    created = http.post("/v1/jobs", json=body)
    assert created.status_code == 200, created.text
    stepped = created.json()["id"]

    for job_id, model in ((from_lines, "tiny-lora-a"), (given, "tiny-lora-b"), (stepped, "tiny-lora-c")):
        assert http.get(f"/v1/jobs/{job_id}").json()["model"] == model
        dag.test(run_conf={"job_id": job_id})
    assert _answered_by(http, from_lines) == ["tiny-lora-a"] * 3
    assert _answered_by(http, given) == ["tiny-lora-b"] * 2
    assert _answered_by(http, stepped) == ["tiny-lora-c"] * 2
    http.close()
