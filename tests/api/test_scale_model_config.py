"""Scale's model_config at the API: the exact bodies llmengine's Completion.batch_create posts
(captured from the real clients, tests/api/scale_v2_bodies/, see capture.py there) are
accepted and stored as what was set; engine fields are honoured or refused by name.

The user's report: 0.0.0b45's batch_create(use_v2=True) serialises every field of its model
config DTO, defaults included, and was answered 400 `model_config.trust_remote_code:
unknown field`.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from llm_batch.core.config import get_settings
from llm_batch.core.model_config import BUILTIN_CHAT_TEMPLATES, validate_model_config
from llm_batch.infra.model_registry import load_registry
from llm_batch.infra.model_resolution import job_engine_args
from tests.api.conftest import dag_run_of

pytestmark = pytest.mark.airflow

BODIES = Path(__file__).parent / "scale_v2_bodies"


def captured(name: str) -> tuple[str, dict]:
    """(route below /batch, body) of a captured client call."""
    record = json.loads((BODIES / f"{name}.json").read_text())
    return record["path"], record["body"]


def engine_args_of(model_config: dict) -> dict:
    """What the worker will pass to vllm.LLM for this stored model_config (but `model`)."""
    return job_engine_args(validate_model_config(model_config), load_registry())


REGISTRY_DEFAULTS = {"seed": 0, "enable_prefix_caching": True, "max_model_len": 8192, "dtype": "bfloat16"}


@pytest.mark.parametrize("name", ["b45-v2", "b45-v1", "b36-v1"])
def test_the_body_each_client_sends_is_accepted_and_stores_what_was_set(client, creds, api_store, name):
    route, body = captured(name)
    response = client.post(route, headers=creds.key("alice"), json=body)
    assert response.status_code == 200, response.text
    job = api_store.get_job(response.json()["job_id"])
    assert job.owner == "alice" and job.model == "smollm2-135m-instruct"
    # Every field was at null or the client's default: only the model is stored, and run.
    assert job.model_config == {"model": "smollm2-135m-instruct"}
    assert "model_config" not in dag_run_of(job.id)["conf"]  # the store's, not the run's
    assert engine_args_of(job.model_config) == REGISTRY_DEFAULTS
    if route.startswith("/v2/"):
        answer = response.json()
        assert answer["model_config"] == {"model": "smollm2-135m-instruct"} and answer["status"] == "queued"
        # Scale's client reads metadata as str -> str (pydantic v1 turns numbers into str):
        # flat scalars only, no nulls, no objects.
        assert all(isinstance(v, str | int | float) and not isinstance(v, bool) for v in answer["metadata"].values())


def test_engine_fields_set_through_the_client_are_honoured(client, creds, api_store):
    route, body = captured("b45-v2-tuned")
    response = client.post(route, headers=creds.key("alice"), json=body)
    assert response.status_code == 200, response.text
    job = api_store.get_job(response.json()["job_id"])
    assert job.model_config == {
        "model": "smollm2-135m-instruct", "max_model_len": 512, "max_num_seqs": 8, "enforce_eager": True,
        "seed": 7, "dtype": "float32", "gpu_memory_utilization": 0.5, "max_num_batched_tokens": 1024,
        "enable_prefix_caching": False, "tokenizer_mode": "hf", "chat_template": "chatml",
        "response_role": "bot", "served_model_name": "my-model", "limit_mm_per_prompt": '{"image": 0}',
    }
    assert engine_args_of(job.model_config) == {
        "seed": 7, "enable_prefix_caching": False, "max_model_len": 512, "dtype": "float32",
        "max_num_seqs": 8, "enforce_eager": True, "gpu_memory_utilization": 0.5,
        "max_num_batched_tokens": 1024, "tokenizer_mode": "hf", "limit_mm_per_prompt": {"image": 0},
        "chat_template": BUILTIN_CHAT_TEMPLATES["chatml"],
    }


def _b45(output: str, gpus: int | None = None, **fields) -> dict:
    """0.0.0b45's v2 body with some model_config fields set, written to its own output."""
    _, body = captured("b45-v2")
    return {**body, "output_data_path": f"out/{output}.json", "gpus": gpus,
            "model_config": {**body["model_config"], **fields}}


@pytest.mark.parametrize("output, gpus, fields, param, says", [
    ("trc", None, {"trust_remote_code": True}, "model_config.trust_remote_code", "does not allow it"),
    ("tp-gpus", 4, {"tensor_parallel_size": 2}, "model_config.tensor_parallel_size", "gpus=4"),
    ("pp-gpus", 1, {"pipeline_parallel_size": 2}, "model_config.pipeline_parallel_size", "gpus=1"),
    ("rev", None, {"revision": "main"}, "model_config.revision", "hub"),
    ("tools", None, {"tool_call_parser": "hermes", "enable_auto_tool_choice": True}, "model_config.tool_call_parser", "no tools"),
    ("fmt", None, {"load_format": "dummy"}, "model_config.load_format", "only auto and safetensors"),
    ("tpl", None, {"chat_template": "/etc/passwd"}, "model_config.chat_template", "files are not read"),
    ("tpl-name", None, {"chat_template": "llama-3"}, "model_config.chat_template", "chatml"),
    ("len", None, {"max_context_length": 512, "max_model_len": 1024}, "model_config.max_model_len", "disagrees"),
])
def test_a_refused_field_is_a_400_naming_it(client, creds, api_store, output, gpus, fields, param, says):
    jobs_before = api_store.list_jobs(owner="alice", limit=1)[1]
    response = client.post("/v2/batch-completions", headers=creds.key("alice"), json=_b45(output, gpus, **fields))
    assert response.status_code == 400, response.text
    assert response.json()["param"] == param and says in response.json()["detail"], response.text
    assert response.json()["code"] == "invalid_model_config"
    assert api_store.list_jobs(owner="alice", limit=1)[1] == jobs_before  # nothing was made


