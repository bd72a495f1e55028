"""vLLM's offline engine behind the worker: request translation, the engine loop, responses.

The submodules import vLLM; this package module does not, so the worker can name
``StopReason`` without loading the engine.

vLLM's own serving layer instead of ``sampling`` / ``responses`` and the private render call
(issue 30), measured 2026-12-04 with ``benchmarks/serving_layer.py`` (figures, load and the
rerun command: docs/benchmarks.md, "vLLM's serving layer behind the worker"): the worker's
256-request chat shard through ``OpenAIServingChat`` built as vLLM's run_batch builds it, with
the worker's window and in-order ``ResultsWriter`` checkpoints, ran at 0.68x the worker's
generation tokens/s (0.63x whole process) on the 2-core CPU machine. Exactly-once would hold
(one awaitable per request: in-order writes, resume by skipping ``writer.done``, cancel by
cancelling tasks, which aborts the engine request), and the bodies had the same
custom_ids, choices, prompt tokens and logprobs structure (but no ``cached_tokens`` and many
vLLM extra fields). Not adopted: the loss is the layout, not the translation. The serving
layer needs ``AsyncLLM``, whose engine core always runs in its own process in vLLM 0.32 (on
CPU that costs a core); in that same layout it matched the worker's step loop (1.08x). It
also covers only chat, completions, responses and embeddings, not FIM, classifications,
moderations, OCR or transcriptions. Measure it again on a GPU (where the worker already uses
vLLM's separate-process layout) or when vLLM can run an async engine client in-process.
"""

from __future__ import annotations

from enum import StrEnum


class StopReason(StrEnum):
    """Why the engine loop stopped before the shard's end."""

    CANCELLED = "cancelled"
    DEADLINE = "deadline"
    ABANDONED = "abandoned"  # the task that asked for the shard has gone (warm engines)
