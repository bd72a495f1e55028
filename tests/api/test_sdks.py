"""The official SDKs, unmodified, pointed at our base URL: openai (files + batches),
mistralai (files + batch jobs) and Scale's llmengine HTTP layer (batch completions v2)."""

from __future__ import annotations

import pytest

from llm_batch.core.jobs import JobStatus
from tests.api.conftest import chat_lines, simulate_run

pytestmark = pytest.mark.airflow


def test_openai_sdk_flow(live_server, creds, api_store):
    from openai import NotFoundError, OpenAI

    client = OpenAI(api_key=creds.keys["alice"], base_url=f"{live_server}/batch/v1", max_retries=0)
    content = chat_lines(3)
    uploaded = client.files.create(file=("in.jsonl", content), purpose="batch")
    assert uploaded.bytes == len(content) and uploaded.purpose == "batch"
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h", metadata={"run": "sdk"})
    assert batch.status == "validating" and batch.metadata == {"run": "sdk"}

    progress = simulate_run(api_store, batch.id, ok=2, failed=1)
    next(progress)
    assert client.batches.retrieve(batch.id).status == "in_progress"
    next(progress, None)
    done = client.batches.retrieve(batch.id)
    assert done.status == "completed"
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (3, 2, 1)
    output = client.files.content(done.output_file_id)
    assert len(output.content.splitlines()) == 2

    page = client.batches.list(limit=2)
    assert len(page.data) <= 2 and all(b.object == "batch" for b in page.data)
    ids = [b.id for b in client.batches.list(limit=1)]  # iterating pages through `after`
    assert batch.id in ids and len(ids) == len(set(ids))
    assert uploaded.id in [f.id for f in client.files.list()]
    assert client.files.delete(uploaded.id).deleted is True
    with pytest.raises(NotFoundError):
        client.files.retrieve(uploaded.id)

    other = client.batches.create(input_file_id=client.files.create(file=("b.jsonl", content), purpose="batch").id,
                                  endpoint="/v1/chat/completions", completion_window="24h")
    assert client.batches.cancel(other.id).status == "cancelled"  # still queued: ended at once
    bob = OpenAI(api_key=creds.keys["bob"], base_url=f"{live_server}/batch/v1", max_retries=0)
    with pytest.raises(NotFoundError):
        bob.batches.retrieve(batch.id)


def test_mistral_sdk_flow(live_server, creds, api_store):
    from mistralai.client import Mistral

    client = Mistral(api_key=creds.keys["alice"], server_url=f"{live_server}/batch")
    uploaded = client.files.upload(file={"file_name": "in.jsonl", "content": chat_lines(2)}, purpose="batch")
    assert uploaded.size_bytes > 0 and uploaded.sample_type == "batch_request"
    job = client.batch.jobs.create(input_files=[uploaded.id], endpoint="/v1/chat/completions", model="tiny-random-llama", metadata={"team": "m"}, timeout_hours=3)
    assert job.status == "QUEUED" and job.input_files == [uploaded.id]
    assert client.files.retrieve(file_id=uploaded.id).deleted is False

    progress = simulate_run(api_store, job.id, ok=2, failed=0)
    next(progress)
    assert client.batch.jobs.get(job_id=job.id).status == "RUNNING"
    next(progress, None)
    done = client.batch.jobs.get(job_id=job.id)
    assert done.status == "SUCCESS" and done.succeeded_requests == 2
    assert len(client.files.download(file_id=done.output_file).read().splitlines()) == 2

    listed = client.batch.jobs.list(status=["SUCCESS"], page_size=50)
    assert job.id in [j.id for j in listed.data] and listed.total >= 1
    by_metadata = client.batch.jobs.list(metadata={"team": "m"}, created_by_me=True)  # sent as ?team=m
    assert [j.id for j in by_metadata.data] == [job.id]
    assert client.batch.jobs.list(metadata={"team": "nobody"}).total == 0
    inline = client.batch.jobs.create(requests=[{"custom_id": "a", "body": {"messages": [{"role": "user", "content": "hi"}]}}],
                                      endpoint="/v1/chat/completions", model="tiny-random-llama")
    api_store.transition(inline.id, "VALIDATING")  # under way (a queued job ends at once)
    assert client.batch.jobs.cancel(job_id=inline.id).status == "CANCELLATION_REQUESTED"
    assert client.files.list(page_size=10).total >= 1

    # Delete: a live job is refused (cancel first); an ended one goes with its results.
    from mistralai.client.errors import SDKError

    with pytest.raises(SDKError) as refused:
        client.batch.jobs.delete(job_id=inline.id)
    assert refused.value.status_code == 409
    assert client.batch.jobs.get(job_id=inline.id).status == "CANCELLATION_REQUESTED"
    deleted = client.batch.jobs.delete(job_id=job.id)
    assert deleted.id == job.id and deleted.deleted is True
    with pytest.raises(SDKError) as gone:
        client.batch.jobs.get(job_id=job.id)
    assert gone.value.status_code == 404
    assert client.files.retrieve(file_id=uploaded.id).deleted is False  # the upload is the user's
    with pytest.raises(SDKError) as output_gone:
        client.files.retrieve(file_id=done.output_file)
    assert output_gone.value.status_code == 404
    other = Mistral(api_key=creds.keys["bob"], server_url=f"{live_server}/batch")
    with pytest.raises(SDKError) as not_bobs:
        other.batch.jobs.delete(job_id=inline.id)
    assert not_bobs.value.status_code == 404


