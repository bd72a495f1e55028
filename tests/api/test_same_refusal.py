"""One bad spec, one refusal: the native route, a DAG run (register, with the spec as its
conf), the trigger form's ``POST /api/v2/dags/batch_inference/dagRuns`` (refused before any
run is made) and the CLI (through the API) refuse the same bad spec with the same reason, each
through the one admission (``llm_batch.pipeline.admission.admit``) of the one spec
(``llm_batch.core.job_spec.JobSpec``)."""

from __future__ import annotations

import uuid

import pytest

from tests.api.conftest import chat_lines

pytestmark = pytest.mark.airflow

MODEL = "tiny-random-llama"

# (the spec's bad part, the same as `llm-batch submit` flags, the reason every way in gives)
BAD_SPECS = [
    ({"model_config": {"no_such_field": 1}}, ["--model-config", '{"no_such_field": 1}'],
     "model_config.no_such_field: unknown field"),
    ({"endpoint": "/v1/nope"}, ["--endpoint", "/v1/nope"], "endpoint '/v1/nope' is unknown"),
    ({"output_check": {}}, ["--output-check", "{}"], "give at least one of response_format, json_schema and regex"),
    ({"data_parallelism": 65}, ["--shards", "65"], "data_parallelism=65 is out of bounds: give 1 to 64"),
    ({"priority": "urgent"}, ["--priority", "urgent"], "priority 'urgent' is unknown; use one of: high, low, normal"),
    # Labels are bounded in the spec, not in each dialect's model (a form run took any number).
    ({"labels": {f"k{i}": "v" for i in range(65)}}, [f for i in range(65) for f in ("--label", f"k{i}=v")],
     "at most 64 pairs are allowed, got 65"),
    # A rule Scale's route alone had before the one admission: the tokenizer under the path rules.
    ({"model_config": {"tokenizer": "/etc"}}, ["--model-config", '{"tokenizer": "/etc"}'], "model_config.tokenizer: "),
]


@pytest.mark.parametrize(("bad", "flags", "reason"), BAD_SPECS, ids=lambda value: str(value)[:24])
def test_every_way_in_refuses_a_bad_spec_with_the_same_reason(
        client, creds, api_store, live_server, airflow_api, cli, capsys, tmp_path, bad, flags, reason):
    from llm_batch.core.config import get_settings
    from llm_batch.core.jobs import JobRejected
    from llm_batch.core.run_conf import BATCH_DAG_ID
    from llm_batch.pipeline import steps

    requests = [{"custom_id": "0", "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}}]
    native = client.post("/v1/jobs", headers=creds.key("alice"), json={"requests": requests, "model": MODEL, **bad})
    assert 400 <= native.status_code < 500 and reason in native.json()["message"], native.text

    job_id = f"job_same_refusal_{uuid.uuid4().hex[:8]}"
    with pytest.raises(JobRejected) as refused:
        steps.register(api_store, get_settings(), {"job_id": job_id, "input_requests": requests, "model": MODEL,
                                                   "owner": "alice", **bad}, f"manual__{job_id}")
    assert reason in str(refused.value)
    assert reason in api_store.get_job(job_id).status_reason  # the refused run's job says it too

    runs = f"/api/v2/dags/{BATCH_DAG_ID}/dagRuns"
    before = airflow_api.get(runs, headers=creds.jwt("root")).json()["total_entries"]
    form = airflow_api.post(runs, headers=creds.jwt("alice"),
                            json={"logical_date": None, "conf": {"input_requests": requests, "model": MODEL, **bad}})
    assert form.status_code == 400 and reason in form.json()["detail"], form.text
    assert airflow_api.get(runs, headers=creds.jwt("root")).json()["total_entries"] == before  # no run made

    batch = tmp_path / "batch.jsonl"
    batch.write_bytes(chat_lines(1))
    main = cli(f"{live_server}/batch", creds.keys["alice"])
    capsys.readouterr()
    assert main(["submit", str(batch), "--model", MODEL, *flags, "--new"]) == 2
    assert reason in capsys.readouterr().err
