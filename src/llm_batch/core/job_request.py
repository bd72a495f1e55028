"""What a new job asks for, whoever asks: one dialect-neutral request (admission makes it, the
job store makes the job row of it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llm_batch.core.job_spec import JobInput

# Who asks for a job ("airflow": a DAG run and the native route); only the API reads it.
DIALECTS = ("openai", "mistral", "scale", "airflow")

# retry: an ended job's failed and never-run lines; rerun: all of its input again.
DERIVED_KINDS = ("retry", "rerun")


@dataclass(frozen=True)
class DerivedFrom:
    """The job a new job was made from, and how (one of DERIVED_KINDS)."""

    job_id: str
    kind: str

    def __post_init__(self) -> None:
        if self.kind not in DERIVED_KINDS:
            raise ValueError(f"derived kind {self.kind!r} is unknown; use one of {', '.join(DERIVED_KINDS)}")


@dataclass(frozen=True)
class JobRequest:
    endpoint: str
    model: str
    input: JobInput  # what the job reads, and its options
    input_format: str
    dialect: str = "airflow"  # one of DIALECTS
    model_config: dict[str, Any] = field(default_factory=dict)
    output_uri: str | None = None  # also write the results as one JSON array here
    metadata: dict[str, Any] = field(default_factory=dict)
    labels: dict[str, Any] = field(default_factory=dict)
    priority: int = 0
    priority_name: str | None = None
    data_parallelism: int = 1
    resources: dict[str, Any] = field(default_factory=dict)
    max_runtime_sec: int | None = None
    id: str | None = None  # a chosen job id (a run's, the native route's); None: generated
    derived_from: DerivedFrom | None = None  # a retry or rerun of an ended job
