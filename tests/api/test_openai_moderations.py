"""An OpenAI /v1/moderations batch end to end: the newest openai client, in its own venv
(scripts/sdk_venvs.sh), uploads a JSONL file and creates the batch against the live API, a
real run of batch_inference (dag.test, the real vLLM-CPU engine on the tiny random
moderator) runs it, and the client parses each output body with its own
ModerationCreateResponse: every one of OpenAI's categories scored and flagged, one result
per input, in input order; a bad line is an error line with its id. A model mapped to
Mistral's categories is refused at create (400 naming what its map lacks)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.api.test_end_to_end import DAG_TEST_USER
from tests.sdk.conftest import Flow, newest_flow

pytestmark = [pytest.mark.airflow, pytest.mark.engine]

MODEL = "tiny-random-moderator-openai"
CATEGORIES = ["harassment", "harassment/threatening", "hate", "hate/threatening", "illicit", "illicit/violent",
              "self-harm", "self-harm/instructions", "self-harm/intent", "sexual", "sexual/minors", "violence",
              "violence/graphic"]


@pytest.fixture(scope="module")
def openai_flow(api_store, live_server) -> Flow:
    """The newest openai release of the SDK matrix, as the user dag.test runs as."""
    key = api_store.create_api_key(DAG_TEST_USER, "openai moderations")[1]
    return newest_flow("openai", f"{live_server}/batch", key, "openai_moderations_flow.py")


def _jsonl(path: Path, model: str, inputs: list[Any]) -> str:
    lines = [{"custom_id": f"m-{i}", "method": "POST", "url": "/v1/moderations", "body": {"model": model, "input": x}}
             for i, x in enumerate(inputs)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(path)


def test_a_moderation_batch_with_the_openai_client(openai_flow, dag_bag, tiny_moderator_dir, engine_env, tmp_path):
    inputs = ["some text to moderate", ["one", "two", "three"], "", ["last"]]  # "" is an error line
    created = openai_flow.run("create", input_path=_jsonl(tmp_path / "in.jsonl", MODEL, inputs),
                              other_input_path=_jsonl(tmp_path / "other.jsonl", "tiny-random-moderator", inputs))
    assert created["status"] == "validating" and created["endpoint"] == "/v1/moderations"
    refused = created["refused"]
    assert (refused["type"], refused["status"]) == ("BadRequestError", 400), refused
    assert "model_endpoint_mismatch" in str(refused["body"]) and "harassment" in str(refused["body"])

    dag = dag_bag.get_dag("batch_inference")
    assert dag is not None, dag_bag.import_errors
    dag.test(run_conf={"job_id": created["id"]})

    seen = openai_flow.run("results", batch_id=created["id"])
    assert seen["status"] == "completed" and seen["counts"] == [4, 3, 1]
    assert [o["custom_id"] for o in seen["outputs"]] == ["m-0", "m-1", "m-3"]
    assert [e["custom_id"] for e in seen["errors"]] == ["m-2"]
    assert [len(o["parsed"]["results"]) for o in seen["outputs"]] == [1, 3, 1]
    for output in seen["outputs"]:
        assert output["status_code"] == 200 and output["parsed"]["model"] == MODEL
        for result in output["parsed"]["results"]:
            assert sorted(result["category_scores"]) == sorted(result["categories"]) == sorted(CATEGORIES)
            for category, score in result["category_scores"].items():
                assert 0 <= score <= 1 and result["categories"][category] is (score >= 0.5)
            assert result["flagged"] is any(result["categories"].values())
            assert set(result["category_applied_input_types"]) == set(CATEGORIES)
