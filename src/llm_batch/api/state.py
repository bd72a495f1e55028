"""What the app holds for its routes (settings, the job store) and the API's limits.

``create_app`` puts one ``ApiState`` on ``app.state.llm_batch``; routes reach it through
the ``*Dep`` annotations below, so tests can build an app around any store. (The DAG
trigger is per request: ``dag_trigger.TriggerDep``.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Request

from llm_batch.api.throttle import Throttle
from llm_batch.core.config import Settings
from llm_batch.core.run_conf import BATCH_DAG_ID
from llm_batch.infra.jobstore import JobStore

DAG_ID = BATCH_DAG_ID

# Limits the API enforces before anything reaches the store or storage.
MAX_JSON_BODY_BYTES = 64 * 1024**2  # inline requests (Mistral requests, Scale content)
MAX_INLINE_REQUESTS = 100_000
MAX_PAGE_SIZE = 1000  # Mistral page_size, Scale/our lists
MAX_OPENAI_PAGE_SIZE = 100  # OpenAI's documented limit for list endpoints
# Metadata / labels: OpenAI documents 16 pairs; the other dialects get more room, still bounded.
MAX_OPENAI_METADATA_PAIRS = 16
MAX_PAIRS = 64
MAX_PAIR_KEY = 64
MAX_PAIR_VALUE = 512


def check_pairs(value: dict[str, str] | None, *, max_pairs: int = MAX_PAIRS) -> dict[str, str] | None:
    """A pydantic validator body for metadata and labels: at most `max_pairs` pairs, keys up
    to 64 characters, values up to 512 (raises ValueError naming the offending pair)."""
    if value is None:
        return None
    if len(value) > max_pairs:
        raise ValueError(f"at most {max_pairs} pairs are allowed, got {len(value)}")
    for key, item in value.items():
        if len(key) > MAX_PAIR_KEY:
            raise ValueError(f"key {key[:20]!r}... is longer than {MAX_PAIR_KEY} characters")
        if len(item) > MAX_PAIR_VALUE:
            raise ValueError(f"value of {key!r} is longer than {MAX_PAIR_VALUE} characters")
    return value


@dataclass
class ApiState:
    settings: Settings
    store: JobStore
    # Webhook test events in flight and started lately, per owner (webhook_endpoints.send_test).
    webhook_tests: Throttle = field(default_factory=Throttle)


def get_state(request: Request) -> ApiState:
    return request.app.state.llm_batch


def get_store(request: Request) -> JobStore:
    return request.app.state.llm_batch.store


def get_settings_dep(request: Request) -> Settings:
    return request.app.state.llm_batch.settings


StateDep = Annotated[ApiState, Depends(get_state)]
StoreDep = Annotated[JobStore, Depends(get_store)]
SettingsDep = Annotated[Settings, Depends(get_settings_dep)]
