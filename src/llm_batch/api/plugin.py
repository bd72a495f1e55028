"""The Airflow plugin: mounts the batch API (``create_app``) at ``/batch`` on the api-server.

Only the api-server serves ``fastapi_apps``, so the app (its job store, its settings) is built
there alone, as Airflow's edge3 provider does; ``LLM_BATCH_SERVE_API=true`` builds it anywhere."""

from __future__ import annotations

import os
import sys

from airflow.plugins_manager import AirflowPlugin

from llm_batch.api import listeners


def serving_api(argv: list[str] | None = None) -> bool:
    """True in ``airflow api-server`` (or when LLM_BATCH_SERVE_API says so)."""
    forced = os.environ.get("LLM_BATCH_SERVE_API", "").lower()
    if forced in ("1", "true", "yes", "0", "false", "no"):
        return forced in ("1", "true", "yes")
    argv = sys.argv if argv is None else argv
    return len(argv) > 1 and argv[1] == "api-server"


BATCH_JOBS_VIEW = {"name": "Batch jobs", "href": "/batch/ui/jobs", "url_route": "batch-jobs", "destination": "nav",
                   "icon": "/batch/ui/static/icon.svg"}


def _api_entry() -> dict:
    from llm_batch.api.app import create_app  # heavy
    from llm_batch.infra.webhooks import start_in_background  # heavy

    app = create_app()
    # The webhook outbox's deliverer (LLM_BATCH_WEBHOOK_DELIVERER=false: `llm-batch webhook deliver` instead).
    start_in_background(app.state.llm_batch.store, app.state.llm_batch.settings)
    return {"app": app, "url_prefix": "/batch", "name": "llm-batch API"}


def _root_middlewares() -> list[dict]:
    from llm_batch.api.app import StrictJsonBodies, UnroutablePaths  # heavy
    from llm_batch.api.run_guard import RunOwnerGuard  # heavy

    return [
        # Airflow's REST API parses a run's conf with Python's JSON parser, which admits what
        # Airflow later cannot serialise (its scheduler stops on a lone surrogate).
        {"middleware": StrictJsonBodies, "args": [], "kwargs": {"prefixes": ("/api/v2/",)},
         "name": "llm-batch strict JSON bodies"},
        {"middleware": UnroutablePaths, "args": [], "kwargs": {"prefix": "/batch"},
         "name": "llm-batch answers for paths its mount cannot route"},
        # Airflow lets any user change any DAG's runs: a batch run is its job owner's (or an admin's).
        {"middleware": RunOwnerGuard, "args": [], "kwargs": {}, "name": "llm-batch run owners"},
    ]


class LlmBatchPlugin(AirflowPlugin):
    name = "llm_batch"
    fastapi_apps = [_api_entry()] if serving_api() else []
    fastapi_root_middlewares = _root_middlewares() if serving_api() else []
    # "Batch jobs" in Airflow's navigation, shown inside Airflow's UI because url_route is set (docs/ui.md).
    external_views = [BATCH_JOBS_VIEW]
    listeners = [listeners]  # runs and jobs agree (api-server and scheduler)
