"""``POST /v1/jobs`` with ``dry_run``: the estimate over HTTP on the real app, job store and
Airflow DB, with the prepared tiny-random-llama's own tokenizer: counts of a file with bad
lines, nothing created (no job, no run, no file), every refusal of a create answered alike,
the measured tokens/s from ended jobs, and a real job's estimate beside what it took (the
native route and the Batch jobs page's detail)."""

from __future__ import annotations

import orjson
import pytest

from tests.api.conftest import simulate_run

pytestmark = pytest.mark.airflow

MODEL = "tiny-random-llama"


def _line(i: int, bad: bool = False) -> bytes:
    body = {"messages": "not a list"} if bad else {"messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 4}
    return orjson.dumps({"custom_id": f"r{i}", "body": body}) + b"\n"


def _upload(client, headers, content: bytes) -> str:
    response = client.post("/v1/files", headers=headers, files={"file": ("in.jsonl", content)}, data={"purpose": "batch"})
    assert response.status_code == 200, response.text
    return response.json()["id"]


def _runs() -> int:
    from airflow.models.dagrun import DagRun
    from airflow.utils.session import create_session

    with create_session() as session:
        return session.query(DagRun).filter(DagRun.dag_id == "batch_inference").count()


def _created(api_store, owner: str = "alice") -> tuple[int, int]:
    """(the owner's jobs, the bytes of the owner's stored files)."""
    return api_store.list_jobs(owner=owner, limit=1)[1], api_store.owner_usage(owner)["file_bytes"]


def test_a_dry_run_counts_the_lines_and_creates_nothing(client, creds, api_store, tiny_model_dir):
    alice = creds.key("alice")
    file_id = _upload(client, alice, b"".join(_line(i, bad=i in (1, 4)) for i in range(6)) + b"{broken\n")
    jobs, files, runs = *_created(api_store), _runs()

    answer = client.post("/v1/jobs", headers=alice, json={"input_file_ids": [file_id], "model": MODEL, "dry_run": True})
    assert answer.status_code == 200, answer.text
    est = answer.json()
    assert est["object"] == "job.estimate" and (est["model"], est["endpoint"]) == (MODEL, "/v1/chat/completions")
    assert (est["total"], est["valid"], est["invalid"]) == (7, 4, 3)
    assert [(e["line"], e["code"]) for e in est["errors"]] == [(2, "invalid_body"), (5, "invalid_body"), (7, "invalid_json")]
    assert est["prompt_tokens"] > 0 and est["prompt_tokens_exact"] is True and est["max_output_tokens"] == 4 * 4
    assert est["would_fail"] is None
    assert (*_created(api_store), _runs()) == (jobs, files, runs)  # no job, no stored file, no DAG run

    inline = client.post("/v1/jobs", headers=alice, json={
        "requests": [{"custom_id": "a", "body": {"messages": [{"role": "user", "content": "x"}]}},
                     {"body": {"messages": []}}], "model": MODEL, "dry_run": True}).json()
    assert (inline["total"], inline["valid"], inline["invalid"]) == (2, 1, 1) and inline["errors"][0]["custom_id"] == "1"
    assert (*_created(api_store), _runs()) == (jobs, files, runs)  # inline requests are not stored either


def test_a_dry_run_of_no_valid_line_says_the_job_would_fail(client, creds, tiny_model_dir):
    est = client.post("/v1/jobs", headers=creds.key("alice"), json={
        "requests": [{"body": {"messages": []}}], "model": MODEL, "dry_run": True}).json()
    assert (est["valid"], est["invalid"]) == (0, 1) and "no valid request" in est["would_fail"]


def test_a_dry_run_is_refused_exactly_as_a_create(client, creds, api_store, alice_dir):
    alice = creds.key("alice")
    bobs_file = _upload(client, creds.key("bob"), _line(0))
    base = {"requests": [{"body": {"messages": [{"role": "user", "content": "x"}]}}], "model": MODEL}
    jobs, files, runs = *_created(api_store), _runs()
    for body in (
        {**base, "model": "no-such-model"},
        {**base, "endpoint": "/v1/conversations"},
        {"input_uri": str(alice_dir / "missing.jsonl"), "model": MODEL},
        {"input_uri": "/etc/passwd", "model": MODEL},
        {"input_file_ids": [bobs_file], "model": MODEL},  # another owner's file: as a missing one
        {**base, "priority": "urgent"},
        {**base, "model_config": {"max_model_len": "long"}},
    ):
        created = client.post("/v1/jobs", headers=alice, json=body)
        dry = client.post("/v1/jobs", headers=alice, json={**body, "dry_run": True})
        assert created.status_code >= 400 and dry.status_code == created.status_code, (body, dry.text)
        assert (dry.json().get("param"), dry.json().get("code")) == (created.json().get("param"), created.json().get("code"))
    assert (*_created(api_store), _runs()) == (jobs, files, runs)
    assert client.post("/v1/jobs", headers=creds.jwt("vic"), json={**base, "dry_run": True}).status_code == 403


def test_the_measured_rate_comes_from_ended_jobs_and_makes_the_seconds(client, creds, api_store, tiny_model_dir):
    alice = creds.key("alice")
    job = client.post("/v1/jobs", headers=alice, json={"requests": [{"body": {"messages": [{"role": "user", "content": "x"}]}}] * 2,
                                                       "model": MODEL}).json()
    progress = simulate_run(api_store, job["id"], ok=2, failed=0)  # ends with tokens and 2 engine seconds
    for _ in progress:
        pass
    rate = api_store.measured_rate(MODEL)
    assert rate is not None and rate.engine_seconds > 0

    est = client.post("/v1/jobs", headers=alice, json={"requests": [{"body": {"messages": [{"role": "user", "content": "y"}],
                                                                              "max_tokens": 8}}],
                                                       "model": MODEL, "dry_run": True}).json()
    assert (est["tokens_per_s"], est["rate_jobs"]) == (round(rate.tokens_per_s, 1), rate.jobs)
    assert est["engine_seconds"] == round((est["prompt_tokens"] + 8) / rate.tokens_per_s, 1)
    assert est["expected_start"] >= est["estimated_at"] and est["expected_end"] >= est["expected_start"]


def test_a_real_jobs_estimate_sits_beside_what_it_took(client, creds, api_store, tiny_model_dir):
    from llm_batch.core.config import get_settings
    from llm_batch.pipeline import steps

    alice = creds.key("alice")
    job = client.post("/v1/jobs", headers=alice, json={
        "requests": [{"body": {"messages": [{"role": "user", "content": f"q {i}"}], "max_tokens": 3}} for i in range(3)],
        "model": MODEL}).json()
    assert job["estimate"] is None  # made when the input is validated
    steps.validate(api_store, get_settings(), job["id"])  # the prepare step's validation, as the DAG runs it
    store_job = api_store.get_job(job["id"])
    assert store_job.estimate["valid"] == 3
    api_store.transition(job["id"], "RUNNING")
    api_store.report_shard(job["id"], 0, state="done", total=3, done=3, succeeded=3, prompt_tokens=30,
                           completion_tokens=9, engine_seconds=1.5)
    api_store.transition(job["id"], "FINALIZING")
    api_store.end_job(job["id"], "SUCCEEDED", "3 succeeded")

    done = client.get(f"/v1/jobs/{job['id']}", headers=alice).json()
    est = done["estimate"]
    assert (est["total"], est["valid"], est["max_output_tokens"]) == (3, 3, 9) and est["prompt_tokens"] > 0
    assert done["usage"]["engine_seconds"] == 1.5 and done["started_at"] and done["ended_at"]
    listed = client.get("/v1/jobs", headers=alice, params={"q": job["id"]}).json()["data"]
    assert listed[0]["estimate"] == est
    page = client.get(f"/ui/api/jobs/{job['id']}", headers=alice).json()  # the Batch jobs page's detail
    assert page["estimate"]["engine_seconds"] == est["engine_seconds"] and page["usage"]["engine_seconds"] == 1.5
