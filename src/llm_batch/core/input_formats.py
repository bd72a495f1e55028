"""The input formats a batch may come in: one definition for the API, the DAG form, the
CLI and the recurring specs (``llm_batch.core.formats`` reads them)."""

from __future__ import annotations

from enum import StrEnum


class InputFormat(StrEnum):
    JSONL = "jsonl"  # OpenAI / Mistral batch lines
    SCALE_V2 = "scale-v2"  # Scale: a JSON array of completion or chat requests
    SCALE_V1 = "scale-v1"  # Scale: {"prompts": [...], shared parameters}
    INLINE = "inline"  # requests handed over as a list (never a user's word for a file)


# What a user may name as the format of a file or a run's input.
INPUT_FORMATS: tuple[str, ...] = (InputFormat.JSONL, InputFormat.SCALE_V2, InputFormat.SCALE_V1)
