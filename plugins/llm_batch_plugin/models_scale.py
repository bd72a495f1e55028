"""Scale batch completions v2: request and response models (the seed and model-engine's
``CreateBatchCompletionsV2Request`` / ``BatchCompletionsJob`` are the contract)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator

from llm_batch.jobs import SCALE_STATUS
from llm_batch.jobstore import Job
from llm_batch.models import MODEL_CONFIG_FIELDS
from llm_batch.pipeline import GPU_TYPES
from llm_batch_plugin.state import MAX_INLINE_REQUESTS, check_pairs

GpuType = Literal[GPU_TYPES]  # the seed's enum, defined once in the pipeline


class _ScaleModelConfigBase(BaseModel):
    # Other fields reach llm_batch.models, which refuses them by name (a 400, not a 422).
    model_config = ConfigDict(extra="allow", protected_namespaces=())

    _labels = field_validator("labels", check_fields=False)(check_pairs)


# Every field of llm_batch.models.MODEL_CONFIG_FIELDS, typed as there (a wrong type is a
# 422, as Scale's server answers); what each value does is decided there, at submission.
ScaleModelConfig = create_model(
    "ScaleModelConfig",
    __base__=_ScaleModelConfigBase,
    __module__=__name__,
    **{
        name: (rule.type, Field(description=rule.does))
        if name == "model"
        else (rule.type | None, Field(default=None, description=rule.does))
        for name, rule in MODEL_CONFIG_FIELDS.items()
    },
)


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
            metadata=scale_metadata(job),
        )


def scale_metadata(job: Job) -> dict[str, Any]:
    """Scale's job has no counts: they ride in metadata, live while it runs, beside the
    job's labels. Scale's clients read metadata as string -> string (llmengine 0.0.0b45
    fails to parse anything else), so values are flat scalars and unknown counts are left
    out; a count wins over a label of the same name."""
    counts = {
        "total_requests": job.total,
        "completed_requests": job.completed,
        "succeeded_requests": job.succeeded,
        "failed_requests": job.failed,
        "reason": job.status_reason or None,
        # Usage (Scale's job has no field for it): live while it runs, exact once merged.
        **usage_metadata(job),
    }
    return {**{str(k): str(v) for k, v in (job.labels or {}).items()},
            **{k: v for k, v in counts.items() if v is not None}}


def usage_metadata(job: Job) -> dict[str, Any]:
    """Tokens, engine and GPU seconds (engine seconds x gpus) and the live output rate."""
    return {
        "prompt_tokens": job.prompt_tokens,
        "completion_tokens": job.completion_tokens,
        "cached_prompt_tokens": job.cached_prompt_tokens,  # left out while unknown
        "engine_seconds": round(job.engine_seconds, 1),
        "gpu_seconds": round(job.engine_seconds * int((job.resources or {}).get("gpus") or 1), 1),
        "tokens_per_second": job.tokens_per_s,
    }


class GetBatchCompletionResponse(BaseModel):
    job: BatchCompletionsJob


class UpdateBatchCompletionsResponse(BatchCompletionsJob):
    success: bool = True


class CancelBatchCompletionsResponse(BaseModel):
    success: bool


class ListBatchCompletionsResponse(BaseModel):
    jobs: list[BatchCompletionsJob]
