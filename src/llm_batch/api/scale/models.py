"""Scale batch completions v2: request and response models (model-engine's are the contract)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator

from llm_batch.core.job_spec import MAX_INLINE_REQUESTS, check_pairs
from llm_batch.core.jobs import JobStatus
from llm_batch.core.model_config import MODEL_CONFIG_FIELDS
from llm_batch.core.placement import GpuType
from llm_batch.core.snapshots import Job

# The dialect's word for each canonical status.
SCALE_STATUS = {
    JobStatus.QUEUED: "queued",
    JobStatus.VALIDATING: "running",
    JobStatus.RUNNING: "running",
    JobStatus.FINALIZING: "running",
    JobStatus.CANCELLING: "running",
    JobStatus.SUCCEEDED: "completed",
    JobStatus.FAILED: "failed",
    # Scale has no timeout word: a job stopped at its deadline did not complete.
    JobStatus.TIMEOUT_EXCEEDED: "failed",
    JobStatus.CANCELLED: "cancelled",
}


class _ScaleModelConfigBase(BaseModel):
    """The base of ScaleModelConfig: other fields pass, to be refused by name (a 400, not a 422)."""

    model_config = ConfigDict(extra="allow", protected_namespaces=())

    _labels = field_validator("labels", check_fields=False)(check_pairs)


# Every field of MODEL_CONFIG_FIELDS, typed as there (a wrong type is a 422, as Scale answers).
ScaleModelConfig = create_model(
    "ScaleModelConfig",
    __base__=_ScaleModelConfigBase,
    __module__=__name__,
    __doc__="Scale's model_config: the model and its vLLM engine configuration. Every field the Scale clients "
    "send is known: honoured as an engine argument, checked, or refused with a 400 naming it "
    "(`param: model_config.<field>`); null or the client's default is never an error and is not stored.",
    **{
        name: (rule.type, Field(description=rule.does))
        if name == "model"
        else (rule.type | None, Field(default=None, description=rule.does))
        for name, rule in MODEL_CONFIG_FIELDS.items()
    },
)


class V1Content(BaseModel):
    """Scale v1 content: prompts plus shared sampling parameters (others are checked by the
    job's validation), one /v1/completions request per prompt."""

    model_config = ConfigDict(extra="allow")

    prompts: list[str] = Field(
        min_length=1,
        max_length=MAX_INLINE_REQUESTS,
        description="The prompts (1 to 100,000), each one request; its custom_id is its 0-based position",
    )
    max_new_tokens: int = Field(ge=1, description="The most tokens to generate per prompt (at least 1)")
    temperature: float = Field(
        ge=0.0,
        le=1.0,
        description="Sampling temperature of every prompt, 0 to 1 (Scale v1's range)",
    )


_RECORDED = "Accepted and recorded with the job, not applied: the deployment sizes the workers"


class CreateBatchCompletionsRequest(BaseModel):
    """Create a batch completions job (Scale's ``CreateBatchCompletionsV2Request``, also the v1
    route's): exactly one of ``input_data_path`` and ``content``. Unknown fields are ignored."""

    model_config = ConfigDict(extra="ignore", protected_namespaces=())

    input_data_path: str | None = Field(
        default=None,
        max_length=2048,
        description="The input file: a local path or `s3://` URI you may name (relative: from your own folder). "
        "A JSON array of completion (`prompt`) or chat (`messages`) requests, or a v1 `{\"prompts\": [...]}` "
        "object; the format is read from its first 64 KiB",
    )
    output_data_path: str = Field(
        max_length=2048,
        description="Where the results are written, a JSON array in input order, one element per request: for v1 "
        "prompts Scale's CompletionOutput (`text`, `num_prompt_tokens`, `num_completion_tokens`, `tokens`), for "
        "completion or chat requests the response body (`text_completion`, `chat.completion`), for a failure an "
        "`error` object: a local path or `s3://` URI you may name (relative: from your own folder). It "
        "must name a file, not the input; an existing file is replaced only if your earlier job wrote it and "
        "the label `llm-batch.io/overwrite-output` is `true` (409 otherwise)",
    )
    content: list[dict[str, Any]] | V1Content | None = Field(
        default=None,
        description="Inline input instead of input_data_path: a non-empty list of completion (`prompt`) or chat "
        "(`messages`) requests (chat when the first has `messages`), or a v1 prompts object",
    )
    model_config_: ScaleModelConfig = Field(
        alias="model_config",
        description="The model to run and its engine configuration; `model` is required",
    )
    labels: dict[str, str] = Field(
        default_factory=dict,
        description="The job's labels, merged over model_config.labels (these win): at most 64 pairs, keys up to "
        "64 characters, values up to 512 (422 beyond). Answered in the job's metadata and put on its pods",
    )
    data_parallelism: int = Field(
        default=1,
        ge=1,
        le=64,
        description="How many shards (workers, run in parallel) the requests are split into, 1-64; fewer when there "
        "are fewer requests",
    )
    max_runtime_sec: int = Field(
        default=24 * 3600,
        ge=1,
        le=172_800,
        description="The job's deadline, in seconds after creation (1-172800, default one day): workers stop "
        "there, finished results are kept and the job ends `failed` (Scale has no timeout status)",
    )
    priority: str | None = Field(
        default=None,
        max_length=64,
        description="A priority name the server knows (by default `low`, `normal`, `high`); another is 400 (Scale "
        "takes any string). Orders the job's shards in their pool's queue; null: normal",
    )
    tool_config: dict[str, Any] | None = Field(
        default=None, description="Not supported: this system runs no tools; anything but null is 400"
    )
    cpus: int | str | None = Field(default=None, description=_RECORDED)
    gpus: int | None = Field(
        default=None,
        ge=1,
        le=8,
        description="GPUs per worker (1-8; Kubernetes runner): with a parallel size set, tensor_parallel_size x "
        "pipeline_parallel_size must equal it (400). Null: 1",
    )
    memory: str | None = Field(default=None, description=_RECORDED)
    gpu_type: GpuType | None = Field(
        default=None,
        description="GPU node type of the workers (Kubernetes runner): picks the node pool and the Airflow pool; "
        "null: no node selector",
    )
    storage: str | None = Field(default=None, description=_RECORDED)
    nodes_per_worker: int | None = Field(
        default=None,
        ge=1,
        le=16,
        description="Nodes per worker (Kubernetes runner: a LeaderWorkerSet of this many pods per shard, "
        "tensor parallel over each pod's gpus, pipeline parallel across the pods); a local stack refuses more than 1",
    )

    _labels = field_validator("labels")(check_pairs)


class CreateBatchCompletionsV1Response(BaseModel):
    """The v1 route's answer (what llmengine's ``Completion.batch_create`` reads)."""

    job_id: str = Field(description="The new job's id (`job_<hex>`)")


class UpdateBatchCompletionsRequest(BaseModel):
    """Change a job's priority. Unknown fields are ignored."""

    model_config = ConfigDict(extra="ignore")

    job_id: str | None = Field(default=None, description="Ignored: the path names the job")
    priority: str | None = Field(
        default=None,
        max_length=64,
        description="The new priority name (by default `low`, `normal`, `high`; another is 400): the job's shards "
        "not yet started take it, running ones keep theirs. Null: no change",
    )


_ISO = "ISO 8601 with UTC offset (e.g. 2026-01-01T12:00:00.123456+00:00)"


class BatchCompletionsJob(BaseModel):
    """A batch completions job (Scale's ``BatchCompletionsJob``; its counts ride in ``metadata``)."""

    model_config = ConfigDict(protected_namespaces=())

    job_id: str = Field(description="The job id (`job_<hex>` when made through the API)")
    input_data_path: str | None = Field(
        default=None, description="The input path as given at creation; null for inline content or a job made otherwise"
    )
    output_data_path: str = Field(
        description="Where the JSON array of results is written, as stored (the canonical form of the path given); "
        "empty for a job made in another dialect"
    )
    model_config_: dict[str, Any] = Field(
        alias="model_config",
        serialization_alias="model_config",
        description="The model_config as the job stores it: `model` and the fields that were set (nulls and the "
        "client's defaults dropped); empty for a job made in another dialect",
    )
    priority: str | None = Field(default=None, description="The job's priority name; null when none was given")
    status: Literal["queued", "running", "completed", "failed", "cancelled", "unknown"] = Field(
        description="queued, running (also while reading its input, merging or cancelling), completed, failed "
        "(also when stopped at its deadline) or cancelled; `unknown` is not used"
    )
    created_at: str = Field(description=f"When the job was created, {_ISO}")
    expires_at: str = Field(description=f"The job's deadline, {_ISO}: created_at + max_runtime_sec")
    completed_at: str | None = Field(description=f"When the job ended (any end status), {_ISO}; null before")
    metadata: dict[str, Any] | None = Field(
        description="The job's labels (values as strings) and its counts as flat values: total_requests, "
        "completed_requests (with an outcome), succeeded_requests, failed_requests, reason (its latest status reason), "
        "prompt_tokens, completion_tokens, cached_prompt_tokens (when known), engine_seconds, gpu_seconds "
        "(engine seconds x gpus), tokens_per_second; live while it runs. A count wins over a label of its name"
    )

    @classmethod
    def of(cls, job: Job, priority_name: str | None) -> BatchCompletionsJob:
        return cls(
            job_id=job.id,
            input_data_path=job.input.path,
            output_data_path=job.array_output_uri or "",
            model_config=job.model_config,
            priority=priority_name,
            status=SCALE_STATUS.get(job.status, "unknown"),
            created_at=job.created_at.isoformat(),
            expires_at=(job.expires_at or job.created_at).isoformat(),
            completed_at=job.completed_at.isoformat() if job.completed_at else None,
            metadata=scale_metadata(job),
        )


def scale_metadata(job: Job) -> dict[str, Any]:
    """The labels and the counts, flat scalars (llmengine fails to parse anything else)."""
    counts = {
        "total_requests": job.total,
        "completed_requests": job.completed,
        "succeeded_requests": job.succeeded,
        "failed_requests": job.failed,
        "reason": job.status_reason or None,
        "prompt_tokens": job.prompt_tokens,
        "completion_tokens": job.completion_tokens,
        "cached_prompt_tokens": job.cached_prompt_tokens,  # left out while unknown
        "engine_seconds": round(job.engine_seconds, 1),
        "gpu_seconds": round(job.engine_seconds * int((job.resources or {}).get("gpus") or 1), 1),
        "tokens_per_second": job.tokens_per_s,
    }
    return {**{str(k): str(v) for k, v in (job.labels or {}).items()},
            **{k: v for k, v in counts.items() if v is not None}}


class GetBatchCompletionResponse(BaseModel):
    """Scale's ``GetBatchCompletionV2Response``."""

    job: BatchCompletionsJob = Field(description="The job")


class UpdateBatchCompletionsResponse(BatchCompletionsJob):
    """The job after its update, and ``success``."""

    success: bool = Field(default=True, description="Always true: a refused update is an error answer")


class CancelBatchCompletionsResponse(BaseModel):
    """Scale's ``CancelBatchCompletionsV2Response``."""

    success: bool = Field(
        description="True when the job is now cancelling or cancelled (cancelling twice is true); false when it had "
        "already ended otherwise (completed, failed)"
    )


class ListBatchCompletionsResponse(BaseModel):
    """Your Scale jobs (Scale's ``ListBatchCompletionV2Response``)."""

    jobs: list[BatchCompletionsJob] = Field(
        description="Your batch completions jobs, newest first: at most 1000, no paging"
    )
