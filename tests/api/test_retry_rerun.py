"""``POST /v1/jobs/{id}/retry`` and ``/rerun`` over HTTP: a retry reads exactly the failed
and never-run lines of the ended job, in input order (validation's refusals left out); a
rerun reads the same input; both copy the job's parameters, name their source
(``derived_from``) and really trigger a run; 409 for a live job, for nothing to retry and
for an input that is gone; 404 for another owner's job; an Idempotency-Key replays."""

from __future__ import annotations

import uuid

import orjson
import pytest

from tests.api.conftest import chat_lines, dag_run_of

pytestmark = pytest.mark.airflow

MODEL = "tiny-random-llama"


def _upload(client, headers, content: bytes, name: str = "in.jsonl") -> str:
    response = client.post("/v1/files", headers=headers, files={"file": (name, content)}, data={"purpose": "batch"})
    assert response.status_code == 200, response.text
    return response.json()["id"]


def _create(client, headers, file_id: str, **fields) -> dict:
    created = client.post("/v1/jobs", headers=headers, json={"input_file_ids": [file_id], "model": MODEL, **fields})
    assert created.status_code == 200, created.text
    return created.json()


def _end_with_errors(store, job_id: str, errors: list[dict], status: str = "SUCCEEDED", succeeded: int = 0) -> None:
    """End the job as merge would leave it: an error file of these records."""
    from llm_batch.core.config import get_settings
    from llm_batch.core.layout import JobLayout
    from llm_batch.infra import storage

    job = store.get_job(job_id)
    layout = JobLayout(get_settings().work_uri, job_id)
    storage.write_bytes(layout.errors_jsonl, b"".join(orjson.dumps(e) + b"\n" for e in errors))
    error_file = store.create_file(owner=job.owner, purpose="batch_error", filename=f"{job_id}_error.jsonl",
                                   bytes=storage.size(layout.errors_jsonl), uri=layout.errors_jsonl, kind="error",
                                   job_id=job_id)
    store.set_outputs(job_id, error_file_id=error_file.id)
    store.set_counts(job_id, total=succeeded + len(errors), completed=succeeded + len(errors), succeeded=succeeded,
                     failed=len(errors))
    store.end_job(job_id, status)


def _engine_error(custom_id: str, line: int) -> dict:
    return {"id": "batch_req_x", "custom_id": custom_id, "line": line,
            "response": {"status_code": 400, "body": {"error": {"message": "too long"}}},
            "error": {"code": "invalid_request", "message": "too long"}}


def _not_run(custom_id: str, line: int, code: str = "batch_cancelled") -> dict:
    return {"id": "batch_req_y", "custom_id": custom_id, "line": line, "response": None,
            "error": {"code": code, "message": "the request was not run"}}


def _refused(line: int) -> dict:
    return {"id": "batch_req_z", "custom_id": None, "line": line, "response": None,
            "error": {"code": "invalid_json", "message": "not JSON"}}


def _input_of(store, job_id: str) -> bytes:
    from llm_batch.infra import storage

    job = store.get_job(job_id)
    if job.input.file_ids:
        return b"".join(storage.read_bytes(store.get_file(f).uri) for f in job.input.file_ids)
    return storage.read_bytes(job.input.uri)


def test_retry_reads_exactly_the_failed_and_never_run_lines_in_order(client, creds, api_store):
    alice = creds.key("alice")
    lines = chat_lines(6).splitlines(keepends=True)
    content = lines[0] + lines[1] + b"{not json\n" + lines[2] + lines[3] + lines[4] + lines[5]
    label = uuid.uuid4().hex[:8]
    source = _create(client, alice, _upload(client, alice, content), labels={"run": label}, priority="high",
                     data_parallelism=2, model_config={"max_model_len": 256})
    # req-1 the engine refused, line 3 validation refused, req-4 and req-5 never ran (cancelled).
    _end_with_errors(api_store, source["id"], [_engine_error("req-1", 2), _refused(3), _not_run("req-4", 6),
                                                _not_run("req-5", 7, "shard_failed")], "CANCELLED", succeeded=3)

    retried = client.post(f"/v1/jobs/{source['id']}/retry", headers=alice)
    assert retried.status_code == 200, retried.text
    job = retried.json()
    assert job["id"] != source["id"] and job["status"] == "QUEUED"
    assert job["derived_from"] == {"job_id": source["id"], "kind": "retry"}
    assert source["derived_from"] is None
    assert (job["model"], job["labels"], job["owner"]) == (MODEL, {"run": label}, "alice")
    stored, original = api_store.get_job(job["id"]), api_store.get_job(source["id"])
    assert (stored.priority, stored.data_parallelism, stored.model_config) == (
        original.priority, original.data_parallelism, original.model_config)
    assert _input_of(api_store, job["id"]) == lines[1] + lines[4] + lines[5]
    conf = dag_run_of(job["id"])["conf"]
    assert conf["job_id"] == job["id"] and conf["priority"] == "high"
    # The retry's input is an input file of the owner, named after its source (search finds it).
    found = client.get("/v1/jobs", headers=alice, params={"q": f"retry-of-{source['id']}"}).json()["data"]
    assert [j["id"] for j in found] == [job["id"]]
    assert client.get(f"/v1/jobs/{job['id']}", headers=alice).json()["derived_from"]["job_id"] == source["id"]
    # The source lists what was made from it.
    made = client.get("/v1/jobs", headers=alice, params={"derived_from": source["id"]}).json()["data"]
    assert [j["id"] for j in made] == [job["id"]]
    assert client.get("/v1/jobs", headers=creds.key("bob"), params={"derived_from": source["id"]}).json()["data"] == []


