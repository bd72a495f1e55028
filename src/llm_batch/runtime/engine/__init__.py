"""vLLM's offline engine behind the worker: request translation, the engine loop, responses.

The submodules import vLLM; this package module does not, so the worker can name
``StopReason`` without loading the engine. Why not vLLM's own serving layer instead:
docs/benchmarks.md, "vLLM's serving layer behind the worker".
"""

from __future__ import annotations

from enum import StrEnum


class StopReason(StrEnum):
    """Why the engine loop stopped before the shard's end."""

    CANCELLED = "cancelled"
    DEADLINE = "deadline"
    ABANDONED = "abandoned"  # the task that asked for the shard has gone (warm engines)
