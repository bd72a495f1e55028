"""Checked outputs through the native route: a bad check is a 4xx naming it and creates
nothing; a real run (dag.test, the tiny engine) of a job with a check its random answers
fail ends with every line an ``invalid_output`` error line holding its last answer, the
tries in the job's usage, the count in the native counts and the batch step's manifest,
and the lines as failed in the OpenAI dialect's counts (it has no place for a third kind).
"""

from __future__ import annotations

import httpx
import orjson
import pytest

from tests.api.test_end_to_end import DAG_TEST_USER, dag_test_key  # noqa: F401 - fixture re-used

pytestmark = pytest.mark.airflow

MODEL = "tiny-random-llama"


def _requests(n: int, **sampling) -> list[dict]:
    return [{"custom_id": f"r{i}", "body": {"messages": [{"role": "user", "content": f"number {i}"}],
                                            "max_tokens": 5, **sampling}} for i in range(n)]


@pytest.mark.parametrize("check, where", [
    ({"regex": "("}, "regex"),
    ({"json_schema": {"type": 5}}, "json_schema"),
    ({"regex": ".*", "max_retries": 9}, "max_retries"),
    ({}, "output_check"),
])
def test_a_bad_check_is_refused_and_creates_nothing(client, creds, check, where):
    alice = creds.key("alice")
    before = client.get("/v1/jobs", headers=alice, params={"limit": 100}).json()["data"]
    response = client.post("/v1/jobs", headers=alice, json={"requests": _requests(1), "model": MODEL,
                                                            "output_check": check})
    assert 400 <= response.status_code < 500 and where in response.text, response.text
    assert client.get("/v1/jobs", headers=alice, params={"limit": 100}).json()["data"] == before


@pytest.mark.engine
def test_a_real_run_records_invalid_outputs_with_their_tries(live_server, dag_test_key, dag_bag, tiny_model_dir,  # noqa: F811
                                                             engine_env):
    from llm_batch.airflow.operators.batch_step import manifest_of

    check = {"regex": r"\d+", "max_retries": 1}
    with httpx.Client(base_url=f"{live_server}/batch", headers={"Authorization": f"Bearer {dag_test_key}"},
                      timeout=60) as http:
        created = http.post("/v1/jobs", json={"requests": _requests(3, temperature=1.0), "model": MODEL,
                                              "output_check": check})
        assert created.status_code == 200, created.text
        job_id = created.json()["id"]
        dag_bag.get_dag("batch_inference").test(run_conf={"job_id": job_id})
        job = http.get(f"/v1/jobs/{job_id}").json()
        assert job["status"] == "SUCCEEDED", job
        assert job["counts"]["invalid_output"] == job["counts"]["failed"] == 3
        assert job["usage"]["output_retries"] == 3 and job["usage"]["retry_tokens"] > 0
        errors = [orjson.loads(line) for line in http.get(f"/v1/files/{job['error_file_id']}/content").content.splitlines()]
        assert [e["error"]["code"] for e in errors] == ["invalid_output"] * 3
        assert all(e["response"]["body"]["choices"][0]["message"]["content"] is not None for e in errors)
        batch = http.get(f"/v1/batches/{job_id}").json()
        assert batch["request_counts"] == {"total": 3, "completed": 0, "failed": 3}
        manifest = manifest_of(job)
        assert (manifest["errored"], manifest["invalid_output"]) == (3, 3)
        detail = http.get(f"/ui/api/jobs/{job_id}").json()  # the Batch jobs page's detail
        assert (detail["invalid_output"], detail["output_retries"], detail["cached"]) == (3, 3, 0)


def test_cli_submit_sends_the_check_and_the_cache_choice(live_server, creds, api_store, cli, capsys, tmp_path):
    main = cli(f"{live_server}/batch", creds.keys["alice"])
    batch = tmp_path / "checked.jsonl"
    batch.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in _requests(2)))
    assert main(["submit", str(batch), "--model", MODEL, "--output-check", '{"regex": "\\\\d+", "max_retries": 3}',
                 "--no-result-cache", "--new"]) == 0
    job = api_store.get_job(capsys.readouterr().out.strip().splitlines()[-1])
    assert (job.input.output_check.regex, job.input.output_check.max_retries) == (r"\d+", 3)
    assert job.input.result_cache is False
    assert main(["submit", str(batch), "--model", MODEL, "--output-check", '{"regex": "("}', "--new"]) == 2
    assert "regex" in capsys.readouterr().err
