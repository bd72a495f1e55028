"""A job's spec: every option a job can carry, declared once with its bounds and description;
the DAG's form, the native body, the CLI's flags and the batch step's arguments derive theirs
from it. What a job reads is beside it (``JobInput``).
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Annotated, Any, Literal, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, ValidationInfo
from pydantic_core import PydanticCustomError

from llm_batch.core.endpoints import SUPPORTED_ENDPOINTS, SUPPORTED_LISTED
from llm_batch.core.input_formats import INPUT_FORMATS
from llm_batch.core.output_check import OutputCheck
from llm_batch.core.placement import GPU_TYPES

MAX_DATA_PARALLELISM = 64
# The longest deadline any dialect allows (Mistral's timeout_hours: 168).
MAX_RUNTIME_SEC = 168 * 3600
# The options a local (CPU-only) runner has no use for: its form leaves them out.
KUBERNETES_ONLY = ("gpus", "gpu_type", "nodes_per_worker")
MAX_INLINE_REQUESTS = 100_000  # requests given in a create's body (Mistral's, Scale's content, ours)
# Labels and metadata pairs (OpenAI's metadata has its own, lower count).
MAX_PAIRS = 64
MAX_PAIR_KEY = 64
MAX_PAIR_VALUE = 512


def check_pairs(value: dict[str, str] | None, *, max_pairs: int = MAX_PAIRS) -> dict[str, str] | None:
    """A pydantic validator body for metadata and labels (ValueError naming the offending pair)."""
    if value is None:
        return None
    if len(value) > max_pairs:
        raise ValueError(f"at most {max_pairs} pairs are allowed, got {len(value)}")
    for key, item in value.items():
        if len(key) > MAX_PAIR_KEY:
            raise ValueError(f"key {key[:20]!r}... is longer than {MAX_PAIR_KEY} characters")
        if len(item) > MAX_PAIR_VALUE:
            raise ValueError(f"value of {key!r} is longer than {MAX_PAIR_VALUE} characters")
    return value


def _bounded(low: int, high: int) -> Any:
    """An integer from `low` to `high`, in the JSON schema and refused beyond (never clamped)."""

    def check(value: int, info: ValidationInfo) -> int:
        if not low <= value <= high:
            raise PydanticCustomError("out_of_bounds", "{name}={value} is out of bounds: give {low} to {high}",
                                      {"name": info.field_name, "value": value, "low": low, "high": high})
        return value

    return Annotated[int, Field(json_schema_extra={"minimum": low, "maximum": high}), AfterValidator(check)]


def _known_gpu_type(value: str | None) -> str | None:
    if value is not None and value not in GPU_TYPES:
        raise ValueError(f"gpu_type {value!r} is unknown; use one of {', '.join(GPU_TYPES)}")
    return value


class OutputFormat(StrEnum):
    """How the results are encoded beyond the output file (JSONL, always written)."""

    JSONL = "jsonl"  # the output and error files only
    JSON_ARRAY = "json_array"


class ModerationShape(StrEnum):
    """The shape of a /v1/moderations result (the one endpoint APIs answer differently)."""

    SCORES = "scores"  # per input: categories (flags) and category_scores
    # ... plus flagged (any category flagged) and category_applied_input_types.
    FLAGGED = "flagged"


class SamplingDefaults(BaseModel):
    """Sampling parameters for the lines that omit them (a line's own value wins)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float | None = Field(default=None, ge=0, le=2, description="Sampling temperature (0: greedy)")
    top_p: float | None = Field(default=None, gt=0, le=1, description="The probability mass sampled from")
    top_k: int | None = Field(default=None, ge=-1, description="The most likely tokens sampled from (-1: all)")
    max_tokens: int | None = Field(default=None, ge=1, description="The most tokens an answer has")
    seed: int | None = Field(default=None, description="The seed of a line's sampling")
    presence_penalty: float | None = Field(default=None, ge=-2, le=2, description="Penalty on tokens already present")
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2, description="Penalty by a token's count so far")
    stop: list[str] | None = Field(default=None, max_length=4, description="Texts that end an answer")


Part = TypeVar("Part", bound="JobOptions")


class JobOptions(BaseModel):
    """The options the pipeline and the worker read: where APIs differ, the way in sets the
    option that says so, and the core never asks which API made the job."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    output_format: OutputFormat = Field(
        default=OutputFormat.JSONL,
        description="jsonl: the output and error files; json_array: also one JSON array in input order "
        "(Scale's output)")
    moderation_shape: ModerationShape = Field(
        default=ModerationShape.SCORES,
        description="The shape of /v1/moderations results: scores (categories and scores), flagged (also "
        "flagged and category_applied_input_types, OpenAI's)")
    output_expires_after_s: int | None = Field(
        default=None, gt=0, description="The output and error files expire this long after they are made (seconds)")
    result_cache: bool = Field(
        default=True,
        description="Answer the lines whose answer is determined (greedy or seeded chat and completions, embeddings) "
        "from your earlier jobs' results when they hold them (no engine time; marked `cached` in the output line). "
        "false: every line runs on the engine and none of this job's answers enter the cache")
    output_check: OutputCheck | None = Field(
        default=None,
        description="How the chat and completion answers must look (the line's own `response_format`, a JSON "
        "schema or a regex) and how often a failing answer is tried again with a new seed; then the line is an error "
        "line of code `invalid_output` holding the last answer. See \"Checked outputs\" in docs/api.md")
    unique_custom_ids: bool = Field(
        default=False,
        description="A custom_id given twice refuses the whole batch at validation (no line runs), instead of "
        "failing only the later line")
    sampling_defaults: SamplingDefaults | None = Field(
        default=None,
        description="Sampling parameters for the lines that omit them, e.g. {\"temperature\": 0.2, \"max_tokens\": 64}: "
        "a line's own value wins")

    def part(self, kind: type[Part]) -> Part:
        """This model's fields of `kind` (a JobInput's options, a create body's spec)."""
        return kind.model_validate({name: getattr(self, name) for name in kind.model_fields})


