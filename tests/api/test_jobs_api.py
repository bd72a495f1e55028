"""The native jobs route ``/v1/jobs`` over HTTP: create (inline, files, path; the DAG run
really triggered in Airflow's DB), client-chosen ids (re-attach, another owner's 409),
canonical status and counts, list filters and cursor, cancel, ownership, refusals naming
the field and creating nothing."""

from __future__ import annotations

import uuid

import orjson
import pytest

from tests.api.conftest import chat_lines, dag_run_of, simulate_run

pytestmark = pytest.mark.airflow

MODEL = "tiny-random-llama"


def _requests(n: int) -> list[dict]:
    return [{"custom_id": f"r{i}", "body": {"messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 4}}
            for i in range(n)]


def _upload(client, headers, content: bytes) -> str:
    response = client.post("/v1/files", headers=headers, files={"file": ("in.jsonl", content)}, data={"purpose": "batch"})
    assert response.status_code == 200, response.text
    return response.json()["id"]


def test_inline_job_lifecycle_in_canonical_words(client, creds, api_store):
    alice = creds.key("alice")
    label = uuid.uuid4().hex[:8]
    created = client.post("/v1/jobs", headers=alice, json={
        "requests": _requests(3), "model": MODEL, "labels": {"run": label}, "priority": "high",
        "data_parallelism": 2, "max_runtime_sec": 600,
    })
    assert created.status_code == 200, created.text
    job = created.json()
    assert job["status"] == "QUEUED" and job["terminal"] is False and job["owner"] == "alice"
    assert job["counts"] == {"total": 0, "completed": 0, "succeeded": 0, "failed": 0, "invalid_output": 0}
    assert job["labels"] == {"run": label} and job["dag_run_id"]
    conf = dag_run_of(job["id"])["conf"]
    assert conf["priority"] == "high" and conf["data_parallelism"] == 2 and "labels" not in conf  # ids and counts
    stored = api_store.get_job(job["id"])
    assert (stored.expires_at - stored.created_at).total_seconds() == 600 and stored.model_config["model"] == MODEL

    progress = simulate_run(api_store, job["id"], ok=2, failed=1)
    next(progress)
    running = client.get(f"/v1/jobs/{job['id']}", headers=alice).json()
    assert running["status"] == "RUNNING" and running["counts"]["completed"] == 1
    next(progress, None)
    done = client.get(f"/v1/jobs/{job['id']}", headers=alice).json()
    assert done["status"] == "SUCCEEDED" and done["terminal"] is True and done["ended_at"] is not None
    assert done["counts"] == {"total": 3, "completed": 3, "succeeded": 2, "failed": 1, "invalid_output": 0}
    assert done["output_file_id"] and done["usage"]["total_tokens"] == done["usage"]["prompt_tokens"] + done["usage"]["completion_tokens"]

    listed = client.get("/v1/jobs", headers=alice, params={"label": f"run={label}"}).json()
    assert [j["id"] for j in listed["data"]] == [job["id"]] and listed["has_more"] is False
    assert client.get("/v1/jobs", headers=alice, params={"label": f"run={label}", "status": "QUEUED"}).json()["data"] == []
    # Another owner sees neither the job nor it in lists; an admin sees both.
    assert client.get(f"/v1/jobs/{job['id']}", headers=creds.key("bob")).status_code == 404
    assert client.post(f"/v1/jobs/{job['id']}/cancel", headers=creds.key("bob")).status_code == 404
    assert client.get("/v1/jobs", headers=creds.key("bob"), params={"label": f"run={label}"}).json()["data"] == []
    admin = client.get("/v1/jobs", headers=creds.key("admin-key"), params={"label": f"run={label}", "owner": "alice"}).json()
    assert [j["id"] for j in admin["data"]] == [job["id"]]
    # Ended: cancel answers the job as it is.
    again = client.post(f"/v1/jobs/{job['id']}/cancel", headers=alice)
    assert again.status_code == 200 and again.json()["status"] == "SUCCEEDED"


def test_client_id_reattaches_and_is_refused_to_another_owner(client, creds, api_store):
    alice, bob = creds.key("alice"), creds.key("bob")
    job_id = f"step-{uuid.uuid4().hex}"
    body = {"id": job_id, "requests": _requests(2), "model": MODEL}
    first = client.post("/v1/jobs", headers=alice, json=body)
    assert first.status_code == 200 and first.json()["id"] == job_id, first.text
    run = first.json()["dag_run_id"]
    second = client.post("/v1/jobs", headers=alice, json=body)
    assert second.status_code == 200 and second.json()["id"] == job_id and second.json()["dag_run_id"] == run
    listed = client.get("/v1/jobs", headers=alice, params={"limit": 1000}).json()["data"]
    assert [j["id"] for j in listed].count(job_id) == 1
    taken = client.post("/v1/jobs", headers=bob, json=body)
    assert taken.status_code == 409 and taken.json()["param"] == "id", taken.text
    assert api_store.get_job(job_id).owner == "alice"


def test_from_files_and_path_and_cancel(client, creds, alice_dir):
    alice = creds.key("alice")
    ids = [_upload(client, alice, chat_lines(2)), _upload(client, alice, chat_lines(1))]
    job = client.post("/v1/jobs", headers=alice, json={"input_file_ids": ids, "model": MODEL}).json()
    assert job["input_file_ids"] == ids and dag_run_of(job["id"])["conf"]["input_file_ids"] == ids
    cancelled = client.post(f"/v1/jobs/{job['id']}/cancel", headers=alice)
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "CANCELLED"  # still queued: at once

    path = alice_dir / f"native-{uuid.uuid4().hex}.jsonl"
    path.write_bytes(chat_lines(2))
    out = alice_dir / f"native-out-{uuid.uuid4().hex}.jsonl"
    from_path = client.post("/v1/jobs", headers=alice, json={"input_uri": str(path), "output_uri": str(out), "model": MODEL})
    assert from_path.status_code == 200, from_path.text
    assert from_path.json()["output_uri"] == str(out)
    conf = dag_run_of(from_path.json()["id"])["conf"]
    # Every Airflow viewer reads a run's conf: the paths stay in the job store.
    assert conf["job_id"] == from_path.json()["id"] and str(alice_dir) not in str(conf)


def test_list_pages_with_a_cursor(client, creds):
    alice = creds.key("alice")
    label = uuid.uuid4().hex[:8]
    made = [client.post("/v1/jobs", headers=alice, json={"requests": _requests(1), "model": MODEL, "labels": {"page": label}}).json()["id"]
            for _ in range(3)]
    seen, cursor = [], None
    while True:
        params = {"label": f"page={label}", "limit": 2, **({"after": cursor} if cursor else {})}
        page = client.get("/v1/jobs", headers=alice, params=params).json()
        seen += [j["id"] for j in page["data"]]
        if not page["has_more"]:
            break
        cursor = page["next_cursor"]
    assert seen == made[::-1]
    assert client.get("/v1/jobs", headers=alice, params={"limit": 1001}).status_code == 422
    assert client.get("/v1/jobs", headers=alice, params={"after": "no-such-job"}).json()["param"] == "after"


def test_refusals_name_the_field_and_create_nothing(client, creds, api_store, alice_dir):
    alice = creds.key("alice")
    before = api_store.list_jobs(owner="alice", limit=1)[1]
    files_before = api_store.owner_usage("alice")["file_bytes"]
    base = {"requests": _requests(1), "model": MODEL}
    refusals = [
        ({**base, "model": "no-such-model"}, 400, "model"),
        ({**base, "endpoint": "/v1/conversations"}, 400, "endpoint"),
        ({"model": MODEL}, 400, "requests"),
        ({**base, "input_uri": str(alice_dir / "x.jsonl")}, 400, "requests"),
        ({**base, "output_uri": "/etc/llm-batch-out.jsonl"}, 400, "output_uri"),
        ({"input_uri": "/etc/passwd", "model": MODEL}, 400, "input_uri"),
        ({**base, "priority": "urgent"}, 400, "priority"),
        ({**base, "model_config": {"max_model_len": "long"}}, 400, "model_config.max_model_len"),
        ({**base, "id": "not a valid id!"}, 422, "id"),
        ({**base, "data_parallelism": 65}, 422, "data_parallelism"),
        ({**base, "requests": [{"custom_id": "a"}]}, 422, "requests[0]"),
        ({**base, "requests": [1, 2]}, 422, "requests[0]"),
        ({**base, "gpu_type": "potato"}, 422, "gpu_type"),
        ({**base, "unknown": 1}, 422, "unknown"),
        ({"input_file_ids": ["file-missing"], "model": MODEL}, 404, "input_file_ids[0]"),
    ]
    for body, status, param in refusals:
        response = client.post("/v1/jobs", headers=alice, json=body)
        assert response.status_code == status, (body, response.text)
        answer = response.json()
        assert answer["param"] == param, (body, answer)
        if status != 404:  # a missing id's answer is the same for every route
            assert param.split("[")[0].split(".")[0] in (answer.get("message") or answer["detail"]), answer
    assert api_store.list_jobs(owner="alice", limit=1)[1] == before
    assert api_store.owner_usage("alice")["file_bytes"] == files_before
    assert client.post("/v1/jobs", headers=creds.jwt("vic"), json=base).status_code == 403


def test_native_route_reads_every_dialects_jobs(client, creds):
    alice = creds.key("alice")
    mistral = client.post("/v1/batch/jobs", headers=alice, json={"requests": _requests(1), "endpoint": "/v1/chat/completions", "model": MODEL}).json()
    native = client.get(f"/v1/jobs/{mistral['id']}", headers=alice)
    assert native.status_code == 200 and native.json()["status"] == "QUEUED"
    assert orjson.loads(native.content)["model"] == MODEL
