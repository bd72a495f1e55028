"""Mistakes caught at create, in every dialect, instead of minutes later in a shard: a model
that is not prepared, an input path that does not exist, engine arguments the model's own
config.json rules out. Each is a 400 naming the field (``param``) and a code.

The app here checks models as the embedded stack does (``check_models_at_submit``, off for
the other in-process API tests, which name models they never prepare).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import orjson
import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from tests.api.conftest import chat_lines
from tests.fixtures.engine import TINY_MODEL
from tests.fuzzing import examples

NOT_PREPARED = "smollm2-135m-instruct"  # registered, never prepared in the test home's cache


@pytest.fixture(scope="module")
def strict(auth_manager, api_store, airflow_dags_in_db, tiny_model_dir) -> Iterator:
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from llm_batch.api.app import create_app
    from llm_batch.core.config import get_settings

    settings = get_settings().model_copy(update={"check_models_at_submit": True})
    api = create_app(settings=settings, store=api_store)
    api.state.auth_manager = auth_manager
    outer = FastAPI()
    outer.state.auth_manager = auth_manager
    outer.mount("/batch", api)
    with TestClient(outer, base_url="http://testserver/batch", raise_server_exceptions=False) as client:
        yield client


def _upload(client, headers, content: bytes, purpose: str = "batch") -> str:
    response = client.post("/v1/files", headers=headers, files={"file": ("in.jsonl", content)}, data={"purpose": purpose})
    assert response.status_code == 200, response.text
    return response.json()["id"]


def _create(client, headers, dialect: str, model: str, model_config: dict | None = None,
            input_path: str | None = None) -> tuple[int, dict]:
    """One create in `dialect`; returns (status, the error's {message, param, code})."""
    config = model_config or {}
    if dialect == "native":
        body = {"model": model, "model_config": config}
        body |= {"input_uri": input_path} if input_path else {"requests": [{"custom_id": "a", "body": {"messages": [{"role": "user", "content": "hi"}]}}]}
        response = client.post("/v1/jobs", headers=headers, json=body)
    elif dialect == "mistral":
        body = {"model": model, "endpoint": "/v1/chat/completions",
                "requests": [{"custom_id": "a", "body": {"messages": [{"role": "user", "content": "hi"}]}}]}
        response = client.post("/v1/batch/jobs", headers=headers, json=body)
    elif dialect in ("scale", "scale-v1"):
        body = {"output_data_path": f"out-{uuid.uuid4().hex}.json", "model_config": {"model": model, **config}}
        body |= {"input_data_path": input_path} if input_path else {"content": [{"messages": [{"role": "user", "content": "hi"}]}]}
        url = "/v2/batch-completions" if dialect == "scale" else "/v1/llm/batch-completions"
        response = client.post(url, headers=headers, json=body)
    else:  # openai: the model is in the lines
        file_id = _upload(client, headers, chat_lines(2, model=model))
        response = client.post("/v1/batches", headers=headers,
                               json={"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"})
    body = response.json()
    error = body.get("error") if isinstance(body.get("error"), dict) else body
    return response.status_code, {"message": error.get("message") or error.get("detail"), "param": error.get("param"),
                                  "code": error.get("code")}


@pytest.mark.parametrize("dialect", ["native", "mistral", "scale", "scale-v1", "openai"])
def test_a_model_that_is_not_prepared_is_refused_at_create(strict, creds, dialect):
    status, error = _create(strict, creds.key("alice"), dialect, NOT_PREPARED)
    assert status == 400, error
    assert error["code"] == "model_not_ready" and "llm-batch models prepare" in error["message"], error
    # A prepared one is taken.
    assert _create(strict, creds.key("alice"), dialect, TINY_MODEL)[0] in (200, 201)


@pytest.mark.parametrize("dialect", ["native", "scale", "scale-v1"])
def test_engine_arguments_the_model_rules_out_are_refused_at_create(strict, creds, dialect):
    # The tiny model's config.json: max_position_embeddings 2048, 2 attention heads.
    status, error = _create(strict, creds.key("alice"), dialect, TINY_MODEL, {"max_model_len": 4096})
    assert status == 400 and error["param"] == "model_config.max_model_len" and "2048" in error["message"], error
    status, error = _create(strict, creds.key("alice"), dialect, TINY_MODEL, {"max_model_len": 2048})
    assert status in (200, 201), error


def test_a_tensor_parallel_size_that_does_not_divide_the_heads_is_refused_at_create(strict, creds):
    status, error = _create(strict, creds.key("alice"), "native", TINY_MODEL,
                            {"engine_args": {"tensor_parallel_size": 3}})
    assert status == 400 and error["param"] == "model_config.tensor_parallel_size", error


@pytest.mark.parametrize("dialect", ["native", "scale", "scale-v1"])
def test_an_input_path_that_does_not_exist_is_refused_at_create(strict, creds, alice_dir, dialect):
    missing = str(alice_dir / "no-such-input.jsonl")
    status, error = _create(strict, creds.key("alice"), dialect, TINY_MODEL, input_path=missing)
    assert status == 400, error
    assert error["param"] in ("input_uri", "input_data_path") and error["code"] == "path_unavailable", error
    # In another owner's area, a file that exists and one that does not get the same answer:
    # the check never tells alice what bob has.
    bobs = alice_dir.parent / "bob"
    bobs.mkdir(exist_ok=True)
    (bobs / "in.jsonl").write_bytes(chat_lines(1))
    answers = [_create(strict, creds.key("alice"), dialect, TINY_MODEL, input_path=str(bobs / name))
               for name in ("in.jsonl", "no-such.jsonl")]
    assert answers[0][0] == answers[1][0] == 400
    assert answers[0][1]["code"] == answers[1][1]["code"], answers


@given(max_model_len=st.one_of(st.integers(-2**40, 2**40), st.floats(allow_nan=True), st.text(max_size=8), st.none()),
       tp=st.one_of(st.integers(-8, 64), st.none()))
@hypothesis_settings(max_examples=examples(40), suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_no_engine_argument_value_answers_5xx(strict, creds, max_model_len, tp):
    config = {"max_model_len": max_model_len, "engine_args": {"tensor_parallel_size": tp}}
    response = strict.post("/v1/jobs", headers=creds.key("alice"), json={
        "model": TINY_MODEL, "model_config": orjson.loads(orjson.dumps(config, option=orjson.OPT_SERIALIZE_NUMPY)),
        "requests": [{"custom_id": "a", "body": {"messages": [{"role": "user", "content": "hi"}]}}]})
    assert response.status_code < 500, response.text
