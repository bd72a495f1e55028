"""Airflow finds the plugin through its entry point and serves the app at /batch, building
it only in the api-server (every other Airflow process loads plugins too)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.airflow

# Loads plugins as the named Airflow command would and prints what it found.
_PROBE = """
import json, sys
sys.argv = ["airflow", sys.argv[1]]
from airflow import plugins_manager
apps, _ = plugins_manager.get_fastapi_plugins()
ours = [entry for entry in apps if entry.get("url_prefix") == "/batch"]
errors = {k: v for k, v in plugins_manager.get_import_errors().items() if "already registered" not in v}
paths = list(ours[0]["app"].openapi()["paths"]) if ours else []
print("PROBE " + json.dumps({"apps": len(ours), "paths": paths, "errors": errors}), flush=True)
"""


def _probe(command: str, **env: str) -> dict:
    import os

    done = subprocess.run([sys.executable, "-c", _PROBE, command], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env}, check=True)
    # The app's background threads (the webhook deliverer) may log to stdout too, even onto
    # the probe's line: the first JSON object after the marker is the probe's.
    found = [line for line in done.stdout.splitlines() if line.startswith("PROBE ")]
    assert len(found) == 1, done.stdout[-2000:]
    return json.JSONDecoder().raw_decode(found[0].removeprefix("PROBE "))[0]


def test_airflow_loads_the_plugin_with_the_app_at_batch_on_the_api_server(airflow_db):
    served = _probe("api-server")
    assert served["apps"] == 1 and "/v1/batches" in served["paths"]
    # An editable install run from the checkout lists the distribution twice (the
    # llm_batch.egg-info beside pyproject and the venv's dist-info): Airflow skips the twin.
    assert not served["errors"]


def test_other_airflow_processes_do_not_build_the_app(airflow_db):
    from llm_batch.api.plugin import serving_api

    assert _probe("scheduler")["apps"] == 0
    assert _probe("scheduler", LLM_BATCH_SERVE_API="true")["apps"] == 1
    assert [serving_api(["airflow", c]) for c in ("api-server", "dag-processor", "triggerer", "tasks")] == [True, False, False, False]
