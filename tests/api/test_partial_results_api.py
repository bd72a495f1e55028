"""``GET /v1/jobs/{id}/results``: a job's finished lines while it runs and after it ends.

- mid-run: the job's real validation and plan (pipeline steps), two of one shard's results
  published as a worker publishes them (the real worker doing so under kill -9 is
  tests/engine/test_partial_reads.py): the answer in both orders, ``start``, the headers
  saying incomplete, the CLI's ``results --partial``, the page's preview of them, another
  owner's 404;
- after a real run (dag.test, the tiny engine): complete, and every line it shows is that
  line of the output or error file, unchanged.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from tests.api.test_end_to_end import DAG_TEST_USER, dag_test_key  # noqa: F401 - fixture re-used

pytestmark = pytest.mark.airflow

MODEL = "tiny-random-llama"
LLM_BATCH = str(Path(sys.executable).with_name("llm-batch"))


def _requests(n: int) -> list[dict]:
    return [{"custom_id": f"r{i}", "body": {"messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 4}}
            for i in range(n)]


def _entries(response) -> list[dict]:
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("application/x-ndjson")
    return [orjson.loads(line) for line in response.content.splitlines()]


def _running_job(client, alice, api_store, settings, bad_at: int):
    """A 6-line job (one bad line) validated and planned for real, one shard of 5 requests,
    its first two results published; returns the job id."""
    from llm_batch.core.records import ResultRecord
    from llm_batch.infra.results import ResultsWriter
    from llm_batch.pipeline import steps
    from llm_batch.pipeline.sharding import read_manifest

    requests = _requests(6)
    requests[bad_at]["body"]["max_tokens"] = -1  # refused at validation: an error line from the start
    created = client.post("/v1/jobs", headers=alice, json={"requests": requests, "model": MODEL})
    assert created.status_code == 200, created.text
    job_id = created.json()["id"]
    steps.validate(api_store, settings, job_id)
    steps.plan(api_store, settings, job_id)
    (shard,) = read_manifest(steps.layout_of(settings, job_id)).shards
    with ResultsWriter.open(shard.results_uri) as writer:
        for index in [i for i in range(3) if i != bad_at][:2]:
            writer.write(ResultRecord(index=index, custom_id=f"r{index}", status_code=200,
                                      body={"object": "chat.completion", "model": MODEL, "choices": []}))
    return job_id


def test_a_running_jobs_finished_lines(client, creds, api_store, live_server):
    from llm_batch.core.config import get_settings

    alice = creds.key("alice")
    job_id = _running_job(client, alice, api_store, get_settings(), bad_at=1)

    response = client.get(f"/v1/jobs/{job_id}/results", headers=alice)
    assert response.headers["x-job-status"] == "RUNNING" and response.headers["x-results-complete"] == "false"
    entries = _entries(response)
    # Lines 1-3 (results of 0 and 2, line 2 refused); line 4 has no result yet: input order stops.
    assert [(e["index"], e["line"], e["custom_id"]) for e in entries] == [(0, 1, "r0"), (1, 2, "r1"), (2, 3, "r2")]
    assert "output" in entries[0] and "output" in entries[2]
    assert entries[1]["error"]["error"]["code"] and entries[1]["error"]["line"] == 2
    assert entries[0]["output"]["response"]["status_code"] == 200
    assert entries[0]["output"]["id"].startswith("batch_req_")

    assert _entries(client.get(f"/v1/jobs/{job_id}/results", headers=alice,
                               params={"start": 2})) == entries[2:]
    finished = _entries(client.get(f"/v1/jobs/{job_id}/results", headers=alice, params={"order": "finished"}))
    assert finished == entries

    # Another owner's job is not there for them; a bad order is a 4xx naming it.
    assert client.get(f"/v1/jobs/{job_id}/results", headers=creds.key("bob")).status_code == 404
    bad = client.get(f"/v1/jobs/{job_id}/results", headers=alice, params={"order": "random"})
    assert 400 <= bad.status_code < 500 and "order" in bad.text

    # The page's detail previews them, marked partial.
    detail = client.get(f"/ui/api/jobs/{job_id}", headers=alice).json()
    assert detail["preview_partial"] is True
    assert [row["custom_id"] for row in detail["preview"]] == ["r0", "r2"]
    assert [(row["line"], row["custom_id"]) for row in detail["error_lines"]] == [(2, "r1")]

    # The CLI: the same lines, and it says the job has not ended.
    env = {"LLM_BATCH_API_URL": f"{live_server}/batch", "LLM_BATCH_API_KEY": creds.keys["alice"],
           "PATH": "/usr/bin:/bin"}
    cli = subprocess.run([LLM_BATCH, "results", job_id, "--partial"], env=env, capture_output=True, timeout=120)
    assert cli.returncode == 0, cli.stderr
    assert [orjson.loads(line) for line in cli.stdout.splitlines()] == entries
    assert b"RUNNING, 3 finished lines (incomplete" in cli.stderr


@pytest.mark.engine
def test_after_a_real_run_every_line_shown_is_its_final_line(live_server, dag_test_key, dag_bag, tiny_model_dir,  # noqa: F811
                                                            engine_env):
    import httpx

    headers = {"Authorization": f"Bearer {dag_test_key}"}
    with httpx.Client(base_url=f"{live_server}/batch", headers=headers, timeout=60) as http:
        requests = _requests(5)
        requests[3]["body"]["temperature"] = 9  # refused at validation
        created = http.post("/v1/jobs", json={"requests": requests, "model": MODEL, "data_parallelism": 2})
        assert created.status_code == 200, created.text
        job_id = created.json()["id"]
        before = http.get(f"/v1/jobs/{job_id}/results")
        assert _entries(before) == [] and before.headers["x-results-complete"] == "false"

        dag_bag.get_dag("batch_inference").test(run_conf={"job_id": job_id})
        job = http.get(f"/v1/jobs/{job_id}").json()
        assert job["status"] == "SUCCEEDED", job
        response = http.get(f"/v1/jobs/{job_id}/results")
        assert response.headers["x-results-complete"] == "true"
        entries = _entries(response)
        assert [e["index"] for e in entries] == list(range(5))
        final = {}
        for file_id in (job["output_file_id"], job["error_file_id"]):
            for line in http.get(f"/v1/files/{file_id}/content").content.splitlines():
                record = orjson.loads(line)
                assert record["id"] not in final
                final[record["id"]] = record
        assert len(final) == 5
        for entry in entries:
            line = entry.get("output") or entry["error"]
            assert final[line["id"]] == line
        assert [bool(e.get("error")) for e in entries] == [False, False, False, True, False]
