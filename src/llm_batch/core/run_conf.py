"""What a run of the batch DAG is: its DAG's id, its conf (the form's fields), and the job
id it drives. The DAG form, the recurring specs and the REST API's triggers share these."""

from __future__ import annotations

import hashlib
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from llm_batch.core.input_formats import InputFormat
from llm_batch.core.job_input import JobInput
from llm_batch.core.job_request import JobRequest
from llm_batch.core.output_check import OutputCheck

# The parameterised DAG whose runs are jobs (its file, housekeeping, recurring DAGs and the API name it).
BATCH_DAG_ID = "batch_inference"
# Its mapped shard task (the cluster policy routes it; the page links its task instances).
SHARD_TASK_ID = "run_shard"
HOUSEKEEPING_DAG_ID = "llm_batch_housekeeping"
# One event per completed job, whatever its result file: the asset a consumer DAG schedules
# on. (A DAG scheduled on an asset gets only events made since it first referenced it; one
# scheduled on the alias of the jobs' result files also gets every earlier event on its first
# run: Airflow floors that window at the DAG's asset references, which an alias lacks.)
RESULTS_ASSET_URI = "llm-batch://results"
DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_OWNER = "airflow"
MAX_DATA_PARALLELISM = 64
DEFAULT_RUNTIME_SEC = 86_400
# The longest deadline any dialect allows: Mistral's timeout_hours goes to 168 (Scale's
# max_runtime_sec stops at 172,800 s; its API edge enforces that).
MAX_RUNTIME_SEC = 168 * 3600


class RunConf(BaseModel):
    """The DAG run's conf (the batch_inference Params), already checked by Airflow.

    With ``job_id`` naming a job in the store (the REST API's runs), the store's record is
    the job and the other fields are ignored. Otherwise (Airflow UI, ``/api/v2``, recurring
    DAGs) a job is created from these fields, with ``job_id`` as its id when given.
    """

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    job_id: str | None = None
    input_uri: str | None = None
    input_file_ids: list[str] | None = None
    input_requests: list[dict[str, Any]] | None = None
    input_format: str = InputFormat.JSONL
    output_uri: str | None = None
    endpoint: str = "/v1/chat/completions"
    model: str = DEFAULT_MODEL
    engine_config: dict[str, Any] = Field(default_factory=dict, alias="model_config")
    data_parallelism: int = 1
    max_runtime_sec: int | None = None
    priority: str | int | None = None
    labels: dict[str, Any] = Field(default_factory=dict)
    metadata: dict[str, Any] = Field(default_factory=dict)
    gpus: int = 1
    gpu_type: str | None = None
    nodes_per_worker: int = 1
    owner: str = DEFAULT_OWNER
    result_cache: bool = True
    # Kept as given: register refuses a bad check with a run note (checked_output), where a
    # typed field would fail the conf's parse before any job could say why.
    output_check: dict[str, Any] | None = None

    def job_request(self, job_id: str, *, input_uri: str | None, output_uri: str | None, priority: int,
                    max_runtime_sec: int) -> JobRequest:
        """The job this conf asks for, with its paths as checked and its figures as stored."""
        return JobRequest(
            id=job_id,
            dialect="airflow",
            endpoint=self.endpoint,
            model=self.model,
            input=self.model_copy(update={"input_uri": input_uri}).job_input(),
            input_format=self.input_format,
            model_config={"model": self.model, **self.engine_config},
            output_uri=output_uri,
            metadata=self.metadata,
            labels=self.labels,
            priority=priority,
            data_parallelism=self.data_parallelism,
            resources={"gpus": self.gpus, "gpu_type": self.gpu_type, "nodes_per_worker": self.nodes_per_worker},
            max_runtime_sec=max_runtime_sec,
        )

    def checked_output(self) -> OutputCheck | None:
        """The conf's output check; ValueError naming what is wrong with it."""
        if not self.output_check:
            return None
        try:
            return OutputCheck.model_validate(self.output_check)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(part) for part in ("output_check", *first["loc"]))
            raise ValueError(f"{where}: {first['msg'].removeprefix('Value error, ')}") from None

    def job_input(self) -> JobInput:
        options = {"result_cache": self.result_cache, "output_check": self.checked_output()}
        if self.input_requests:
            return JobInput(requests=self.input_requests, **options)
        if self.input_file_ids:
            return JobInput(file_ids=self.input_file_ids, **options)
        if self.input_uri:
            return JobInput(uri=self.input_uri, **options)
        return JobInput(**options)




def run_job_id(conf: dict[str, Any], dag_run_id: str) -> str:
    """The job id of a DAG run: the conf's job_id, else one derived from the run id (so
    the run's failure path and housekeeping find the job without any XCom)."""
    given = conf.get("job_id")
    if given:
        return str(given)
    return "job_" + hashlib.blake2b(dag_run_id.encode(), digest_size=16).hexdigest()


def api_run_id(job_id: str) -> str:
    """The run id the batch API gives a job's run: deterministic, so a repeated trigger of
    the same job finds its run instead of a twin, and the run is known as the job's own."""
    return f"llm_batch__{job_id}"
