"""The Airflow plugin: mounts the batch API (``create_app``) at ``/batch`` on the api-server."""

from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin

from llm_batch_plugin.app import create_app


class LlmBatchPlugin(AirflowPlugin):
    name = "llm_batch"
    fastapi_apps = [{"app": create_app(), "url_prefix": "/batch", "name": "llm-batch API"}]