def test_llmengine_client_v2(live_server, creds, api_store, alice_dir, monkeypatch):
    from llmengine import api_engine
    from llmengine.errors import NotFoundError, UnauthorizedError

    monkeypatch.setattr(api_engine, "base_path", f"{live_server}/batch/")
    monkeypatch.setattr(api_engine, "api_key", creds.keys["alice"])  # sent as basic auth and x-api-key
    body = {
        "output_data_path": str(alice_dir / "llmengine-out.json"),
        "content": {"prompts": ["a", "b", "c"], "max_new_tokens": 4, "temperature": 0.0},
        "model_config": {"model": "tiny-random-llama", "labels": {}},
        "data_parallelism": 1,
        "max_runtime_sec": 3600,
    }
    job = api_engine.APIEngine.post_sync("v2/batch-completions", body, timeout=30)
    assert job["status"] == "queued"
    assert api_store.get_job(job["job_id"]).input_format == "scale-v1"
    got = api_engine.APIEngine._get(f"v2/batch-completions/{job['job_id']}", timeout=30)
    assert got["job"]["job_id"] == job["job_id"]
    cancel = api_engine.APIEngine.post_sync(f"v2/batch-completions/{job['job_id']}/actions/cancel", {}, timeout=30)
    assert cancel == {"success": True}
    api_store.transition(job["job_id"], JobStatus.CANCELLED)
    assert api_engine.APIEngine._get(f"v2/batch-completions/{job['job_id']}", timeout=30)["job"]["status"] == "cancelled"

    monkeypatch.setattr(api_engine, "api_key", creds.keys["bob"])
    with pytest.raises(NotFoundError):
        api_engine.APIEngine._get(f"v2/batch-completions/{job['job_id']}", timeout=30)
    monkeypatch.setattr(api_engine, "api_key", "lbk_wrong")
    with pytest.raises(UnauthorizedError):
        api_engine.APIEngine._get("v2/batch-completions", timeout=30)


def test_llmengine_completion_batch_create(live_server, creds, api_store, alice_dir, monkeypatch):
    """Scale's own SDK call (v1 route), unmodified: the job is an ordinary scale-v1 job."""
    from llmengine import Completion, api_engine
    from llmengine.data_types import CreateBatchCompletionsModelConfig, CreateBatchCompletionsRequestContent

    monkeypatch.setattr(api_engine, "base_path", f"{live_server}/batch/")
    monkeypatch.setattr(api_engine, "api_key", creds.keys["alice"])
    response = Completion.batch_create(
        output_data_path=str(alice_dir / "sdk-v1-out.json"),
        model_config=CreateBatchCompletionsModelConfig(model="tiny-random-llama", labels={"team": "s"}),
        content=CreateBatchCompletionsRequestContent(prompts=["What is deep learning", "Hi"], max_new_tokens=4, temperature=0.0),
    )
    job = api_store.get_job(response.job_id)
    assert job.owner == "alice" and job.input_format == "scale-v1" and job.labels == {"team": "s"}
    got = api_engine.APIEngine._get(f"v2/batch-completions/{response.job_id}", timeout=30)["job"]
    assert got["status"] == "queued" and got["output_data_path"].endswith("sdk-v1-out.json")
