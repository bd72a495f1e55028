"""Scale's client (scale-llm-engine, module llmengine), each release of the matrix, in its own
venv: Completion.batch_create on the default (v1) route, and with use_v2=True where the
release has it. Paths are relative (taken from alice's own folder) or inside that folder.
Every output item is parsed by the client's own type for its job's content: CompletionOutput
for v1 prompts (either route), the v2 response types for v2 completion and chat requests."""

from __future__ import annotations

import json

import pytest

from llm_batch.core.jobs import JobStatus
from tests.sdk.conftest import SCALE_V2_TYPES_REFUSE, finish, releases, since

pytestmark = [pytest.mark.airflow, pytest.mark.sdk]

MODEL = "tiny-random-llama"
V1_FIELDS = ["num_completion_tokens", "num_prompt_tokens", "text", "tokens"]  # exactly CompletionOutput's


def assert_v2_items(parsed, kind, may_refuse=SCALE_V2_TYPES_REFUSE):
    """v2 items: the client's v2 response type's fields only, every value taken by it but those
    its generated types refuse in every real body (SCALE_V2_TYPES_REFUSE)."""
    assert parsed["objects"] == [kind] and parsed["unknown"] == []
    assert {tuple(entry) for entry in parsed["invalid"]} <= may_refuse, parsed["invalid"]


def assert_v1_items(parsed, count, log_probs):
    """v1 items: each a CompletionOutput, with its fields and no other; tokens (one per generated
    token) only when asked."""
    assert parsed["type"] == "CompletionOutput" and parsed["fields"] == V1_FIELDS
    assert (parsed["parsed"], parsed["invalid"], parsed["unknown"]) == (count, [], [])
    assert len(parsed["items"]) == count
    for item in parsed["items"]:
        assert item["num_completion_tokens"] > 0
        assert item["tokens"] == (item["num_completion_tokens"] if log_probs else 0)
        assert item["spelled"] is (True if log_probs else None)  # the tokens spell the text


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
    assert api_store.get_job(created["logprobs"]).input_format == "scale-v1"
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
    done = flow.run("results", job_id=created["inline"], local_path=str(alice_dir / "out" / f"{release}-inline.json"),
                    shape="v1")
    assert done["results"] == 3 and done["status"] == ("completed" if v2_calls else None)
    assert_v1_items(done["parsed"], 3, log_probs=False)
    finish(api_store, created["logprobs"], ok=3, failed=0)
    done = flow.run("results", job_id=created["logprobs"], shape="v1",
                    local_path=str(alice_dir / "out" / f"{release}-inline.json.logprobs.json"))
    assert_v1_items(done["parsed"], 3, log_probs=True)

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
    prompts = ["What is deep learning", "Hi", "Bye"]
    created = flow.run("create_v2", model=MODEL, labels={"team": release}, messages=messages, prompts=prompts,
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
    done = flow.run("results", job_id=job.id, local_path=str(alice_dir / "out" / f"{release}-v2.json"), shape="chat")
    assert (done["status"], done["results"]) == ("completed", 2)
    assert done["parsed"]["type"] == "CreateChatCompletionResponse"
    assert_v2_items(done["parsed"], "chat.completion")

    # Completion requests: text_completion bodies; v1 prompts on the v2 route: CompletionOutput items.
    for name, shape, kind in (("completions", "completion", "scale-v2"), ("v1_content", "v1", "scale-v1")):
        made = created[name]
        assert api_store.get_job(made["id"]).input_format == kind
        finish(api_store, made["id"], ok=3, failed=0)
        done = flow.run("results", job_id=made["id"], local_path=made["output_data_path"], shape=shape)
        assert (done["status"], done["results"]) == ("completed", 3)
        if shape == "v1":
            assert_v1_items(done["parsed"], 3, log_probs=False)
        else:
            assert done["parsed"]["type"] == "CreateCompletionResponse"
            # With logprobs asked, nothing is null that the types refuse: each item parses.
            assert_v2_items(done["parsed"], "text_completion", may_refuse=set())
            assert done["parsed"]["parsed"] == 3


ADAPTER = "tiny-lora-c"  # a LoRA adapter of MODEL (src/llm_batch/models.yaml, `adapters:`)


@pytest.mark.parametrize("release", releases("scale-llm-engine"))
def test_scale_adapter_batch_create(release, sdk, api_store, alice_dir):
    """model_config.model naming a LoRA adapter: the job's model is the adapter (its base runs,
    every request on the adapter), on the v1 route and, where the release has it, the v2 one."""
    flow = sdk(release)
    messages = [[{"role": "user", "content": "Hi"}], [{"role": "user", "content": "Bye"}]]
    created = flow.run("create_adapter", model=ADAPTER, unknown_model="no-such-adapter", prompts=["a", "b", "c"],
                       messages=messages, output_path=f"out/{release}-adapter.json")
    v1 = api_store.get_job(created["v1"]["id"])
    assert (v1.owner, v1.input_format, v1.model) == ("alice", "scale-v1", ADAPTER)
    refused = created["refused"]
    assert error_type(refused["unknown_v1"]) == "BadRequestError"
    assert "no-such-adapter" in refused["unknown_v1"]["body"]  # llmengine's errors keep the message only
    assert created["has_v2"] == since(release, "0.0.0b38")
    if created["has_v2"]:
        v2 = created["v2"]
        assert (v2["status"], v2["model"], v2["got"]) == ("queued", ADAPTER, {"status": "queued", "model": ADAPTER})
        job = api_store.get_job(v2["id"])
        assert (job.input_format, job.model) == ("scale-v2", ADAPTER)
        assert error_type(refused["unknown_v2"]) == "BadRequestError" and "no-such-adapter" in refused["unknown_v2"]["body"]

    finish(api_store, v1.id, ok=3, failed=0)
    done = flow.run("results", job_id=v1.id, local_path=str(alice_dir / "out" / f"{release}-adapter.json"), shape="v1")
    assert done["results"] == 3 and done["status"] == ("completed" if created["has_v2"] else None)
    assert_v1_items(done["parsed"], 3, log_probs=False)
    if created["has_v2"]:
        finish(api_store, created["v2"]["id"], ok=2, failed=0)
        done = flow.run("results", job_id=created["v2"]["id"], local_path=created["v2"]["output_data_path"], shape="chat")
        assert (done["status"], done["results"]) == ("completed", 2)
        assert_v2_items(done["parsed"], "chat.completion")