def test_parallel_sizes_that_fit_the_gpus_reach_the_run(client, creds, api_store):
    response = client.post("/v2/batch-completions", headers=creds.key("alice"),
                           json=_b45("tp-fits", gpus=4, tensor_parallel_size=2, pipeline_parallel_size=2))
    assert response.status_code == 200, response.text
    job = api_store.get_job(response.json()["job_id"])
    conf = dag_run_of(job.id)["conf"]
    assert conf["gpus"] == 4 and "model_config" not in conf
    args = engine_args_of(job.model_config)
    assert (args["tensor_parallel_size"], args["pipeline_parallel_size"]) == (2, 2)


def test_a_wrong_type_is_a_422_naming_the_field(client, creds):
    response = client.post("/v2/batch-completions", headers=creds.key("alice"), json=_b45("type", max_num_seqs="many"))
    assert response.status_code == 422, response.text
    assert "max_num_seqs" in response.text


def test_a_tokenizer_is_a_user_path_of_the_caller(client, creds, api_store, alice_dir, llm_batch_home):
    tokenizer = alice_dir / "tokenizers" / "mine"
    tokenizer.mkdir(parents=True, exist_ok=True)
    bob = llm_batch_home / "data" / "bob" / "tokenizer"
    bob.mkdir(parents=True, exist_ok=True)
    db = get_settings().database_url.removeprefix("sqlite:///")
    for output, target, code in [("tok-bob", str(bob), "path_not_allowed"), ("tok-etc", "/etc", "path_not_allowed"),
                                 ("tok-db", db, "path_not_allowed"),
                                 ("tok-missing", str(alice_dir / "no-such-tokenizer"), None),
                                 ("tok-s3", "s3://bucket/tok", "invalid_model_config"),
                                 ("tok-cache", "../../etc", None)]:
        response = client.post("/v2/batch-completions", headers=creds.key("alice"), json=_b45(output, tokenizer=target))
        assert response.status_code == 400, (target, response.text)
        assert response.json()["param"] == "model_config.tokenizer", (target, response.text)
        if code:
            assert response.json()["code"] == code, (target, response.text)

    response = client.post("/v2/batch-completions", headers=creds.key("alice"), json=_b45("tok-own", tokenizer=str(tokenizer)))
    assert response.status_code == 200, response.text
    stored = api_store.get_job(response.json()["job_id"]).model_config
    assert stored["tokenizer"] == str(tokenizer.resolve())
    assert engine_args_of(stored)["tokenizer"] == str(tokenizer.resolve())


def _b45_python() -> str:
    """An interpreter with scale-llm-engine 0.0.0b45 (it needs openai<2: its own venv),
    built or found up to date by the SDK matrix's script (tests/sdk uses the same venv)."""
    if given := os.environ.get("LLM_BATCH_SCALE_B45_PYTHON"):
        return given
    from tests.sdk.conftest import venv_python

    return venv_python("scale-llm-engine-0.0.0b45")


_CLIENT_CALL = """
import json, sys
from llmengine import Completion
from llmengine.data_types import CreateBatchCompletionsModelConfig, FilteredChatCompletionV2Request
job = Completion.batch_create(
    output_data_path=sys.argv[1],
    model_config=CreateBatchCompletionsModelConfig(model="smollm2-135m-instruct", max_model_len=1024, seed=3),
    content=[FilteredChatCompletionV2Request(messages=[{"role": "user", "content": "Say hi."}], max_tokens=8)],
    use_v2=True,
)
print(json.dumps({"job_id": job.job_id, "status": job.status.value, "max_model_len": job.model_config.max_model_len}))
"""


@pytest.mark.sdk  # a client release in its own venv (scripts/sdk_venvs.sh): not in the quick lane
def test_the_real_b45_client_creates_a_v2_batch(live_server, creds, api_store):
    python = _b45_python()
    env = {**os.environ, "LLM_ENGINE_BASE_PATH": f"{live_server}/batch/", "SCALE_API_KEY": creds.keys["alice"],
           "LLM_ENGINE_DISABLE_VERSION_CHECK": "true"}
    done = subprocess.run([python, "-c", _CLIENT_CALL, "out/b45-real-client.json"], env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    assert answer["status"] == "queued" and answer["max_model_len"] == 1024
    job = api_store.get_job(answer["job_id"])
    assert job.model_config == {"model": "smollm2-135m-instruct", "max_model_len": 1024, "seed": 3}
