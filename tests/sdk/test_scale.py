"""Scale's client (scale-llm-engine, module llmengine), each release of the matrix, in its own
venv: Completion.batch_create on the default (v1) route, and with use_v2=True where the
release has it. Paths are relative (taken from alice's own folder) or inside that folder."""

from __future__ import annotations

import json

import pytest

from llm_batch.jobs import JobStatus
from tests.sdk.conftest import finish, releases, since

pytestmark = [pytest.mark.airflow, pytest.mark.sdk]

MODEL = "tiny-random-llama"


def error_type(refusal):
    return refusal and refusal["type"]  # llmengine's class names the status (BadRequestError = 400, ...)


@pytest.mark.parametrize("release", releases("scale-llm-engine"))
def test_scale_batch_create(release, sdk, creds, api_store, alice_dir, llm_batch_home):
    flow = sdk(release)
    (alice_dir / "in").mkdir(exist_ok=True)
    (alice_dir / "in" / f"{release}.json").write_text(json.dumps({"prompts": ["a", "b"], "max_new_tokens": 4, "temperature": 0.0}))
    created = flow.run("create_v1", model=MODEL, labels={"team": release}, prompts=["What is deep learning", "Hi", "Bye"],
                       output_path=f"out/{release}-inline.json", input_path=f"in/{release}.json",
                       file_output_path=str(alice_dir / "out" / f"{release}-file.json"),
                       foreign_path=str(llm_batch_home / "data" / "bob" / "steal.json"))
    inline, from_file = api_store.get_job(created["inline"]), api_store.get_job(created["from_file"])
    assert (inline.owner, inline.input_format, inline.labels) == ("alice", "scale-v1", {"team": release})
    assert (from_file.owner, from_file.input_format) == ("alice", "scale-v1")
    refused = created["refused"]
    assert error_type(refused["unknown_model"]) == "BadRequestError" and "no-such-model" in refused["unknown_model"]["body"]
    assert error_type(refused["foreign_path"]) == "BadRequestError" and "outside your storage namespace" in refused["foreign_path"]["body"]
    v2_calls = created["has_v2"]
    assert v2_calls == since(release, "0.0.0b38")  # use_v2, get_batch_completion, cancel_batch_completion
    if v2_calls:
        assert created["status"] == "queued" and created["cancel"] == {"success": True}
        api_store.transition(created["from_file"], JobStatus.CANCELLED)
    else:  # batch_create (v1) only: no get or cancel call
        assert created["status"] is None and "cancel" not in created

    finish(api_store, created["inline"], ok=3, failed=0)
    done = flow.run("results", job_id=created["inline"], local_path=str(alice_dir / "out" / f"{release}-inline.json"))
    assert done["results"] == 3 and done["status"] == ("completed" if v2_calls else None)

    foreign = flow.run("foreign", key=creds.keys["bob"], job_id=created["inline"])["refused"]
    if v2_calls:
        assert {name: error_type(r) for name, r in foreign.items()} == {"get": "NotFoundError", "cancel": "NotFoundError"}


@pytest.mark.parametrize("release", releases("scale-llm-engine"))
def test_scale_batch_create_v2(release, sdk, api_store, alice_dir):
    flow = sdk(release)
    messages = [[{"role": "user", "content": "What is a good place for travel in the US?"}],
                [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]]
    (alice_dir / "in").mkdir(exist_ok=True)
    (alice_dir / "in" / f"{release}-v2.json").write_text(json.dumps([{"messages": m, "max_tokens": 4} for m in messages]))
    created = flow.run("create_v2", model=MODEL, labels={"team": release}, messages=messages,
                       output_path=f"out/{release}-v2.json", input_path=f"in/{release}-v2.json",
                       file_output_path=f"out/{release}-v2-file.json")
    if created["v2"] is None:
        assert not since(release, "0.0.0b38")
        pytest.skip(f"{release} has no use_v2 (batch_create on the v1 route only)")
    job = api_store.get_job(created["v2"]["id"])
    assert (job.owner, job.input_format, job.labels) == ("alice", "scale-v2", {"team": release})
    assert created["v2"]["status"] == "queued" and created["got"]["status"] == "queued"
    assert created["v2"]["output_data_path"].endswith(f"{release}-v2.json")
    assert created["from_file"]["priority"] == "high" and api_store.get_job(created["from_file"]["id"]).input_format == "scale-v2"
    assert created["cancel"] == {"success": True} and created["cancelled_status"] in ("running", "cancelled")
    assert error_type(created["refused"]["unknown_model"]) == "BadRequestError"

    finish(api_store, job.id, ok=2, failed=0)
    done = flow.run("results", job_id=job.id, local_path=str(alice_dir / "out" / f"{release}-v2.json"))
    assert done == {"status": "completed", "results": 2, "client": done["client"]}
