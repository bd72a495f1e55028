"""What a run of the batch DAG is: its DAG's id, its conf, and the job id it drives."""

from __future__ import annotations

import hashlib
from typing import Any

from pydantic import ConfigDict, Field, model_validator

from llm_batch.core.job_spec import MAX_DATA_PARALLELISM, MAX_RUNTIME_SEC, JobInput, JobSpec

__all__ = ["BATCH_DAG_ID", "DEFAULT_MODEL", "DEFAULT_OWNER", "DEFAULT_RUNTIME_SEC", "HOUSEKEEPING_DAG_ID",
           "MAX_DATA_PARALLELISM", "MAX_RUNTIME_SEC", "RESULTS_ASSET_URI", "SHARD_TASK_ID", "RunConf", "api_run_id",
           "run_job_id"]

BATCH_DAG_ID = "batch_inference"
# Its mapped shard task (the cluster policy routes it; the page links its task instances).
SHARD_TASK_ID = "run_shard"
HOUSEKEEPING_DAG_ID = "llm_batch_housekeeping"
# One event per completed job: the asset a consumer DAG schedules on (one scheduled on the
# result files' alias would also get every earlier event on its first run).
RESULTS_ASSET_URI = "llm-batch://results"
DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_OWNER = "airflow"
DEFAULT_RUNTIME_SEC = 86_400


class RunConf(JobSpec):
    """The DAG run's conf: the job's spec, its one input, its id and its owner (a ``job_id``
    already in the store: that job, the other fields ignored)."""

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
    """The conf's job_id, else one derived from the run id (found again without any XCom)."""
    given = conf.get("job_id")
    if given:
        return str(given)
    return "job_" + hashlib.blake2b(dag_run_id.encode(), digest_size=16).hexdigest()


def api_run_id(job_id: str) -> str:
    """The batch API's run id of a job: deterministic, so a repeated trigger finds its run."""
    return f"llm_batch__{job_id}"
