"""Settings for the DAG tests, set before the DAG files are parsed: short grace and retry
delay so cancel, deadline and retry paths finish in seconds."""

from __future__ import annotations

import os

os.environ.setdefault("LLM_BATCH_CANCEL_GRACE_SECONDS", "20")
os.environ.setdefault("LLM_BATCH_SHARD_RETRY_DELAY_SECONDS", "1")
os.environ.setdefault("LLM_BATCH_SHARD_RUNNER", "local")
os.environ.setdefault("LLM_BATCH_LOCAL_POOL_SLOTS", "2")

from llm_batch.config import get_settings  # noqa: E402

get_settings.cache_clear()
