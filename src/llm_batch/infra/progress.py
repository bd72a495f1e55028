"""A shard worker's live counters: ``{shard}/progress.json`` beside the results, and a log line.

``done`` and the token counts include requests finished by earlier attempts (``resumed``),
``engine_seconds`` every attempt's engine time; ``tokens_per_s`` is this attempt's."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

import orjson
from pydantic import BaseModel

from llm_batch.infra import storage

log = logging.getLogger("llm_batch.infra.progress")
LOG_EVERY_S = 30.0  # unchanged counts are logged at most this often


class ShardState(StrEnum):
    STARTING = "starting"  # reading the shard, loading the model
    RUNNING = "running"
    DONE = "done"
    CANCELLED = "cancelled"
    DEADLINE = "deadline"
    FAILED = "failed"


class ShardProgress(BaseModel):
    job_id: str
    shard: int
    total: int
    done: int = 0
    succeeded: int = 0
    failed: int = 0
    resumed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache
    engine_seconds: float = 0.0  # seconds the engine loop ran, every attempt
    tokens_per_s: float = 0.0
    state: ShardState = ShardState.STARTING
    updated_at: str = ""


def read_progress(uri: str) -> ShardProgress:
    """storage.ObjectNotFound if none yet."""
    return ShardProgress.model_validate_json(storage.read_bytes(uri))


class ProgressReporter:
    """Counts results and publishes them at most every ``interval`` s (``uri`` None: the log
    line only). Failures are logged, never raised: progress must not fail a shard."""

    def __init__(self, uri: str | None, progress: ShardProgress, interval: float = 2.0,
                 clock: Callable[[], float] = time.monotonic):
        self.uri = uri
        self.progress = progress
        self.interval = interval
        self._clock = clock
        self._started = clock()
        self._stopped: float | None = None
        self._running = False
        self._last_publish: float | None = None
        self._earlier_engine_seconds = progress.engine_seconds
        self._tokens_before = progress.completion_tokens
        self._logged: tuple[Any, ...] | None = None
        self._last_log: float | None = None

    def start_running(self) -> None:
        self._started = self._clock()
        self._running = True
        self._tokens_before = self.progress.completion_tokens  # earlier attempts' tokens
        self.publish(ShardState.RUNNING)

    def stop_running(self) -> None:
        """Tokens/s are measured up to here, not to the engine's stop."""
        self._stopped = self._clock()

    def record(self, ok: bool, prompt_tokens: int = 0, completion_tokens: int = 0,
               cached_prompt_tokens: int = 0) -> None:
        p = self.progress
        p.done += 1
        if ok:
            p.succeeded += 1
        else:
            p.failed += 1
        p.prompt_tokens += prompt_tokens
        p.completion_tokens += completion_tokens
        p.cached_prompt_tokens += cached_prompt_tokens

    def _log_line(self) -> None:
        p = self.progress
        now = self._clock()
        seen = (p.state, p.done, p.failed)
        if seen == self._logged and self._last_log is not None and now - self._last_log < LOG_EVERY_S:
            return
        self._logged, self._last_log = seen, now
        extra = f", {p.failed} failed" if p.failed else ""
        extra += f", {p.resumed} resumed" if p.resumed else ""
        log.info("shard %d %s: %d/%d done%s, %.1f tok/s", p.shard, p.state.value, p.done, p.total, extra,
                 p.tokens_per_s)

    @property
    def due(self) -> bool:
        return self._last_publish is None or self._clock() - self._last_publish >= self.interval

    def publish(self, state: ShardState | None = None) -> None:
        p = self.progress
        if state is not None:
            p.state = state
        ended = self._stopped if self._stopped is not None else self._clock()
        elapsed = ended - self._started
        if self._running:
            p.engine_seconds = round(self._earlier_engine_seconds + max(elapsed, 0.0), 3)
        if p.state is not ShardState.STARTING and elapsed > 0:
            p.tokens_per_s = round((p.completion_tokens - self._tokens_before) / elapsed, 1)
        p.updated_at = datetime.now(UTC).isoformat(timespec="seconds")
        self._last_publish = self._clock()
        self._log_line()
        if self.uri is None:
            return
        try:
            storage.write_bytes(self.uri, orjson.dumps(p.model_dump(mode="json")))
        except storage.StorageError as exc:
            log.warning("could not publish progress: %s", exc)
