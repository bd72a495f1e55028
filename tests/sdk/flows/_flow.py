"""What the flow scripts share. A flow runs in one SDK venv (scripts/sdk_venvs.sh), with
nothing of llm-batch importable: `python <dialect>_flow.py STEP '<json args>'` with
LLM_BATCH_BASE_URL (`<server>/batch`) and LLM_BATCH_API_KEY in the environment, and prints
one JSON object: what the client observed (ids, statuses, counts, custom_ids, errors).
An exception a step does not expect ends the script with its traceback (the test shows it)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from importlib.metadata import version
from typing import Any


def run(package: str, steps: dict[str, Callable[..., dict[str, Any]]]) -> None:
    step = sys.argv[1]
    args = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    observed = steps[step](os.environ["LLM_BATCH_BASE_URL"], os.environ["LLM_BATCH_API_KEY"], **args)
    observed["client"] = f"{package}=={version(package)}"
    print(json.dumps(observed, default=str))


def refusal(call: Callable[[], Any]) -> dict[str, Any] | None:
    """The error a call raised, as the client gave it: class, module, HTTP status where the
    client keeps one, body; None if the call succeeded."""
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - reporting whatever the client raised is the point
        response = getattr(exc, "response", None) or getattr(exc, "raw_response", None)
        status = getattr(exc, "status_code", None) or getattr(response, "status_code", None)
        body = getattr(exc, "body", None) or (response.text if response is not None else str(exc))
        return {"type": type(exc).__name__, "module": type(exc).__module__, "status": status,
                "body": body if isinstance(body, (dict, list)) else str(body)[:2000]}
    return None


def custom_ids(jsonl: str | bytes) -> list[str]:
    """The custom_id of each line of an output or error file, in file order."""
    if isinstance(jsonl, bytes):
        jsonl = jsonl.decode()
    return [json.loads(line).get("custom_id") for line in jsonl.splitlines() if line.strip()]
