"""Scale batch completions v2: request and response models (the seed and model-engine's
``CreateBatchCompletionsV2Request`` / ``BatchCompletionsJob`` are the contract)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from llm_batch.jobs import SCALE_STATUS
from llm_batch.jobstore import Job
from llm_batch.pipeline import GPU_TYPES
from llm_batch_plugin.state import MAX_INLINE_REQUESTS, check_pairs

GpuType = Literal[GPU_TYPES]  # the seed's enum, defined once in the pipeline


class ScaleModelConfig(BaseModel):
    # Engine knobs pass through to the model registry's resolver (extra allowed).
    model_config = ConfigDict(extra="allow", protected_namespaces=())

    model: str = Field(min_length=1, max_length=256)
    checkpoint_path: str | None = None
    labels: dict[str, str] | None = None
    num_shards: int | None = Field(default=None, ge=1, le=64)
    max_context_length: int | None = Field(default=None, ge=1)
    seed: int | None = None

    _labels = field_validator("labels")(check_pairs)


class V1Content(BaseModel):
    """Scale v1 content: prompts plus shared sampling parameters."""

    model_config = ConfigDict(extra="allow")

    prompts: list[str] = Field(min_length=1, max_length=MAX_INLINE_REQUESTS)
    max_new_tokens: int = Field(ge=1)
    temperature: float = Field(ge=0.0, le=2.0)


class CreateBatchCompletionsRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())

    input_data_path: str | None = Field(default=None, max_length=2048)
    output_data_path: str = Field(max_length=2048)
    content: list[dict[str, Any]] | V1Content | None = Field(default=None)
    model_config_: ScaleModelConfig = Field(alias="model_config")
    labels: dict[str, str] = Field(default_factory=dict)
    data_parallelism: int = Field(default=1, ge=1, le=64)
    max_runtime_sec: int = Field(default=24 * 3600, ge=1, le=172_800)
    priority: str | None = Field(default=None, max_length=64)
    tool_config: dict[str, Any] | None = None
    cpus: int | str | None = None
    gpus: int | None = Field(default=None, ge=1, le=8)
    memory: str | None = None
    gpu_type: GpuType | None = None
    storage: str | None = None
    nodes_per_worker: int | None = Field(default=None, ge=1, le=16)

    _labels = field_validator("labels")(check_pairs)


class CreateBatchCompletionsV1Response(BaseModel):
    job_id: str


class UpdateBatchCompletionsRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    job_id: str | None = None
    priority: str | None = Field(default=None, max_length=64)


class BatchCompletionsJob(BaseModel):
    model_config = ConfigDict(protected_namespaces=())

    job_id: str
    input_data_path: str | None = None
    output_data_path: str
    model_config_: dict[str, Any] = Field(alias="model_config", serialization_alias="model_config")
    priority: str | None = None
    status: Literal["queued", "running", "completed", "failed", "cancelled", "unknown"]
    created_at: str
    expires_at: str
    completed_at: str | None
    metadata: dict[str, Any] | None

    @classmethod
    def of(cls, job: Job, priority_name: str | None) -> BatchCompletionsJob:
        return cls(
            job_id=job.id,
            input_data_path=job.input.get("path"),
            output_data_path=job.scale_output_uri or "",
            model_config=job.model_config,
            priority=priority_name,
            status=SCALE_STATUS.get(job.status, "unknown"),
            created_at=job.created_at.isoformat(),
            expires_at=(job.expires_at or job.created_at).isoformat(),
            completed_at=job.completed_at.isoformat() if job.completed_at else None,
            # Scale's job has no counts: they ride in metadata, live while it runs.
            metadata={
                "labels": job.labels,
                "total_requests": job.total,
                "completed_requests": job.completed,
                "succeeded_requests": job.succeeded,
                "failed_requests": job.failed,
                **({"reason": job.status_reason} if job.status_reason else {}),
            },
        )


class GetBatchCompletionResponse(BaseModel):
    job: BatchCompletionsJob


class UpdateBatchCompletionsResponse(BatchCompletionsJob):
    success: bool = True


class CancelBatchCompletionsResponse(BaseModel):
    success: bool


class ListBatchCompletionsResponse(BaseModel):
    jobs: list[BatchCompletionsJob]
