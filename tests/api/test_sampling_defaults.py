"""A job's ``sampling_defaults``: every way in that has the spec takes them (the native
route, a DAG run's conf and its form, the CLI's flag, the batch step's argument), a bad one
is refused alike, and a real run (dag.test, the tiny engine) gives each line the defaults for
what it omits while a line's own value wins."""

from __future__ import annotations

import uuid

import orjson
import pytest

from tests.api.test_end_to_end import DAG_TEST_USER, dag_test_key  # noqa: F401 - fixture re-used

pytestmark = pytest.mark.airflow

MODEL = "tiny-random-llama"
DEFAULTS = {"temperature": 0.2, "max_tokens": 1}


def _lines(n: int, tag: str = "r", **own) -> list[dict]:
    # ignore_eos: a line stops at its max_tokens, whatever the random model says.
    return [{"custom_id": f"{tag}{i}", "body": {"messages": [{"role": "user", "content": f"say {i}"}],
                                                "ignore_eos": True, **own}} for i in range(n)]


def test_every_way_in_with_the_spec_takes_sampling_defaults(client, creds, api_store, live_server, cli, capsys,
                                                            tmp_path, dag_bag):
    from llm_batch.airflow.operators.batch_step import LLMBatchOperator
    from llm_batch.core.config import get_settings
    from llm_batch.pipeline import steps

    def kept(job_id: str) -> dict:
        return api_store.get_job(job_id).input.sampling_defaults.model_dump(exclude_none=True)

    native = client.post("/v1/jobs", headers=creds.key("alice"),
                         json={"requests": _lines(1), "model": MODEL, "sampling_defaults": DEFAULTS})
    assert native.status_code == 200, native.text
    assert kept(native.json()["id"]) == DEFAULTS

    job_id = steps.register(api_store, get_settings(), {"input_requests": _lines(1), "model": MODEL, "owner": "alice",
                                                        "sampling_defaults": DEFAULTS}, f"manual__{uuid.uuid4().hex}")
    assert kept(job_id) == DEFAULTS
    assert dag_bag.get_dag("batch_inference").params.get_param("sampling_defaults").schema["type"] == ["object", "null"]

    batch = tmp_path / "batch.jsonl"
    batch.write_bytes(b"".join(orjson.dumps(line) + b"\n" for line in _lines(1)))
    main = cli(f"{live_server}/batch", creds.keys["alice"])
    capsys.readouterr()
    assert main(["submit", str(batch), "--model", MODEL, "--sampling-defaults", orjson.dumps(DEFAULTS).decode(),
                 "--new"]) == 0
    assert kept(capsys.readouterr().out.strip().splitlines()[-1]) == DEFAULTS

    step = LLMBatchOperator(task_id="t", model=MODEL, prompts=["a"], sampling_defaults=DEFAULTS)
    assert step.job_body("af-x")["sampling_defaults"] == DEFAULTS

    bad = client.post("/v1/jobs", headers=creds.key("alice"),
                      json={"requests": _lines(1), "model": MODEL, "sampling_defaults": {"top_q": 1}})
    assert bad.status_code == 422 and "sampling_defaults.top_q" in bad.text, bad.text


@pytest.mark.engine
def test_a_real_run_applies_the_defaults_where_a_line_has_none(live_server, dag_test_key, dag_bag,  # noqa: F811
                                                               tiny_model_dir, engine_env):
    import httpx

    lines = _lines(2) + _lines(1, "own", max_tokens=4)  # the last line's own max_tokens wins
    with httpx.Client(base_url=f"{live_server}/batch", headers={"Authorization": f"Bearer {dag_test_key}"},
                      timeout=60) as http:
        created = http.post("/v1/jobs", json={"requests": lines, "model": MODEL, "sampling_defaults": DEFAULTS,
                                              "result_cache": False})
        assert created.status_code == 200, created.text
        job_id = created.json()["id"]
        dag_bag.get_dag("batch_inference").test(run_conf={"job_id": job_id})
        job = http.get(f"/v1/jobs/{job_id}").json()
        assert job["status"] == "SUCCEEDED" and job["counts"]["succeeded"] == 3, job
        results = [orjson.loads(line) for line in http.get(f"/v1/files/{job['output_file_id']}/content").content.splitlines()]
    tokens = {r["custom_id"]: r["response"]["body"]["usage"]["completion_tokens"] for r in results}
    assert tokens == {"r0": 1, "r1": 1, "own0": 4}, tokens
    assert job["usage"]["completion_tokens"] == 6