def test_a_job_that_ended_before_anything_ran_retries_every_line(client, creds, api_store):
    alice = creds.key("alice")
    content = chat_lines(3)
    source = _create(client, alice, _upload(client, alice, content))
    client.post(f"/v1/jobs/{source['id']}/cancel", headers=alice)
    api_store.end_job(source["id"], "CANCELLED")
    retried = client.post(f"/v1/jobs/{source['id']}/retry", headers=alice)
    assert retried.status_code == 200, retried.text
    assert _input_of(api_store, retried.json()["id"]) == content


def test_retry_refuses_a_live_job_nothing_to_retry_and_another_owners_job(client, creds, api_store):
    alice = creds.key("alice")
    live = _create(client, alice, _upload(client, alice, chat_lines(2)))
    refused = client.post(f"/v1/jobs/{live['id']}/retry", headers=alice)
    assert refused.status_code == 409 and refused.json()["code"] == "not_ended", refused.text
    assert client.post(f"/v1/jobs/{live['id']}/rerun", headers=alice).json()["code"] == "not_ended"

    clean = _create(client, alice, _upload(client, alice, chat_lines(2)))
    _end_with_errors(api_store, clean["id"], [], succeeded=2)
    nothing = client.post(f"/v1/jobs/{clean['id']}/retry", headers=alice)
    assert nothing.status_code == 409 and nothing.json()["code"] == "nothing_to_retry"

    only_refused = _create(client, alice, _upload(client, alice, chat_lines(1) + b"{bad\n"))
    _end_with_errors(api_store, only_refused["id"], [_refused(2)], succeeded=1)
    again = client.post(f"/v1/jobs/{only_refused['id']}/retry", headers=alice)
    assert again.status_code == 409 and "refused at validation" in again.json()["detail"]

    bob = creds.key("bob")
    for route in ("retry", "rerun"):
        assert client.post(f"/v1/jobs/{clean['id']}/{route}", headers=bob).status_code == 404
    assert client.post("/v1/jobs/job_nope/retry", headers=alice).status_code == 404
    listed = client.get("/v1/jobs", headers=alice, params={"q": clean["id"]}).json()["data"]
    assert [j["id"] for j in listed] == [clean["id"]]  # nothing was made by the refusals


def test_rerun_copies_the_input_and_refuses_a_deleted_file(client, creds, api_store):
    alice = creds.key("alice")
    file_id = _upload(client, alice, chat_lines(4))
    source = _create(client, alice, file_id, labels={"k": "v"})
    _end_with_errors(api_store, source["id"], [_engine_error("req-2", 3)], "FAILED", succeeded=3)
    rerun = client.post(f"/v1/jobs/{source['id']}/rerun", headers=alice)
    assert rerun.status_code == 200, rerun.text
    job = rerun.json()
    assert job["derived_from"] == {"job_id": source["id"], "kind": "rerun"}
    assert job["input_file_ids"] == [file_id] and job["labels"] == {"k": "v"}
    assert dag_run_of(job["id"])["conf"]["input_file_ids"] == [file_id]

    api_store.end_job(job["id"], "CANCELLED")  # a file a live job reads cannot be deleted
    assert client.delete(f"/v1/files/{file_id}", headers=alice).status_code == 200
    gone = client.post(f"/v1/jobs/{source['id']}/rerun", headers=alice)
    assert gone.status_code == 409 and gone.json()["code"] == "input_unavailable"
    assert file_id in gone.json()["detail"]
    retry_gone = client.post(f"/v1/jobs/{source['id']}/retry", headers=alice)
    assert retry_gone.status_code == 409 and file_id in retry_gone.json()["detail"]


