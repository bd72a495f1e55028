"""Which stack an ``LLM_BATCH_HOME`` has, for the CLI commands that act on it or on its job store."""

from __future__ import annotations

import os
from collections.abc import Mapping

from llm_batch.core.config import Settings, get_settings
from llm_batch.devstack.celery_stack import CeleryStack
from llm_batch.devstack.stack import STATE_FILE, Stack


def home_stack(settings: Settings | None = None) -> Stack:
    """The Celery shape if the home has one, else the embedded stack (on the home's database)."""
    settings = settings or get_settings()
    if CeleryStack.exists(settings):
        return CeleryStack.create(settings)
    return Stack.create(settings)


def job_store_url(given: str | None = None, *, settings: Settings | None = None,
                  environ: Mapping[str, str] | None = None) -> str:
    """The job store a CLI command opens: `given` (``--database-url``), else
    ``LLM_BATCH_DATABASE_URL`` (of ``environ``, whence ``settings`` came), else the home's
    stack's once ``up`` has made one, else the settings' default (SQLite under the home)."""
    settings = settings or get_settings()
    if given:
        return given
    if (os.environ if environ is None else environ).get("LLM_BATCH_DATABASE_URL"):
        return settings.database_url
    if CeleryStack.exists(settings) or (settings.home / STATE_FILE).exists():
        return home_stack(settings).settings.database_url
    return settings.database_url
