"""What the app holds for its routes (``ApiState`` on ``app.state.llm_batch``, reached through the
``*Dep`` annotations, so tests can build an app around any store) and the API's limits."""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Request

from llm_batch.api.errors import ApiError
from llm_batch.core.config import Settings
from llm_batch.core.run_conf import BATCH_DAG_ID
from llm_batch.infra.jobstore import JobStore

DAG_ID = BATCH_DAG_ID

# Limits the API enforces before anything reaches the store or storage.
MAX_JSON_BODY_BYTES = 64 * 1024**2  # inline requests (Mistral requests, Scale content)
MAX_PAGE_SIZE = 1000  # Mistral page_size, Scale/our lists
MAX_OPENAI_PAGE_SIZE = 100  # OpenAI's documented limit for list endpoints


class Throttle:
    """Admits work that waits on someone else (a webhook test, on its receiver): per owner so many
    starts a minute and so many at once, so many at once in all; past a bound a 429 at once, so a
    flood neither queues nor holds what the rest of the API needs. The bounds are per call (settings)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._lock = threading.Lock()
        self._starts: defaultdict[str, deque[float]] = defaultdict(deque)
        self._running: Counter[str] = Counter()

    @contextlib.contextmanager
    def admit(self, owner: str, *, per_minute: int, at_once: int, in_all: int, busy_for_s: float,
              what: str = "requests") -> Iterator[None]:
        """Hold one of `owner`'s places for the block, or raise the 429 saying which bound was
        reached; ``busy_for_s``: how long one piece of work may take (a concurrency bound's Retry-After)."""
        with self._lock:
            now = self._clock()
            starts = self._starts[owner]
            while starts and starts[0] <= now - 60:
                starts.popleft()
            if len(starts) >= per_minute:
                raise _too_many(f"{owner!r} may start at most {per_minute} {what} a minute", starts[0] + 60 - now)
            if self._running[owner] >= at_once:
                raise _too_many(f"{owner!r} may run at most {at_once} {what} at once", busy_for_s)
            if sum(self._running.values()) >= in_all:
                raise _too_many(f"this server runs at most {in_all} {what} at once", busy_for_s)
            starts.append(now)
            self._running[owner] += 1
        try:
            yield
        finally:
            with self._lock:
                self._running[owner] -= 1
                if not self._running[owner]:
                    del self._running[owner]


def _too_many(message: str, retry_after_s: float) -> ApiError:
    retry = max(1, math.ceil(retry_after_s))
    return ApiError(429, f"{message}: retry in {retry} s", code="rate_limit_exceeded",
                    headers={"Retry-After": str(retry)})


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
