"""What a new job asks for, whoever asks: one dialect-neutral request and the one place a
job row is made from it. The API's routers build one from their dialect's body
(``llm_batch.api.submission``); a DAG run's conf becomes one in ``steps.register``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from llm_batch.core.job_input import JobInput

if TYPE_CHECKING:  # the store pulls in SQLAlchemy: DAG files must parse without it
    from llm_batch.infra.jobstore import Job, JobStore

# Who asks for a job: each API dialect, and "airflow" for a run of the DAG (the native route).
# The job records it (the API answers in its words and lists jobs per dialect); the
# pipeline and the runtime never read it: what differs is a field of the job's JobInput.
DIALECTS = ("openai", "mistral", "scale", "airflow")


@dataclass(frozen=True)
class JobRequest:
    dialect: str  # one of DIALECTS
    endpoint: str
    model: str
    input: JobInput  # what the job reads, and its options (llm_batch.core.job_input)
    input_format: str
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

    def create(self, store: JobStore, owner: str, *, dag_run_id: str | None = None) -> Job:
        """The QUEUED job of this request, owned by `owner`."""
        return store.create_job(
            id=self.id,
            dialect=self.dialect,
            endpoint=self.endpoint,
            model=self.model,
            owner=owner,
            input=self.input.stored(),
            input_format=self.input_format,
            model_config=self.model_config,
            array_output_uri=self.output_uri,
            metadata=self.metadata,
            labels=self.labels,
            priority=self.priority,
            data_parallelism=self.data_parallelism,
            resources=self.resources,
            max_runtime_sec=self.max_runtime_sec,
            dag_run_id=dag_run_id,
        )