class JobSpec(JobOptions):
    """Everything a job asks for but its input: the model, the endpoint, and every option."""

    model: str = Field(
        max_length=256,
        description="The model to run, a name from the model registry (or one of your LoRA adapters), able to "
        "serve the endpoint")
    engine_config: dict[str, Any] = Field(
        default_factory=dict, alias="model_config",
        description="Engine configuration (fields of Scale's model_config: max_model_len, dtype, checkpoint_path, "
        "num_shards, seed, ..., engine_args); a bad field is refused naming it")
    endpoint: str = Field(
        default="/v1/chat/completions", max_length=128, json_schema_extra={"enum": list(SUPPORTED_ENDPOINTS)},
        description=f"The API every request of the batch calls: {SUPPORTED_LISTED}")
    input_format: Literal[INPUT_FORMATS] = Field(  # type: ignore[valid-type]
        default="jsonl",
        description="jsonl: OpenAI/Mistral lines; scale-v2: JSON array of Scale requests; scale-v1: Scale prompts "
        "object")
    output_uri: str | None = Field(
        default=None, max_length=4096,
        description="Also write the results in input order to this path you may name (a path under the local "
        "roots, or s3:// in an allowed bucket); an existing file is refused unless your earlier job wrote it and "
        "label `llm-batch.io/overwrite-output` is `true`")
    data_parallelism: _bounded(1, MAX_DATA_PARALLELISM) = Field(  # type: ignore[valid-type]
        default=1, description="How many shards (workers in parallel) the requests are split into (a job mixing "
        "base-model and LoRA adapter lines gets at least one for each)")
    max_runtime_sec: _bounded(1, MAX_RUNTIME_SEC) | None = Field(  # type: ignore[valid-type]
        default=None,
        description="The job's deadline in seconds after creation (default: the server's, one day): workers stop "
        "there, finished results are kept, the status is TIMEOUT_EXCEEDED")
    priority: Annotated[str, Field(max_length=64)] | int | None = Field(
        default=None,
        description="A priority band the server knows (by default `low`, `normal`, `high`; another is refused) or "
        "a number (the band at or below it); sets the tasks' priority and the pods' priority class. Null: normal")
    labels: Annotated[dict[str, str], AfterValidator(check_pairs)] = Field(
        default_factory=dict,
        description="Your key-value pairs, stored with the job (list filter `label`, usage grouping, pod labels)")
    metadata: dict[str, Any] = Field(default_factory=dict, description="Your notes on the job, stored with it")
    gpus: _bounded(1, 8) = Field(  # type: ignore[valid-type]
        default=1, description="GPUs per worker (the tensor-parallel size); Kubernetes runner only")
    gpu_type: Annotated[str | None, AfterValidator(_known_gpu_type)] = Field(
        default=None, json_schema_extra={"enum": [None, *GPU_TYPES]},
        description="GPU node type of the workers (Kubernetes runner): picks the node pool and the Airflow pool")
    nodes_per_worker: _bounded(1, 16) = Field(  # type: ignore[valid-type]
        default=1,
        description="Nodes per worker (Kubernetes runner: one LeaderWorkerSet per shard, pipeline parallel "
        "across nodes)")


class JobInput(JobOptions):
    """What a job reads (one of file_ids, uri, requests) and its options: the job row's ``input``
    column. A writer's unknown key is refused, so a misspelt option never goes missing; a stored
    row's is dropped when read, so the job can still run."""

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


def field_schemas(model: type[BaseModel]) -> dict[str, dict[str, Any]]:
    """Each field's JSON schema, flat (``type``: the list of its types, references resolved,
    branches merged), as a form field or a flag is made of it."""
    schema = model.model_json_schema(by_alias=True)
    defs = schema.get("$defs", {})
    flat = {}
    for key, prop in schema["properties"].items():
        branches = [defs.get(b.get("$ref", "").rpartition("/")[2], b) for b in prop.get("anyOf") or [prop]]
        merged = {k: v for branch in branches for k, v in branch.items()} | prop
        merged["type"] = [branch.get("type", "object") for branch in branches]
        if "enum" in merged and "null" in merged["type"] and None not in merged["enum"]:
            merged["enum"] = [None, *merged["enum"]]
        flat[key] = merged
    return flat


def spec_problem(exc: ValidationError) -> tuple[str, str]:
    """(where, what is wrong) of a spec's first problem, the message naming the field."""
    first = exc.errors()[0]
    where = ".".join(str(part) for part in first["loc"])
    why = "unknown field" if first["type"] == "extra_forbidden" else first["msg"].removeprefix("Value error, ")
    named = not where or why.startswith(str(first["loc"][0]))
    return where, why if named else f"{where}: {why}"
