"""The job's input and options (the job row's ``input`` column): what its run reads, and the
choices about its results that the API edge makes for it.

The pipeline and the runtime read these fields and never ask which API made the job: where
APIs differ (OpenAI's output expiry, Scale's JSON array, OpenAI's moderation results), the
router sets the field that says what is different, and the core does what the field says.

Unknown keys: a writer's unknown key is refused (``JobInput(...)``, ``model_validate``
raise a ValidationError), so a misspelt option never silently goes missing; a stored row's
unknown key (written by a later version, or by hand) is dropped when read
(``JobInput.from_stored``), so the job can still be served and run.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from llm_batch.core.output_check import OutputCheck


class OutputFormat(StrEnum):
    """How the results are encoded beyond the output file (JSONL, always written)."""

    JSONL = "jsonl"  # the output and error files only
    # Also one JSON array in input order (at the job's array_output_uri, else the job
    # folder's output.json), each element shaped by the input format (core.scale_output).
    JSON_ARRAY = "json_array"


class ModerationShape(StrEnum):
    """The shape of a /v1/moderations result (the one endpoint APIs answer differently)."""

    SCORES = "scores"  # per input: categories (flags) and category_scores
    # ... plus flagged (any category flagged) and category_applied_input_types.
    FLAGGED = "flagged"


class JobInput(BaseModel):
    """What a job reads (one of file_ids, uri, requests) and its options. Stored as JSON
    with only the fields that differ from their defaults (``stored``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    file_ids: list[str] | None = Field(default=None, description="uploaded input files (file ids), read in order")
    uri: str | None = Field(default=None, description="a checked user path, or the stored inline requests' file")
    requests: list[dict[str, Any]] | None = Field(default=None, description="a DAG run's inline requests")
    path: str | None = Field(default=None, description="the input path as the user spelt it (answered back)")
    inline: bool = Field(default=False, description="the requests came inline in the create call (stored at uri)")
    inline_file_id: str | None = Field(default=None, description="the file the inline requests were stored in")
    output_format: OutputFormat = OutputFormat.JSONL
    moderation_shape: ModerationShape = ModerationShape.SCORES
    output_expires_after_s: int | None = Field(
        default=None, gt=0, description="the output and error files expire this long after they are made")
    result_cache: bool = Field(
        default=True, description="deterministic lines may be answered from the owner's result cache")
    output_check: OutputCheck | None = Field(
        default=None, description="how the answers must look, and how often a failing one is tried again")
    unique_custom_ids: bool = Field(
        default=False, description="a custom_id given twice refuses the whole batch at validation (no line "
        "runs), instead of failing only the later line")

    def stored(self) -> dict[str, Any]:
        """The JSON the job row keeps: the fields that differ from their defaults."""
        return self.model_dump(mode="json", exclude_defaults=True)

    @classmethod
    def from_stored(cls, data: Mapping[str, Any] | JobInput | None) -> JobInput:
        """A stored row's input; keys this version does not know are dropped."""
        if isinstance(data, JobInput):
            return data
        return cls.model_validate({k: v for k, v in (data or {}).items() if k in cls.model_fields})
