"""Admission of work that waits on someone else (a webhook test waits on the receiver): per
owner at most so many starts a minute and so many at once, and so many at once in all, in
this api-server process. Past any bound: 429 ``rate_limit_exceeded`` with Retry-After, at
once, so a flood neither queues nor holds anything the rest of the API needs."""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Iterator

from llm_batch.api.errors import ApiError

WINDOW_S = 60.0


class Throttle:
    """The bounds are given per call (they are settings); the counts live here."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._lock = threading.Lock()
        self._starts: defaultdict[str, deque[float]] = defaultdict(deque)
        self._running: Counter[str] = Counter()

    @contextlib.contextmanager
    def admit(self, owner: str, *, per_minute: int, at_once: int, in_all: int, busy_for_s: float,
              what: str = "requests") -> Iterator[None]:
        """Hold one of `owner`'s places for the block, or raise the 429 saying which bound
        was reached. ``busy_for_s``: the Retry-After of a concurrency bound (how long one
        piece of work may take)."""
        with self._lock:
            now = self._clock()
            starts = self._starts[owner]
            while starts and starts[0] <= now - WINDOW_S:
                starts.popleft()
            if len(starts) >= per_minute:
                raise _too_many(f"{owner!r} may start at most {per_minute} {what} a minute", starts[0] + WINDOW_S - now)
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
