"""What a job is expected to take (docs/api.md, "Estimates (dry run)"): the answer's shape,
in the core so the API answers it without the pipeline that computes it
(``llm_batch.pipeline.estimate``)."""

from __future__ import annotations

from pydantic import BaseModel, Field

# Valid lines whose prompt tokens are counted exactly; the rest at those lines' tokens per byte.
EXACT_LINES = 5_000
# Invalid lines an estimate names (the job's error file has them all).
SHOWN_ERRORS = 5

class LineError(BaseModel):
    """One invalid line, as the job's error file would report it."""

    line: int = Field(description="1-based line (or element) of the input")
    custom_id: str | None = Field(default=None, description="The line's custom_id, when it could be read")
    code: str = Field(description="The error code (docs/validation.md)")
    message: str = Field(description="What is wrong with the line")


class Estimate(BaseModel):
    """What a job is expected to take (docs/api.md, "Estimates (dry run)"). Null figures say
    why in ``notes``."""

    model: str = Field(description="The job's model")
    endpoint: str = Field(description="The endpoint every line calls")
    total: int = Field(description="Lines read")
    valid: int = Field(description="Lines that would run")
    invalid: int = Field(description="Lines that would be error lines (invalid)")
    errors: list[LineError] = Field(description=f"The first {SHOWN_ERRORS} invalid lines")
    prompt_tokens: int | None = Field(
        description="Prompt tokens of the valid lines, counted with the model's own tokenizer (and chat template); "
        "null when they cannot be counted here")
    prompt_tokens_exact: bool = Field(
        description=f"Whether every valid line was tokenized; above {EXACT_LINES} valid lines the rest are counted "
        "at the tokens per byte of the first ones")
    max_output_tokens: int | None = Field(
        description="The most tokens the lines may generate: each line's max_tokens (max_completion_tokens, "
        "max_output_tokens) x n, the engine's default when absent (16 for completions, the context left for chat); "
        "0 for embeddings and classifications; null when unknown")
    tokens_per_s: float | None = Field(
        description="Tokens (prompt + completion) per engine second this deployment measured for the model over its "
        "newest ended jobs; null until one has ended")
    rate_jobs: int = Field(description="How many ended jobs tokens_per_s was measured over")
    engine_seconds: float | None = Field(
        description="(prompt_tokens + max_output_tokens) / tokens_per_s, summed over shards as a job's "
        "usage.engine_seconds is: an upper figure, since lines usually stop before their most")
    jobs_ahead: int = Field(description="Live jobs ahead in its lane (same pool; higher priority, or same and older)")
    jobs_ahead_unknown: int = Field(description="Of jobs_ahead, those with no estimate yet (not in the wait)")
    expected_start: int | None = Field(
        description="Unix time in seconds its shards should start: now + the engine seconds ahead not yet run / the "
        "pool's slots; null when its own engine seconds are unknown")
    overhead_seconds: float | None = Field(
        default=None, description="What the model's newest ended jobs took beyond their engine time once running, "
        "their median: an engine's start when it was cold (none on a warm engine), scheduling, the merge; part of "
        "expected_end; null until one has ended")
    expected_end: int | None = Field(
        description="Unix time in seconds it should end: expected_start + engine_seconds / min(slots, "
        "data_parallelism) + overhead_seconds; null when engine_seconds is")
    estimated_at: int = Field(description="Unix time in seconds the estimate was made")
    notes: list[str] = Field(description="Why a figure is null or approximate, in words")
    would_fail: str | None = Field(
        default=None, description="Why the job would fail at validation (no valid line); null when it would run")
