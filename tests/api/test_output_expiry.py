"""Files' own expiry: an upload's ``expires_after`` and a batch's ``output_expires_after``
(OpenAI's shapes, sent by the openai SDK), shown as ``expires_at``, refused out of range,
and enforced by housekeeping (404 after)."""

from __future__ import annotations

from datetime import timedelta

import pytest

from tests.api.conftest import chat_lines

pytestmark = pytest.mark.airflow

CHAT = "/v1/chat/completions"
HOUR = 3600


def _sdk(live_server, creds, owner: str = "alice"):
    from openai import OpenAI

    return OpenAI(api_key=creds.keys[owner], base_url=f"{live_server}/batch/v1", max_retries=0)


def test_upload_expires_after_through_the_sdk_and_housekeeping_deletes_it(live_server, creds, api_store):
    from openai import NotFoundError

    from llm_batch.pipeline import housekeeping

    client = _sdk(live_server, creds)
    uploaded = client.files.create(file=("in.jsonl", chat_lines(2)), purpose="batch",
                                   expires_after={"anchor": "created_at", "seconds": 2 * HOUR})
    assert uploaded.expires_at == uploaded.created_at + 2 * HOUR  # the SDK's type parses it
    assert client.files.retrieve(uploaded.id).expires_at == uploaded.expires_at
    plain = client.files.create(file=("in.jsonl", chat_lines(1)), purpose="batch")
    assert plain.expires_at is None

    stored = api_store.get_file(uploaded.id)
    assert uploaded.id not in housekeeping.delete_files_past_expiry(api_store, now=stored.expires_at - timedelta(seconds=1))
    assert client.files.content(uploaded.id).content == chat_lines(2)
    deleted = housekeeping.delete_files_past_expiry(api_store, now=stored.expires_at + timedelta(seconds=1))
    assert uploaded.id in deleted and plain.id not in deleted
    with pytest.raises(NotFoundError):
        client.files.retrieve(uploaded.id)
    with pytest.raises(NotFoundError):
        client.files.content(uploaded.id)
    assert client.files.retrieve(plain.id).id == plain.id


@pytest.mark.parametrize("fields, param", [
    ({"expires_after[anchor]": "last_active_at", "expires_after[seconds]": "7200"}, "expires_after[anchor]"),
    ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "3599"}, "expires_after[seconds]"),
    ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "2592001"}, "expires_after[seconds]"),
    ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "soon"}, "expires_after[seconds]"),
    ({"expires_after[anchor]": "created_at"}, "expires_after[seconds]"),
    ({"expires_after[seconds]": "7200"}, "expires_after[anchor]"),
])
def test_bad_upload_expiry_is_400_naming_the_field(client, creds, fields, param):
    response = client.post("/v1/files", headers=creds.key("alice"), files={"file": ("in.jsonl", chat_lines(1))},
                           data={"purpose": "batch", **fields})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param and response.json()["error"]["code"] == "invalid_expires_after"


@pytest.mark.parametrize("policy, param", [
    ({"anchor": "created_at", "seconds": 60}, "output_expires_after.seconds"),
    ({"anchor": "created_at", "seconds": 2_592_001}, "output_expires_after.seconds"),
    ({"anchor": "completed_at", "seconds": HOUR}, "output_expires_after.anchor"),
])
def test_bad_output_expiry_is_422_naming_the_field(client, creds, policy, param):
    alice = creds.key("alice")
    file_id = client.post("/v1/files", headers=alice, files={"file": ("in.jsonl", chat_lines(1))},
                          data={"purpose": "batch"}).json()["id"]
    response = client.post("/v1/batches", headers=alice, json={
        "input_file_id": file_id, "endpoint": CHAT, "completion_window": "24h", "output_expires_after": policy})
    assert response.status_code == 422, response.text
    assert response.json()["error"]["param"] == param


def test_batch_output_expires_after_reaches_its_files_and_housekeeping_deletes_them(live_server, creds, api_store):
    from openai import NotFoundError

    from llm_batch.core.config import get_settings
    from llm_batch.core.layout import JobLayout
    from llm_batch.infra import storage
    from llm_batch.pipeline import housekeeping
    from llm_batch.pipeline.steps import _record_file

    client = _sdk(live_server, creds)
    uploaded = client.files.create(file=("in.jsonl", chat_lines(2)), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h",
                                  output_expires_after={"anchor": "created_at", "seconds": 3 * HOUR})
    job = api_store.get_job(batch.id)
    assert job.input.output_expires_after_s == 3 * HOUR
    assert "output_expires_after_s" not in (batch.metadata or {})

    # What finalize records (steps._record_file) for the batch's output and error files.
    layout = JobLayout(get_settings().work_uri, job.id)
    storage.write_bytes(layout.output_jsonl, b'{"custom_id": "req-0"}\n')
    storage.write_bytes(layout.errors_jsonl, b'{"custom_id": "req-1"}\n')
    output = _record_file(api_store, job, layout.output_jsonl, "output")
    errors = _record_file(api_store, job, layout.errors_jsonl, "error")
    api_store.set_outputs(job.id, output_file_id=output.id, error_file_id=errors.id)
    shown = client.files.retrieve(output.id)
    assert shown.expires_at == shown.created_at + 3 * HOUR
    assert client.files.retrieve(errors.id).expires_at is not None
    assert client.files.content(output.id).content.startswith(b'{"custom_id"')

    deleted = housekeeping.delete_files_past_expiry(api_store, now=output.expires_at + timedelta(minutes=1))
    assert {output.id, errors.id} <= set(deleted) and uploaded.id not in deleted
    for file_id in (output.id, errors.id):
        with pytest.raises(NotFoundError):
            client.files.content(file_id)
    assert not storage.exists(layout.output_jsonl)
    assert client.batches.retrieve(batch.id).output_file_id == output.id  # the batch stays readable


def test_without_a_policy_output_files_follow_the_retention(client, creds, api_store):
    alice = creds.key("alice")
    file_id = client.post("/v1/files", headers=alice, files={"file": ("in.jsonl", chat_lines(1))},
                          data={"purpose": "batch"}).json()["id"]
    batch = client.post("/v1/batches", headers=alice, json={"input_file_id": file_id, "endpoint": CHAT}).json()
    assert api_store.get_job(batch["id"]).input.output_expires_after_s is None


def test_a_policy_is_capped_by_the_retention():
    from llm_batch.api.uploads import expiry
    from llm_batch.core.config import get_settings

    settings = get_settings().model_copy(update={"retention_days": 7})
    assert expiry(settings, 2 * HOUR) == timedelta(hours=2)
    assert expiry(settings, 2_592_000) == timedelta(days=7)
    assert expiry(settings, None) is None
