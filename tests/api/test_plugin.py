"""Airflow finds the plugin through its entry point and serves the app at /batch."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.airflow


def test_airflow_loads_the_plugin_with_the_app_at_batch(airflow_db):
    from fastapi import FastAPI

    from airflow import plugins_manager

    apps, _ = plugins_manager.get_fastapi_plugins()
    ours = [entry for entry in apps if entry.get("url_prefix") == "/batch"]
    assert len(ours) == 1 and isinstance(ours[0]["app"], FastAPI)
    assert "/v1/batches" in ours[0]["app"].openapi()["paths"]
    # An editable install run from the checkout lists the distribution twice (the
    # llm_batch.egg-info beside pyproject and the venv's dist-info): Airflow skips the twin.
    errors = {k: v for k, v in plugins_manager.get_import_errors().items() if "already registered" not in v}
    assert not errors
