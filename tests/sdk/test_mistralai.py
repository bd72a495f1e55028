"""mistralai, each release of the matrix, in its own venv: files + batch jobs."""

from __future__ import annotations

import json

import pytest

from llm_batch.core.jobs import JobStatus
from tests.sdk.conftest import chat_file, error_of, finish, releases, since

pytestmark = [pytest.mark.airflow, pytest.mark.sdk]

MODEL = "tiny-random-llama"


@pytest.mark.parametrize("release", releases("mistralai"))
def test_mistral_batch_flow(release, sdk, creds, api_store, tmp_path):
    flow = sdk(release)
    team = f"team-{release}"
    inline_requests = [{"custom_id": f"req-{i}", "body": {"messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 4}}
                       for i in range(2)]
    created = flow.run("create", input_path=str(chat_file(tmp_path / "requests.jsonl", 3)), model=MODEL,
                       metadata={"team": team}, inline_requests=inline_requests)
    assert created["import"] == ("mistralai.client" if since(release, "2.0.0") else "mistralai")  # where `Mistral` is
    job, uploaded = created["job"], created["file"]
    assert uploaded["bytes"] == (tmp_path / "requests.jsonl").stat().st_size
    assert uploaded["sample_type"] == "batch_request" and uploaded["purpose"] == "batch"
    assert job["status"] == "QUEUED" and job["input_files"] == [uploaded["id"]]
    assert job["metadata"] == {"team": team} and job["model"] == MODEL
    assert created["cancelled"]["status"] == "CANCELLED"  # still queued: ended at once
    refused = created["refused"]
    assert error_of(refused["unknown_model"]) == ("SDKError", 400) and "no-such-model" in refused["unknown_model"]["body"]
    assert error_of(refused["missing_job"]) == ("SDKError", 404)
    assert error_of(refused["wrong_key"]) == ("SDKError", 401)

    inline = created["inline"]
    assert (inline is not None) == since(release, "1.10.1")  # when jobs.create took inline `requests`
    if inline:
        assert inline["status"] == "QUEUED"  # its total_requests is counted at validation, as for files
        finish(api_store, inline["id"], ok=2, failed=0)
    api_store.transition(created["cancelled"]["id"], JobStatus.CANCELLED)

    seen = {}
    finish(api_store, job["id"], ok=2, failed=1, while_running=lambda: seen.update(flow.run("get", job_id=job["id"])))
    assert seen["status"] == "RUNNING" and seen["counts"][0] == 3

    done = flow.run("download", job_id=job["id"], inline_id=inline and inline["id"], model=MODEL, metadata={"team": team})
    assert done["status"] == "SUCCESS" and done["counts"] == [3, 2, 1]
    assert done["outputs"] == ["req-0", "req-1"] and done["errors"] == ["req-2"]
    listed = done["listed"]
    assert job["id"] in listed["success"] and created["cancelled"]["id"] not in listed["success"]
    assert listed["metadata"] == [job["id"]] and listed["metadata_none"] == 0
    assert {job["id"], created["cancelled"]["id"]} <= set(listed["model"])
    assert done["files_total"] >= 1
    if inline:
        assert done["inline"]["status"] == "SUCCESS" and done["inline"]["outputs"] == ["req-0", "req-1"]
        assert done["inline"].get("get_inline", ["req-0", "req-1"]) == ["req-0", "req-1"]

    output_file = api_store.get_job(job["id"]).output_file_id
    foreign = flow.run("foreign", key=creds.keys["bob"], job_id=job["id"], file_id=output_file)["refused"]
    assert {name: error_of(r) for name, r in foreign.items()} == {name: ("SDKError", 404) for name in ("get", "cancel", "download")}


ADAPTER = "tiny-lora-b"  # a LoRA adapter of MODEL (src/llm_batch/models.yaml, `adapters:`)


@pytest.mark.parametrize("release", releases("mistralai"))
def test_mistral_adapter_flow(release, sdk, api_store, tmp_path):
    """jobs.create(model=<adapter>): the job runs the adapter's base with lines that name no
    model on the adapter; the job's model is the adapter's name, and listing by it finds it."""
    flow = sdk(release)
    team = f"adapter-{release}"
    lines = [{"custom_id": f"req-{i}", "body": {"messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 4}}
             for i in range(3)]  # as Mistral's docs show them: no model in the lines
    (tmp_path / "adapter.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    created = flow.run("create_adapter", input_path=str(tmp_path / "adapter.jsonl"), model=ADAPTER,
                       metadata={"team": team}, unknown_model="no-such-adapter")
    job = created["job"]
    assert job["status"] == "QUEUED" and job["input_files"] == [created["file"]["id"]] and job["model"] == ADAPTER
    assert created["got"] == {"status": "QUEUED", "model": ADAPTER}
    assert api_store.get_job(job["id"]).model == ADAPTER
    unknown = created["refused"]["unknown_adapter"]
    assert error_of(unknown) == ("SDKError", 400) and "no-such-adapter" in unknown["body"] and "unknown_model" in unknown["body"]

    finish(api_store, job["id"], ok=2, failed=1)
    done = flow.run("download", job_id=job["id"], inline_id=None, model=ADAPTER, metadata={"team": team})
    assert done["status"] == "SUCCESS" and done["counts"] == [3, 2, 1]
    assert done["outputs"] == ["req-0", "req-1"] and done["errors"] == ["req-2"]
    assert job["id"] in done["listed"]["success"] and done["listed"]["metadata"] == [job["id"]]
    assert job["id"] in done["listed"]["model"]  # jobs.list(model=<adapter>)
