"""What a run of the batch DAG is: its DAG's id, its conf (the form's fields), and the job
id it drives. The DAG form, the recurring specs and the REST API's triggers share these."""

from __future__ import annotations

import hashlib
from typing import Any

from pydantic import ConfigDict, Field, model_validator

from llm_batch.core.job_input import JobInput
from llm_batch.core.job_spec import MAX_DATA_PARALLELISM, MAX_RUNTIME_SEC, JobSpec

__all__ = ["BATCH_DAG_ID", "DEFAULT_MODEL", "DEFAULT_OWNER", "DEFAULT_RUNTIME_SEC", "HOUSEKEEPING_DAG_ID",
           "MAX_DATA_PARALLELISM", "MAX_RUNTIME_SEC", "RESULTS_ASSET_URI", "SHARD_TASK_ID", "RunConf", "api_run_id",
           "run_job_id"]

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
DEFAULT_RUNTIME_SEC = 86_400


class RunConf(JobSpec):
    """The DAG run's conf: the job's spec, what it reads (one of input_uri, input_file_ids,
    input_requests), its id and its owner.

    With ``job_id`` naming a job in the store (the REST API's runs), the store's record is
    the job and the other fields are ignored. Otherwise (Airflow UI, ``/api/v2``, recurring
    DAGs) a job is created from these fields, with ``job_id`` as its id when given.
    """

    model_config = ConfigDict(extra="ignore")

    job_id: str | None = Field(
        default=None, max_length=128, pattern="^[A-Za-z0-9_.-]+$",
        description="Run an existing job of the store (the REST API sets it), or the id to give a new job; "
        "empty: generated")
    input_uri: str | None = Field(
        default=None,
        description="Input file: a path under the configured local roots or an s3:// URI of an allowed bucket")
    input_file_ids: list[str] | None = Field(
        default=None, description="Input as ids of uploaded files (POST /batch/v1/files); read in order as one batch")
    input_requests: list[dict[str, Any]] | None = Field(
        default=None,
        description="Inline requests: [{custom_id?, body}] (jsonl) or Scale completion/chat items (scale-v2)")
    owner: str = Field(default=DEFAULT_OWNER, description="Whose job the run makes")

    @model_validator(mode="before")
    @classmethod
    def _default_model(cls, given: Any) -> Any:
        return {"model": DEFAULT_MODEL, **given} if isinstance(given, dict) else given


    def job_input(self) -> JobInput:
        """What the run reads ("" and [] are not given)."""
        return JobInput(uri=self.input_uri or None, file_ids=self.input_file_ids or None,
                        requests=self.input_requests or None)


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