def test_an_idempotency_key_makes_a_retry_happen_once(client, creds, api_store):
    alice = creds.key("alice")
    source = _create(client, alice, _upload(client, alice, chat_lines(2)))
    _end_with_errors(api_store, source["id"], [_not_run("req-0", 1, "batch_expired")], "TIMEOUT_EXCEEDED",
                     succeeded=1)
    headers = {**alice, "Idempotency-Key": uuid.uuid4().hex}
    first = client.post(f"/v1/jobs/{source['id']}/retry", headers=headers)
    second = client.post(f"/v1/jobs/{source['id']}/retry", headers=headers)
    assert first.status_code == second.status_code == 200, (first.text, second.text)
    assert first.json()["id"] == second.json()["id"]
    derived = [j for j in api_store.list_jobs(owner="alice", limit=1000)[0] if j.derived_from_id == source["id"]]
    assert len(derived) == 1
    # The same key on another job's retry is another request: refused, not answered with this one.
    other = _create(client, alice, _upload(client, alice, chat_lines(2)))
    _end_with_errors(api_store, other["id"], [_not_run("req-1", 2)], "CANCELLED", succeeded=1)
    reused = client.post(f"/v1/jobs/{other['id']}/retry", headers=headers)
    assert reused.status_code == 422 and reused.json()["code"] == "idempotency_key_reused", reused.text


def test_cli_retry_rerun_and_jobs_search(live_server, creds, api_store, cli, capsys):
    main = cli(f"{live_server}/batch", creds.keys["alice"])
    tag = uuid.uuid4().hex[:8]
    job = api_store.create_job(dialect="airflow", endpoint="/v1/chat/completions", model=MODEL, owner="alice",
                               labels={"cli": tag})
    # Not ended yet: the API's 409 is exit 2 with its message.
    assert main(["retry", job.id]) == 2
    assert "QUEUED" in capsys.readouterr().err  # the API's message: only an ended job can be retried
    file_id = api_store.create_file(owner="alice", purpose="batch", filename=f"cli-{tag}.jsonl", bytes=1,
                                    uri=_stored_input(chat_lines(3))).id
    source = api_store.create_job(dialect="airflow", endpoint="/v1/chat/completions", model=MODEL, owner="alice",
                                  labels={"cli": tag}, input={"file_ids": [file_id]}, input_format="jsonl")
    _end_with_errors(api_store, source.id, [_engine_error("req-2", 3)], "FAILED", succeeded=2)

    assert main(["retry", source.id]) == 0
    out, err = capsys.readouterr()
    retried = out.splitlines()[-1]  # (the in-process server's logs share stdout)
    assert retried.startswith("job_") and f"retry of {source.id}" in err
    assert api_store.get_job(retried).derived_from_id == source.id
    assert _input_of(api_store, retried) == chat_lines(3).splitlines(keepends=True)[2]

    assert main(["rerun", source.id]) == 0
    rerun = capsys.readouterr().out.splitlines()[-1]
    assert api_store.get_job(rerun).derived_kind == "rerun" and api_store.get_job(rerun).input.file_ids == [file_id]

    assert main(["jobs", "--search", f"cli-{tag}", "--limit", "50"]) == 0
    listed = {line.split()[0] for line in capsys.readouterr().out.splitlines() if line.startswith("job_")}
    assert listed == {source.id, rerun}  # the file name; the retry reads its own retry-of file


def _stored_input(content: bytes) -> str:
    from llm_batch.core.config import get_settings
    from llm_batch.core.layout import join_uri
    from llm_batch.infra import storage

    uri = join_uri(get_settings().files_uri, f"cli-{uuid.uuid4().hex}")
    storage.write_bytes(uri, content)
    return uri


def test_a_job_whose_model_is_gone_is_refused_naming_the_model(client, creds, api_store):
    gone = api_store.create_job(dialect="airflow", endpoint="/v1/chat/completions", model="no-such-model-any-more",
                                owner="alice")
    api_store.end_job(gone.id, "CANCELLED")
    for route in ("retry", "rerun"):
        refused = client.post(f"/v1/jobs/{gone.id}/{route}", headers=creds.key("alice"))
        assert refused.status_code == 400 and refused.json()["param"] == "model", refused.text
    assert api_store.list_jobs(derived_from=gone.id)[1] == 0
