"""LoRA adapters through the API with the official clients and a real run of batch_inference
(dag.test, the real vLLM engine on the tiny random Llama and three random adapters of it):

- openai: one file whose lines name three adapters and the base (and one line naming an
  adapter of another base, one an unknown model): one job, each good line answered by the
  model it named (the response's ``model``), the two refused lines error records with their
  line number and ``model_not_available``, usage per model;
- mistralai: a job whose model is an adapter: its lines, naming none, run on it;
- scale-llm-engine: ``model_config.model`` an adapter: every result from it;
- the native route: a job of an unknown adapter is a 400 naming it, never a job.
"""

from __future__ import annotations

import json

import orjson
import pytest

from llm_batch.core.config import get_settings
from llm_batch.runtime.warm_engines import Slot, engine_key
from tests.api.test_end_to_end import DAG_TEST_USER, dag_test_key  # noqa: F401 - fixture re-used

pytestmark = [pytest.mark.airflow, pytest.mark.engine]

BASE = "tiny-random-llama"
ADAPTERS = ("tiny-lora-a", "tiny-lora-b", "tiny-lora-c")


def _line(custom_id: str, model: str, prompt: str = "The quick brown fox") -> bytes:
    return orjson.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": {
        "model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 6, "temperature": 0}}) + b"\n"


def test_openai_file_mixing_adapters_and_the_base(live_server, dag_test_key, dag_bag, tiny_adapters, engine_env,  # noqa: F811
                                                   api_store):
    from openai import OpenAI

    client = OpenAI(api_key=dag_test_key, base_url=f"{live_server}/batch/v1", max_retries=0)
    models = [*ADAPTERS, BASE] * 3
    content = b"".join(_line(f"ok-{i}", model) for i, model in enumerate(models))
    content += _line("other-base", "smollm2-lora-a") + _line("unknown", "no-such-adapter")
    uploaded = client.files.create(file=("mixed.jsonl", content), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    dag_bag.get_dag("batch_inference").test(run_conf={"job_id": batch.id})

    done = client.batches.retrieve(batch.id)
    assert done.status == "completed", (done.status, done.errors)
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (14, 12, 2)
    results = [orjson.loads(line) for line in client.files.content(done.output_file_id).content.splitlines()]
    assert [r["custom_id"] for r in results] == [f"ok-{i}" for i in range(12)]
    assert [r["response"]["body"]["model"] for r in results] == models
    texts = {}
    for model, result in zip(models, results, strict=True):
        texts.setdefault(model, set()).add(result["response"]["body"]["choices"][0]["message"]["content"])
    assert all(len(t) == 1 for t in texts.values()), texts  # one answer per model to the one prompt
    assert len({t.pop() for t in texts.values()}) == 4, "an adapter answered as the base or another adapter"
    errors = [orjson.loads(line) for line in client.files.content(done.error_file_id).content.splitlines()]
    assert [(e["custom_id"], e["line"], e["error"]["code"]) for e in errors] == [
        ("other-base", 13, "model_not_available"), ("unknown", 14, "model_not_available")]
    assert "smollm2-lora-a" in errors[0]["error"]["message"] and "tiny-lora-b" in errors[0]["error"]["message"]
    usage = api_store.get_job(batch.id).model_usage
    assert {m: u["succeeded"] for m, u in usage.items()} == {m: 3 for m in models[:4]}


def test_mistral_job_on_an_adapter(live_server, dag_test_key, dag_bag, tiny_adapters, engine_env):  # noqa: F811
    from mistralai.client import Mistral

    client = Mistral(api_key=dag_test_key, server_url=f"{live_server}/batch")
    lines = b"".join(orjson.dumps({"custom_id": f"m{i}", "body": {
        "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}}) + b"\n" for i in range(3))
    uploaded = client.files.upload(file={"file_name": "m.jsonl", "content": lines}, purpose="batch")
    job = client.batch.jobs.create(input_files=[uploaded.id], model="tiny-lora-b", endpoint="/v1/chat/completions")
    assert job.model == "tiny-lora-b"
    dag_bag.get_dag("batch_inference").test(run_conf={"job_id": job.id})
    done = client.batch.jobs.get(job_id=job.id)
    assert done.status == "SUCCESS" and done.succeeded_requests == 3, done
    output = client.files.download(file_id=done.output_file).read().splitlines()
    assert [orjson.loads(line)["response"]["body"]["model"] for line in output] == ["tiny-lora-b"] * 3
    # Its prepare step started (or found) the base's one LoRA engine, not an engine of its own
    # without LoRA, and that engine never reloaded for the shard.
    home = get_settings().home
    assert not Slot(home, engine_key({"model": "tiny-lora-b"}), 0).log.exists()
    log = Slot(home, engine_key({"model": BASE}, lora=True), 0).log.read_text()
    assert log.count("starting vLLM") == log.count("warm engine listening") >= 1, log[-3000:]


def test_scale_job_on_an_adapter(live_server, dag_test_key, dag_bag, tiny_adapters, engine_env, llm_batch_home,  # noqa: F811
                                 monkeypatch):
    from llmengine import Completion, api_engine
    from llmengine.data_types import CreateBatchCompletionsModelConfig, CreateBatchCompletionsRequestContent

    monkeypatch.setattr(api_engine, "base_path", f"{live_server}/batch/")
    monkeypatch.setattr(api_engine, "api_key", dag_test_key)
    output_path = llm_batch_home / "data" / DAG_TEST_USER / "lora-scale" / "out.json"
    created = Completion.batch_create(
        output_data_path=str(output_path),
        model_config=CreateBatchCompletionsModelConfig(model="tiny-lora-c", labels={}),
        content=CreateBatchCompletionsRequestContent(prompts=["one", "two"], max_new_tokens=4, temperature=0.0),
    )
    dag_bag.get_dag("batch_inference").test(run_conf={"job_id": created.job_id})
    job = api_engine.APIEngine._get(f"v2/batch-completions/{created.job_id}", timeout=30)["job"]
    assert job["status"] == "completed" and job["metadata"]["succeeded_requests"] == 2, job
    assert len(json.loads(output_path.read_text())) == 2


def test_a_job_of_an_unknown_adapter_is_refused(client, creds):
    response = client.post("/v1/jobs", headers=creds.key("alice"), json={
        "model": "tiny-lora-z", "endpoint": "/v1/chat/completions",
        "requests": [{"custom_id": "a", "body": {"messages": [{"role": "user", "content": "hi"}]}}]})
    assert response.status_code == 400 and "tiny-lora-z" in response.text, response.text
    assert response.json()["code"] == "unknown_model"  # the native route's error shape
