"""The job's input and options (the job row's ``input`` column). A writer's unknown key is
refused, so a misspelt option never goes missing; a stored row's is dropped when read, so the
job can still run.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import Field

from llm_batch.core.job_spec import JobOptions, ModerationShape, OutputFormat

__all__ = ["JobInput", "ModerationShape", "OutputFormat"]


class JobInput(JobOptions):
    """What a job reads (one of file_ids, uri, requests) and its options."""

    file_ids: list[str] | None = Field(default=None, description="uploaded input files (file ids), read in order")
    uri: str | None = Field(default=None, description="a checked user path, or the stored inline requests' file")
    requests: list[dict[str, Any]] | None = Field(default=None, description="a DAG run's inline requests")
    path: str | None = Field(default=None, description="the input path as the user spelt it (answered back)")
    inline: bool = Field(default=False, description="the requests came inline in the create call (stored at uri)")
    inline_file_id: str | None = Field(default=None, description="the file the inline requests were stored in")

    def stored(self) -> dict[str, Any]:
        """The JSON the job row keeps: the fields that differ from their defaults."""
        return self.model_dump(mode="json", exclude_defaults=True)

    @classmethod
    def from_stored(cls, data: Mapping[str, Any] | JobInput | None) -> JobInput:
        """A stored row's input; keys this version does not know are dropped."""
        if isinstance(data, JobInput):
            return data
        return cls.model_validate({k: v for k, v in (data or {}).items() if k in cls.model_fields})
