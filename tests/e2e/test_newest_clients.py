"""The newest official clients, each unchanged in its own venv (scripts/sdk_venvs.sh), run a
create-wait-download flow against the real embedded stack (real runs on the tiny model),
as a non-admin user."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import orjson
import pytest

from tests.e2e.conftest import MODEL
from tests.sdk.conftest import SCALE_V2_TYPES_REFUSE, newest, venv_python

pytestmark = pytest.mark.e2e

FLOW = Path(__file__).parent / "flows" / "newest_client.py"


@pytest.fixture(scope="module")
def erin_key(e2e_stack) -> str:
    from llm_batch.infra.jobstore import get_job_store

    return get_job_store(e2e_stack.settings.database_url).create_api_key("erin", "newest clients e2e")[1]


@pytest.mark.parametrize(("package", "client"), [("openai", "openai"), ("mistralai", "mistralai"), ("scale-llm-engine", "scale")])
def test_newest_client_runs_a_batch_on_the_stack(e2e_stack, erin_key, llm_batch_home, package, client):
    env = {**os.environ, "BASE": e2e_stack.base_url, "KEY": erin_key, "MODEL": MODEL,
           "LLM_ENGINE_BASE_PATH": f"{e2e_stack.base_url}/batch/", "SCALE_API_KEY": erin_key,
           "LLM_ENGINE_DISABLE_VERSION_CHECK": "true"}
    done = subprocess.run([venv_python(newest(package)), str(FLOW), client], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    ids = [f"q{i}" for i in range(6)]
    if client == "openai":
        assert seen["status"] == "completed" and seen["counts"] == {"total": 6, "completed": 6, "failed": 0}
        assert seen["ids"] == ids and seen["model"] == MODEL
        assert seen["usage"]["input_tokens"] > 0 and seen["usage"]["output_tokens"] > 0
        assert seen["usage"]["total_tokens"] == seen["usage"]["input_tokens"] + seen["usage"]["output_tokens"]
    elif client == "mistralai":
        assert seen["status"] == "SUCCESS" and seen["counts"] == [6, 6, 6, 0] and seen["ids"] == ids
    else:  # every output item parsed by the client's own type (v2 chat; v1 route: CompletionOutput)
        assert seen["status"] == "completed" and seen["metadata"]["succeeded_requests"] == 6
        assert seen["output"] == str(llm_batch_home / "data" / "erin" / "e2e" / "newest-scale-client.json")
        assert len(orjson.loads(Path(seen["output"]).read_bytes())) == 6
        chat = seen["chat"]
        assert (chat["type"], chat["objects"], chat["unknown"]) == ("CreateChatCompletionResponse", ["chat.completion"], [])
        assert {tuple(entry) for entry in chat["invalid"]} <= SCALE_V2_TYPES_REFUSE, chat["invalid"]
        v1 = seen["v1"]
        assert (v1["status"], v1["succeeded"], v1["type"]) == ("completed", 6, "CompletionOutput")
        assert (v1["parsed"], v1["invalid"], v1["unknown"]) == (6, [], [])
        assert v1["fields"] == ["num_completion_tokens", "num_prompt_tokens", "text", "tokens"]
        for item in v1["items"]:  # one TokenOutput per generated token, asked for
            assert item["tokens"] == item["num_completion_tokens"] <= 8 and item["num_prompt_tokens"] > 0
        assert sum(item["tokens"] for item in v1["items"]) > 0
