"""openai-python, each release of the matrix, in its own venv: files + batches."""

from __future__ import annotations

import pytest

from llm_batch.core.jobs import JobStatus
from tests.sdk.conftest import chat_file, error_of, finish, models_file, releases, since

pytestmark = [pytest.mark.airflow, pytest.mark.sdk]


@pytest.mark.parametrize("release", releases("openai"))
def test_openai_batch_flow(release, sdk, creds, api_store, tmp_path):
    flow = sdk(release)
    created = flow.run("create", input_path=str(chat_file(tmp_path / "requests.jsonl", 3)),
                       bad_model_path=str(chat_file(tmp_path / "bad.jsonl", 1, model="no-such-model")),
                       metadata={"run": release})
    batch, uploaded = created["batch"], created["file"]
    assert uploaded["bytes"] == (tmp_path / "requests.jsonl").stat().st_size and uploaded["purpose"] == "batch"
    assert uploaded["filename"] == "requests.jsonl"
    assert batch["status"] == "validating" and batch["metadata"] == {"run": release}
    assert batch["input_file_id"] == uploaded["id"] and batch["endpoint"] == "/v1/chat/completions"
    assert created["cancelled"]["status"] == "cancelled"  # still queued: ended at once
    refused = created["refused"]
    assert error_of(refused["unknown_model"]) == ("BadRequestError", 400)
    assert "no-such-model" in str(refused["unknown_model"]["body"])
    assert error_of(refused["missing_batch"]) == ("NotFoundError", 404)
    assert error_of(refused["wrong_key"]) == ("AuthenticationError", 401)
    assert error_of(refused["file_in_use"]) == ("ConflictError", 409)

    api_store.transition(created["cancelled"]["id"], JobStatus.CANCELLED)  # as its run would, seeing the flag

    seen = {}
    finish(api_store, batch["id"], ok=2, failed=1, while_running=lambda: seen.update(flow.run("get", batch_id=batch["id"])))
    assert seen["status"] == "in_progress" and seen["counts"][0] == 3

    done = flow.run("download", batch_id=batch["id"], input_file_id=uploaded["id"])
    assert done["status"] == "completed" and done["counts"] == [3, 2, 1]
    assert done["outputs"] == ["req-0", "req-1"] and done["errors"] == ["req-2"]
    assert (done["listed"] is not None) == since(release, "1.22.0")  # when batches.list came
    if done["listed"] is not None:
        assert {batch["id"], created["cancelled"]["id"]} <= set(done["listed"])
        assert len(done["listed"]) == len(set(done["listed"]))  # pages through `after` without repeats
    assert uploaded["id"] in done["files"] and done["deleted"] is True
    assert error_of(done["refused"]["deleted_file"]) == ("NotFoundError", 404)

    output_file = api_store.get_job(batch["id"]).output_file_id
    foreign = flow.run("foreign", key=creds.keys["bob"], batch_id=batch["id"], file_id=output_file)["refused"]
    assert {name: error_of(r) for name, r in foreign.items()} == {
        name: ("NotFoundError", 404) for name in ("retrieve", "cancel", "content")}


@pytest.mark.parametrize("release", releases("openai"))
def test_openai_adapter_flow(release, sdk, api_store, tmp_path):
    """A file whose first line names a LoRA adapter is one job on that adapter (its base
    model runs; its other lines may name another adapter of the base, or the base itself)."""
    flow = sdk(release)
    requests = models_file(tmp_path / "adapters.jsonl", ["tiny-lora-a", "tiny-lora-b", "tiny-random-llama"])
    created = flow.run("create_adapter", input_path=str(requests),
                       unknown_path=str(models_file(tmp_path / "unknown.jsonl", ["no-such-adapter", "tiny-lora-a"])),
                       other_base_path=str(models_file(tmp_path / "other.jsonl", ["tiny-lora-a", "smollm2-lora-a"])))
    batch = created["batch"]
    assert batch["status"] == "validating" and created["retrieved"] == {"id": batch["id"], "status": "validating"}
    assert batch["input_file_id"] == created["file"]["id"] and batch["endpoint"] == "/v1/chat/completions"
    assert api_store.get_job(batch["id"]).model == "tiny-lora-a"  # the Batch object has no model field
    unknown = created["refused"]["unknown_adapter"]
    assert error_of(unknown) == ("BadRequestError", 400) and "no-such-adapter" in str(unknown["body"])
    assert unknown["body"]["code"] == "unknown_model"  # openai's APIStatusError.body: the error object
    # A line naming an adapter of another base is that line's error at validation: the create takes it.
    assert created["other_base"]["status"] == "validating"
    assert api_store.get_job(created["other_base"]["id"]).model == "tiny-lora-a"

    finish(api_store, batch["id"], ok=2, failed=1)
    done = flow.run("download", batch_id=batch["id"], input_file_id=created["file"]["id"])
    assert done["status"] == "completed" and done["counts"] == [3, 2, 1]
    assert done["outputs"] == ["req-0", "req-1"] and done["errors"] == ["req-2"]
    assert api_store.get_job(batch["id"]).model == "tiny-lora-a"
