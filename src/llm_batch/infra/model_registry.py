"""The model registry, and turning a job's ``model_config`` into vLLM engine arguments.

    load_registry(path=None) -> Registry          the YAML registry (Settings.model_registry
                                                  or the packaged models.yaml)
    resolve_model(model_config) -> ResolvedModel  a local checkpoint dir + vllm.LLM kwargs
    validate_model_config(model_config)           the fields only (for the API, at submit)
    prepare_model(name) -> Path                   build a registered model in the model cache
    build_tiny_llama(dest) -> Path                the tiny random Llama of the tests

``model_config`` takes every field of Scale's batch completions model config (its v2
config is vLLM's engine configuration: max_model_len, tensor_parallel_size, chat_template,
...; see ``MODEL_CONFIG_FIELDS``, the one table of what each field does here), plus
``engine_args`` (extra vLLM arguments, merged last). The API checks a job's config at
submission with the same table the worker uses to build ``vllm.LLM(...)``:

    job_model_config(raw) -> dict                 the stored form (nulls and defaults dropped)
    check_model_config(config, registry, gpus=)   the rules that need the registry / the job
    job_engine_args(config, registry, settings)   the engine arguments, no I/O

Everything that can be wrong with it (an unknown model, a model not prepared, a missing
checkpoint, a refused field) is raised as a ``ModelError`` before any engine loads.

A checkpoint directory is ready when it holds the marker file ``READY_MARKER``; the marker
is written into a temporary directory that is then renamed into place, so a crash never
leaves a half-built directory that looks ready. A file lock beside each directory makes
concurrent shards on one machine fetch or build it once.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

import orjson
import yaml
from filelock import FileLock
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)

from llm_batch.core.config import Settings, get_settings
from llm_batch.core.engine_args import PlainDict, allowed_engine_args
from llm_batch.core.model_choice import ADAPTER_NAME
from llm_batch.core.model_recipes import RECIPES, TINY_CHAT_TEMPLATE, MissingSource, build_tiny_llama
from llm_batch.infra import storage

__all__ = [
    "ModelError",
    "UnknownModel",
    "ModelNotPrepared",
    "CheckpointNotFound",
    "CheckpointNotAllowed",
    "InvalidModelConfig",
    "ModelSpec",
    "AdapterSpec",
    "Serving",
    "FimTemplate",
    "ModerationMap",
    "Registry",
    "ModelConfig",
    "FieldRule",
    "MODEL_CONFIG_FIELDS",
    "BUILTIN_CHAT_TEMPLATES",
    "ResolvedModel",
    "load_registry",
    "validate_model_config",
    "job_model_config",
    "check_model_config",
    "job_engine_args",
    "local_tokenizer_dir",
    "resolve_model",
    "prepare_model",
    "model_status",
    "fetch_checkpoint",
    "cache_path",
    "build_once",
    "build_tiny_llama",
    "READY_MARKER",
]

READY_MARKER = ".llm-batch-ready.json"
PACKAGED_REGISTRY = "models.yaml"


class ModelError(Exception):
    """The model of a job cannot be used; the message says why and what to do."""


class UnknownModel(ModelError, LookupError):
    """The name is not in the registry and no checkpoint_path was given."""


class ModelNotPrepared(ModelError):
    """A registered model whose offline recipe has not run on this machine yet."""


class CheckpointNotFound(ModelError):
    """A checkpoint location that holds no model directory."""


class CheckpointNotAllowed(ModelError):
    """A checkpoint outside the allowed local roots or buckets, or one we may not read."""


class InvalidModelConfig(ModelError, ValueError):
    """A model_config (or registry file) that does not validate; ``fields`` names the
    model_config fields at fault (``gpus`` when it is the job's gpus that disagree)."""

    def __init__(self, message: str, fields: Iterable[str] = ()):
        super().__init__(message)
        self.fields = tuple(fields)


# --- the registry ---------------------------------------------------------------------


class FimTemplate(BaseModel):
    """A model's fill-in-the-middle prompt (``fim:`` in its registry entry): the special
    tokens its tokenizer knows for "the text before the gap", "the text after it" and "now
    the gap", and their order. ``psm`` (StarCoder, Qwen2.5-Coder, DeepSeek-Coder):
    prefix-token prompt suffix-token suffix middle-token; ``spm`` (Codestral's order):
    suffix-token suffix prefix-token prompt [middle-token]. The worker checks at its start
    that each token is one token of the model's tokenizer."""

    model_config = ConfigDict(extra="forbid")

    prefix: str = Field(min_length=1)
    suffix: str = Field(min_length=1)
    middle: str | None = Field(default=None, min_length=1)
    order: Literal["psm", "spm"] = "psm"

    @model_validator(mode="after")
    def _psm_needs_middle(self) -> FimTemplate:
        if self.order == "psm" and self.middle is None:
            raise ValueError("a psm fim template needs a middle token (the model starts the gap after it)")
        return self

    @property
    def tokens(self) -> list[str]:
        return [t for t in (self.prefix, self.suffix, self.middle) if t is not None]

    def render(self, prompt: str, suffix: str) -> str:
        """The prompt text the model completes: its special tokens around prompt and suffix."""
        middle = self.middle or ""
        if self.order == "psm":
            return f"{self.prefix}{prompt}{self.suffix}{suffix}{middle}"
        return f"{self.suffix}{suffix}{self.prefix}{prompt}{middle}"


# generate (chat, completions, fim), embed, classify (pooling runner), transcribe (a speech
# model: Whisper's encoder-decoder), ocr (a vision-language model prompted for markdown).
Task = Literal["generate", "embed", "classify", "transcribe", "ocr"]


class ModerationMap(BaseModel):
    """A classifier's labels as moderation categories (``moderation:`` in a classify entry):
    ``categories`` maps each label of the model (its config's id2label) that counts to a
    category, or to a list of them (a ``self_harm`` label may score OpenAI's ``self-harm``,
    ``self-harm/intent`` and ``self-harm/instructions`` alike); several labels may share a
    category: its score is their highest. A category is flagged when its score reaches its
    threshold (``thresholds``, else ``threshold``). Meant for a multi-label model
    (``problem_type: multi_label_classification``: one sigmoid per label), as moderation
    scores are independent."""

    model_config = ConfigDict(extra="forbid")

    categories: dict[str, Annotated[str, Field(min_length=1)] | Annotated[list[Annotated[str, Field(min_length=1)]],
                                                                           Field(min_length=1)]] = Field(min_length=1)
    threshold: float = Field(default=0.5, ge=0, le=1)
    thresholds: dict[str, Annotated[float, Field(ge=0, le=1)]] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _thresholds_name_categories(self) -> ModerationMap:
        if unknown := sorted(set(self.thresholds) - set(self.category_names)):
            raise ValueError(f"thresholds name categories the map does not have: {', '.join(unknown)}")
        return self

    def pairs(self) -> list[tuple[str, str]]:
        """(label, category) for every category each label counts for, in the map's order."""
        return [(label, category) for label, named in self.categories.items()
                for category in ([named] if isinstance(named, str) else named)]

    @property
    def category_names(self) -> list[str]:
        """The map's categories, each once, in the order they first appear."""
        return list(dict.fromkeys(category for _, category in self.pairs()))

    def threshold_of(self, category: str) -> float:
        return self.thresholds.get(category, self.threshold)


DEFAULT_OCR_PROMPT = "Convert this page to markdown. Return only the markdown."


class Serving(BaseModel):
    """The parts of a registry entry that decide what a model serves beyond its task
    (``llm_batch.core.endpoints.FEATURE_OF_ENDPOINT``), and how; a model outside the registry
    has none of them."""

    model_config = ConfigDict(extra="forbid")

    # Fill-in-the-middle (/v1/fim/completions) for a generate model.
    fim: FimTemplate | None = None
    # A classify model: the name its one target has in classification results (Mistral's
    # classifiers answer per target: {"<target>": {"scores": {label: score}}}).
    classifier_target: str = Field(default="label", min_length=1)
    # A classify model's labels as moderation categories (/v1/moderations).
    moderation: ModerationMap | None = None
    # An ocr model: what it is asked about each page image (the model's own words for
    # "this page as markdown"; the default suits an instruction-tuned VLM).
    ocr_prompt: str = Field(default=DEFAULT_OCR_PROMPT, min_length=1)

    @property
    def features(self) -> list[str]:
        """The registry features endpoints may need (``FEATURE_OF_ENDPOINT``)."""
        return [name for name in ("fim", "moderation") if getattr(self, name) is not None]


class ModelSpec(Serving):
    """One registry entry."""

    checkpoint: str = Field(min_length=1)
    task: Task
    engine_args: dict[str, Any] = Field(default_factory=dict)
    prepare: Literal[tuple(RECIPES)] | None = None  # type: ignore[valid-type]
    description: str = ""

    @model_validator(mode="after")
    def _features_fit_the_task(self) -> ModelSpec:
        for feature, task in (("fim", "generate"), ("moderation", "classify")):
            if getattr(self, feature) is not None and self.task != task:
                raise ValueError(f"{feature} is for {task} models, not a {self.task} model")
        return self


class AdapterSpec(BaseModel):
    """One LoRA adapter of a registered generate model (``llm_batch.infra.adapters``)."""

    model_config = ConfigDict(extra="forbid")

    base: str = Field(min_length=1)
    # A folder: absolute, relative to the model cache, or an s3:// prefix (fetched once).
    checkpoint: str = Field(min_length=1)
    rank: int = Field(ge=1, le=512)
    # The offline recipe that builds it (random weights from ``seed``, for tests and demos).
    prepare: Literal["random-lora"] | None = None
    seed: int = 0
    description: str = ""


class Registry(BaseModel):
    """The whole registry file: the models and which of them are the defaults."""

    model_config = ConfigDict(extra="forbid")

    default_chat_model: str
    default_embedding_model: str
    models: dict[str, ModelSpec]
    # LoRA adapters on the models: a batch line names one as its model.
    adapters: dict[str, AdapterSpec] = Field(default_factory=dict)
    # Chat templates a job may name in model_config.chat_template (beside the built-in ones).
    chat_templates: dict[str, Annotated[str, Field(min_length=1)]] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _defaults_are_registered(self) -> Registry:
        for default in (self.default_chat_model, self.default_embedding_model):
            if default not in self.models:
                raise ValueError(f"default model {default!r} is not among the models")
        if bad := [name for name in self.chat_templates if not _TEMPLATE_NAME.fullmatch(name)]:
            raise ValueError(f"chat template names must be plain names, not {bad[0]!r}")
        for name, adapter in self.adapters.items():
            if not ADAPTER_NAME.fullmatch(name) or name in self.models:
                raise ValueError(f"adapter {name!r}: a plain name (letters, digits, . _ -) that no model has")
            base = self.models.get(adapter.base)
            if base is None or base.task != "generate":
                raise ValueError(f"adapter {name!r}: its base {adapter.base!r} is not a registered generate model")
        return self

    def adapter(self, name: str) -> AdapterSpec:
        try:
            return self.adapters[name]
        except KeyError:
            raise UnknownModel(f"unknown adapter {name!r}: known adapters are {', '.join(sorted(self.adapters))}") from None

    def base_of(self, name: str, owned: dict[str, str] | None = None) -> str:
        """The model a name runs on: an adapter's base, else the name itself."""
        if name in self.adapters:
            return self.adapters[name].base
        return (owned or {}).get(name, name)

    @property
    def templates(self) -> dict[str, str]:
        return {**BUILTIN_CHAT_TEMPLATES, **self.chat_templates}

    @property
    def default_models(self) -> list[str]:
        return [self.default_chat_model, self.default_embedding_model]

    def get(self, name: str) -> ModelSpec:
        """A model's entry; an adapter's name gives its base model's (what its jobs run)."""
        try:
            return self.models[self.base_of(name)]
        except KeyError:
            raise UnknownModel(
                f"unknown model {name!r}: known models are {', '.join(sorted(self.models))}"
                + (f", and adapters {', '.join(sorted(self.adapters))}" if self.adapters else "")
                + " (or give model_config.checkpoint_path)"
            ) from None


def load_registry(path: Path | None = None, settings: Settings | None = None) -> Registry:
    """Read the registry from ``path``, else Settings.model_registry, else the packaged file."""
    path = path or (settings or get_settings()).model_registry
    if path is None:
        text = resources.files("llm_batch").joinpath(PACKAGED_REGISTRY).read_text()
        where = f"<package llm_batch>/{PACKAGED_REGISTRY}"
    else:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise InvalidModelConfig(f"model registry {path}: {exc.strerror}") from None
        where = str(path)
    try:
        return Registry.model_validate(yaml.safe_load(text))
    except yaml.YAMLError as exc:
        raise InvalidModelConfig(f"model registry {where}: not valid YAML: {exc}") from None
    except ValidationError as exc:
        raise InvalidModelConfig(f"model registry {where}: {_describe(exc)}") from None


# --- a job's model_config: every field, and what it does here --------------------------

_PositiveInt = Annotated[int, Field(ge=1)]
_Parallel = Annotated[int, Field(ge=1, le=64)]
_Name = Annotated[str, Field(min_length=1, max_length=256)]
_TEMPLATE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
BUILTIN_CHAT_TEMPLATES = {"chatml": TINY_CHAT_TEMPLATE}

_NO_HUB = ("checkpoints here are local directories or s3:// prefixes, never fetched from a "
           "hub: name the checkpoint_path of that revision")
_NO_TOOLS = ("this system runs no tools and parses no tool calls (tool_config is refused "
             "too): results carry the model's text")


def _mm_limits(value: str | dict[str, Any]) -> dict[str, Any]:
    """limit_mm_per_prompt as vLLM takes it: Scale's clients send a JSON string."""
    if isinstance(value, str):
        try:
            value = orjson.loads(value)
        except orjson.JSONDecodeError:
            value = None
    if not isinstance(value, dict) or not all(
        isinstance(v, int) and not isinstance(v, bool) or isinstance(v, dict) for v in value.values()
    ):
        raise ValueError('a JSON object of modality -> count, e.g. {"image": 2}')
    return value


def _checked_mm_limits(value: str | dict[str, Any]) -> str | dict[str, Any]:
    _mm_limits(value)
    return value  # kept as sent: the job shows the caller's own value back


@dataclass(frozen=True)
class FieldRule:
    """What one model_config field does here (docs/api.md, "Scale model_config fields").

    ``engine_arg``: the field is honoured as this ``vllm.LLM`` keyword (``a.b``: the key
    ``b`` of the dict argument ``a``), its value passed through ``convert``. ``allowed``:
    the only values accepted, any other is refused saying ``why`` (empty: every value is
    refused). A field with neither is used by ``resolve_model`` itself, as ``does`` says.
    Null, and ``default`` (what Scale's clients send when the caller sets nothing), mean
    "not set": never an error, never used. ``weak``: applied before the registry's
    engine_args, which override it (a suggestion).
    """

    type: Any
    does: str
    engine_arg: str | None = None
    allowed: frozenset[Any] | None = None
    why: str = ""
    default: Any = None
    convert: Callable[[Any], Any] | None = None
    weak: bool = False


def _honoured(type_: Any, engine_arg: str, does: str = "", **more: Any) -> FieldRule:
    return FieldRule(type_, does or f"honoured as `{engine_arg}`", engine_arg=engine_arg, **more)


def _refused(type_: Any, why: str, allowed: Iterable[Any] = ()) -> FieldRule:
    return FieldRule(type_, f"refused: {why}", allowed=frozenset(allowed), why=why)


# The one table: every field of Scale's batch completions model config (llmengine's
# BatchCompletionsModelConfig = vLLM's VLLMModelConfig + model, checkpoint_path, num_shards,
# max_context_length, seed, response_role, labels; and 0.0.0b36's quantize), plus our own
# engine_args. The API checks a job with it at submission, the worker builds vllm.LLM with it.
MODEL_CONFIG_FIELDS: dict[str, FieldRule] = {
    # What runs, and what the results say.
    "model": FieldRule(_Name, "the registry entry to run (required); a name outside the "
                       "registry needs checkpoint_path"),
    "checkpoint_path": FieldRule(str, "the checkpoint vLLM loads (its `model`): an s3:// prefix "
                                 "or a local model directory the caller may name, or a folder "
                                 "of the model cache (relative); checked at submission and by "
                                 "the worker"),
    "tokenizer": _honoured(Annotated[str, Field(min_length=1, max_length=2048)], "tokenizer",
                           "honoured as `tokenizer`: a local directory the caller may name "
                           "(absolute) or a folder of the model cache (relative); no s3://, no "
                           "hub names"),
    "chat_template": _honoured(Annotated[str, Field(min_length=1, max_length=65_536)],
                               "chat_template", "honoured as `chat_template`: a template name "
                               "the registry knows (chat_templates; built in: chatml) or "
                               "inline Jinja text; never read from a file"),
    "response_role": FieldRule(Annotated[str, Field(min_length=1, max_length=64)],
                               "the role of chat answers (default assistant)"),
    "served_model_name": FieldRule(_Name, "the `model` every result carries (default: the "
                                   "model's name)"),
    "labels": FieldRule(dict[str, str], "the job's labels (with the request's labels), not "
                        "an engine setting", default={}),
    "engine_args": FieldRule(dict[str, Any], "more vllm.LLM keywords, merged last: only those "
                             "of the allow-list (llm_batch.core.engine_args.JOB_ENGINE_ARGS, plain "
                             "values with bounds); the others are the registry's", default={}),
    # Size and parallelism.
    "num_shards": _honoured(_Parallel, "tensor_parallel_size", "honoured as "
                            "`tensor_parallel_size`, as a suggestion: the registry's value "
                            "and tensor_parallel_size win", default=1, weak=True),
    "tensor_parallel_size": _honoured(_Parallel, "tensor_parallel_size", "honoured as "
                                      "`tensor_parallel_size`; x pipeline_parallel_size must "
                                      "equal the job's gpus when gpus is given"),
    "pipeline_parallel_size": _honoured(_Parallel, "pipeline_parallel_size", "honoured as "
                                        "`pipeline_parallel_size`; checked with "
                                        "tensor_parallel_size against gpus"),
    "max_context_length": _honoured(_PositiveInt, "max_model_len"),
    "max_model_len": _honoured(_PositiveInt, "max_model_len"),
    "max_num_seqs": _honoured(_PositiveInt, "max_num_seqs"),
    "max_num_batched_tokens": _honoured(_PositiveInt, "max_num_batched_tokens"),
    "gpu_memory_utilization": _honoured(Annotated[float, Field(gt=0, le=1)], "gpu_memory_utilization"),
    "block_size": _honoured(_PositiveInt, "block_size"),
    "num_gpu_blocks_override": _honoured(_PositiveInt, "num_gpu_blocks_override"),
    "enable_prefix_caching": _honoured(bool, "enable_prefix_caching"),
    "enforce_eager": _honoured(bool, "enforce_eager", "honoured as `enforce_eager` "
                               "(LLM_BATCH_ENFORCE_EAGER=true still forces it on)"),
    "disable_sliding_window": _honoured(bool, "disable_sliding_window"),
    "max_seq_len_to_capture": _honoured(_PositiveInt, "compilation_config.max_cudagraph_capture_size",
                                        "honoured as `compilation_config.max_cudagraph_capture_size` "
                                        "(vLLM 0.32's name for it)"),
    "swap_space": _refused(Annotated[float, Field(ge=0)], "vLLM 0.32 has no CPU swap space (a "
                           "preempted request is recomputed); only 0 is accepted", allowed={0}),
    "disable_log_requests": FieldRule(bool, "accepted, no effect: the worker never logs requests"),
    # Weights and numerics.
    "dtype": _honoured(Literal["auto", "half", "float16", "bfloat16", "float", "float32"], "dtype"),
    "quantization": _honoured(Annotated[str, Field(pattern=r"^[a-z0-9_-]{1,64}$")], "quantization",
                              "honoured as `quantization` (vLLM refuses a method it does not "
                              "know when the engine starts)"),
    "quantize": _honoured(Literal["bitsandbytes", "awq"], "quantization",
                          "honoured as `quantization` (Scale v1's name for it)"),
    "cache_dtype": _honoured(Literal["auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2",
                                     "fp8_inc", "fp8_ds_mla", "nvfp4"], "kv_cache_dtype"),
    "load_format": _honoured(str, "load_format", "honoured as `load_format` for `safetensors` "
                             "(`auto` is the default); any other format is refused",
                             allowed=frozenset({"auto", "safetensors"}), default="auto",
                             why="other formats load pickled or random weights, or need a "
                             "loader service: only auto and safetensors"),
    "config_format": _honoured(Literal["auto", "hf", "mistral"], "config_format", default="auto"),
    "tokenizer_mode": _honoured(Literal["auto", "hf", "mistral"], "tokenizer_mode",
                                "honoured as `tokenizer_mode` (vLLM 0.32 has no `slow` mode)"),
    "rope_scaling": _honoured(PlainDict, "hf_overrides.rope_parameters",
                              "honoured as `hf_overrides.rope_parameters`, merged by the "
                              "worker over the checkpoint's own (rope_theta ...): vLLM 0.32 "
                              "reads RoPE scaling there and replaces the dict it is given"),
    "limit_mm_per_prompt": _honoured(Annotated[Annotated[str, Field(max_length=1024)] | PlainDict,
                                               AfterValidator(_checked_mm_limits)],
                                     "limit_mm_per_prompt", "honoured as `limit_mm_per_prompt` "
                                     "(Scale's JSON string, or an object)", convert=_mm_limits),
    "mm_processor_kwargs": _honoured(PlainDict, "mm_processor_kwargs"),
    "seed": _honoured(int, "seed", "honoured as `seed` (default 0)"),
    "trust_remote_code": _honoured(bool, "trust_remote_code", "true is honoured only when the "
                                   "registry entry's engine_args set trust_remote_code: true, "
                                   "and never with checkpoint_path: it runs the checkpoint's "
                                   "Python code", default=False),
    # Refused unless left unset.
    "skip_tokenizer_init": _refused(bool, "the worker needs the tokenizer to render prompts "
                                    "and decode results", allowed={False}),
    "revision": _refused(str, _NO_HUB),
    "code_revision": _refused(str, _NO_HUB),
    "tokenizer_revision": _refused(str, _NO_HUB),
    "quantization_param_path": _refused(str, "it names a file to load, and vLLM 0.32 has no "
                                        "such option (KV-cache scales come from the checkpoint)"),
    "override_neuron_config": _refused(PlainDict, "vLLM 0.32 has no AWS Neuron support"),
    "tool_call_parser": _refused(str, _NO_TOOLS),
    "enable_auto_tool_choice": _refused(bool, _NO_TOOLS, allowed={False}),
}


class _ModelConfigRules(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @field_validator("engine_args", "labels", mode="before", check_fields=False)
    @classmethod
    def _null_is_empty(cls, value: Any) -> Any:
        return {} if value is None else value

    @field_validator("engine_args", check_fields=False)
    @classmethod
    def _only_allowed_engine_args(cls, value: dict[str, Any]) -> dict[str, Any]:
        try:
            return allowed_engine_args(value)
        except ValueError as exc:
            # A refused argument that has a checked model_config field of its own: say so.
            fields = [f"model_config.{name}" for name in value if name in MODEL_CONFIG_FIELDS
                      and name not in ("engine_args", "labels")]
            hint = f" ({', '.join(fields)} is checked: use it)" if fields else ""
            hint += " (use checkpoint_path)" if "model" in value else ""
            raise ValueError(f"{exc}{hint}") from None


def _pydantic_field(name: str, rule: FieldRule) -> tuple[Any, Any]:
    if name == "model":
        return rule.type, ...
    if isinstance(rule.default, dict):
        return rule.type, Field(default_factory=dict)
    return rule.type | None, None


ModelConfig = create_model(
    "ModelConfig",
    __base__=_ModelConfigRules,
    __doc__="A job's model_config: the fields of MODEL_CONFIG_FIELDS, null meaning not set.",
    __module__=__name__,
    **{name: _pydantic_field(name, rule) for name, rule in MODEL_CONFIG_FIELDS.items()},
)


@dataclass(frozen=True)
class ResolvedModel:
    """What the worker needs to start an engine: ``vllm.LLM(**engine_args)``; ``name`` is
    the model every result names (model_config.served_model_name, else the model)."""

    name: str
    path: Path
    task: Task
    engine_args: dict[str, Any] = field(default_factory=dict)
    response_role: str = "assistant"
    # The registry entry's fim template, classifier target and moderation map (none outside it).
    serving: Serving = field(default_factory=Serving)
    # A classify model's labels, in the order of its scores (the checkpoint's id2label).
    labels: tuple[str, ...] = ()
    # The job's model when it names a registered adapter: lines that name no model run on it.
    adapter: str | None = None

    @property
    def fim(self) -> FimTemplate | None:
        return self.serving.fim

    @property
    def features(self) -> list[str]:
        return self.serving.features


def resolve_model(
    model_config: dict[str, Any] | ModelConfig,
    *,
    registry: Registry | None = None,
    settings: Settings | None = None,
) -> ResolvedModel:
    """Turn a job's model_config into a local checkpoint directory and engine arguments.

    The engine arguments are ``job_engine_args`` (MODEL_CONFIG_FIELDS applied over the
    registry's defaults), with the job's tokenizer resolved to a local directory and its
    chat template written to a file of the model cache; ``model`` is always the local
    checkpoint directory. An ``s3://`` checkpoint is downloaded once into the model cache.
    Raises ``ModelError`` subclasses for anything wrong with the job's model (not worth a
    retry); only a storage failure while downloading (``StorageError``) escapes as itself.
    """
    settings = settings or get_settings()
    config = validate_model_config(model_config)
    registry = registry or load_registry(settings=settings)
    check_model_config(config, registry)
    spec = _spec_for(config, registry)

    if config.checkpoint_path:
        path = _checkpoint_dir(config.checkpoint_path, settings, user_given=True)
    else:
        path = _registered_checkpoint_dir(registry.base_of(config.model), spec, settings)

    engine_args = job_engine_args(config, registry, settings)
    if config.tokenizer:
        engine_args["tokenizer"] = str(local_tokenizer_dir(config.tokenizer, settings))
    if config.chat_template:
        engine_args["chat_template"] = str(_template_file(engine_args["chat_template"], settings))
    if config.rope_scaling and "hf_overrides" not in config.engine_args:
        rope = _rope_parameters(path, config.rope_scaling)
        engine_args["hf_overrides"] = {**engine_args["hf_overrides"], "rope_parameters": rope}
    engine_args["model"] = str(path)
    task = spec.task if spec else _task_of(engine_args)

    return ResolvedModel(
        name=config.served_model_name or registry.base_of(config.model),
        adapter=config.model if config.model in registry.adapters else None,
        path=path,
        task=task,
        engine_args=engine_args,
        response_role=config.response_role or "assistant",
        serving=spec or Serving(),
        labels=_class_labels(path) if task == "classify" else (),
    )


def validate_model_config(model_config: dict[str, Any] | ModelConfig) -> ModelConfig:
    """The parsed model_config, or ``InvalidModelConfig`` naming each bad field: a wrong
    type, an unknown field, a value MODEL_CONFIG_FIELDS refuses, two fields that set one
    engine argument differently.

    Touches no file and no registry: cheap enough for the API to call at submission, so a
    bad model_config is refused there rather than failing the job's first shard.
    """
    if isinstance(model_config, ModelConfig):
        return model_config
    try:
        config = ModelConfig.model_validate(model_config)
    except ValidationError as exc:
        message = _describe(exc, "model_config")
        fields = [str(err["loc"][0]) for err in exc.errors() if err["loc"]]
        raise InvalidModelConfig(f"invalid model_config: {message}", fields) from None
    _raise_problems(_field_problems(config))
    return config


def job_model_config(model_config: dict[str, Any]) -> dict[str, Any]:
    """A job's model_config as the job stores it: validated, every field left at null or at
    its client default dropped (so a client that sends all its fields stores what was set)."""
    config = validate_model_config(model_config)
    return {"model": config.model, **_set_fields(config)}


def check_model_config(config: ModelConfig, registry: Registry, *, gpus: int | None = None,
                       nodes: int | None = None) -> None:
    """The rules that need the registry, and the job's ``gpus`` (per node) and ``nodes``
    (per worker) when it asks for them: trust_remote_code only where the registry allows it,
    a chat_template name the registry knows, tensor_parallel_size x pipeline_parallel_size =
    gpus x nodes (a multi-node worker defaults to tensor parallel over each node's gpus and
    pipeline parallel over its nodes: llm_batch.runtime.multinode). ``InvalidModelConfig``
    naming the field otherwise (``UnknownModel`` for a model the registry lacks)."""
    spec = _spec_for(config, registry)
    problems: list[tuple[str, str]] = []
    if config.trust_remote_code and not (
        spec and spec.engine_args.get("trust_remote_code") is True and not config.checkpoint_path
    ):
        where = ("with checkpoint_path, whose code the registry has not vetted"
                 if config.checkpoint_path else
                 f"the registry entry of {config.model!r} does not allow it (an operator sets "
                 "trust_remote_code: true in its engine_args)")
        problems.append(("trust_remote_code", f"true runs Python code from the checkpoint: "
                         f"refused {where}"))
    template = config.chat_template
    if template and not _is_jinja(template) and template not in registry.templates:
        problems.append(("chat_template", f"{template!r} is not a template the registry knows "
                         f"({', '.join(sorted(registry.templates))}) nor inline Jinja text; "
                         "files are not read"))
    if gpus is not None or (nodes or 1) > 1:
        problems += _parallel_problems(config, job_engine_args(config, registry), gpus or 1, nodes or 1)
    _raise_problems(problems)


def submission_problems(config: ModelConfig, registry: Registry, settings: Settings) -> list[tuple[str, str]]:
    """What the engine would refuse at start-up, found where the API can see it (its own
    model cache, the checkpoint's config.json; no vLLM import): ``ModelNotPrepared`` for a
    registered model that is not prepared, else (field, why) for a max_model_len above the
    checkpoint's max_position_embeddings (vLLM refuses it unless rope scaling stretches the
    context) and a tensor_parallel_size that does not divide its attention heads. A
    checkpoint the API cannot read here (s3://, a hub id) is the worker's to check."""
    spec = _spec_for(config, registry)
    if config.checkpoint_path:
        if "://" in config.checkpoint_path:
            return []
        path = _user_local_dir(config.checkpoint_path, settings, "checkpoint")
    elif spec is not None and spec.prepare is not None:
        path = _registered_checkpoint_dir(registry.base_of(config.model), spec, settings)  # ModelNotPrepared
    else:
        return []
    try:
        checkpoint = orjson.loads((path / "config.json").read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return []
    text = checkpoint.get("text_config") if isinstance(checkpoint.get("text_config"), dict) else checkpoint
    args = job_engine_args(config, registry, settings)
    problems: list[tuple[str, str]] = []
    limit, asked = text.get("max_position_embeddings"), args.get("max_model_len")
    stretched = text.get("rope_scaling") or checkpoint.get("rope_scaling") or config.rope_scaling
    if isinstance(limit, int) and isinstance(asked, int) and asked > limit and not stretched:
        problems.append(("max_model_len", f"{asked} is above the model's context ({limit} tokens, "
                         "max_position_embeddings of its config.json): the engine refuses it"))
    heads, tp = text.get("num_attention_heads"), args.get("tensor_parallel_size")
    if isinstance(heads, int) and isinstance(tp, int) and tp > 1 and heads % tp:
        problems.append(("tensor_parallel_size", f"{tp} does not divide the model's {heads} attention heads: "
                         "the engine refuses it"))
    return problems


def job_engine_args(
    config: ModelConfig, registry: Registry, settings: Settings | None = None
) -> dict[str, Any]:
    """The ``vllm.LLM`` keywords of a job, but ``model``: no I/O (a tokenizer is still the
    caller's path, a chat template its text). Later wins: seed=0, the weak fields
    (num_shards), the registry's engine_args (without trust_remote_code when a
    checkpoint_path replaces the registry's checkpoint), the other fields of
    MODEL_CONFIG_FIELDS, the job's engine_args, enforce_eager=True if Settings say so."""
    spec = _spec_for(config, registry)
    fields = _set_fields(config)
    registry_args = dict(spec.engine_args) if spec else {}
    if config.checkpoint_path:
        registry_args.pop("trust_remote_code", None)
    args: dict[str, Any] = {"seed": 0}
    for weak in (True, False):
        if not weak:
            args.update(registry_args)
        for name, value in fields.items():
            rule = MODEL_CONFIG_FIELDS[name]
            if rule.engine_arg and rule.weak == weak:
                _put(args, rule.engine_arg, rule.convert(value) if rule.convert else value)
    if config.chat_template:
        args["chat_template"] = registry.templates.get(config.chat_template, config.chat_template)
    args.update(config.engine_args)
    # The deployment's choice wins over the job's (a job may not turn compilation back on).
    if settings is not None and settings.enforce_eager:
        args["enforce_eager"] = True
    return args


def _set_fields(config: ModelConfig) -> dict[str, Any]:
    """The fields the job set: not null, not the client's default; "model" aside."""
    return {
        name: value
        for name, rule in MODEL_CONFIG_FIELDS.items()
        if name != "model"
        and (value := getattr(config, name)) is not None
        and not (type(value) is type(rule.default) and value == rule.default)
    }


def _field_problems(config: ModelConfig) -> list[tuple[str, str]]:
    """(field, why) for each value the table refuses, each engine argument two fields set
    differently, and each tokenizer or chat_template that cannot be one."""
    fields = _set_fields(config)
    problems = []
    by_arg: dict[str, str] = {}
    for name, value in fields.items():
        rule = MODEL_CONFIG_FIELDS[name]
        if rule.allowed is not None and not (rule.allowed and value in rule.allowed):
            problems.append((name, f"{value!r} is refused: {rule.why}"))
        if rule.engine_arg and (other := by_arg.setdefault(rule.engine_arg, name)) != name:
            if fields[other] != value:
                problems.append((name, f"{value!r} disagrees with {other} {fields[other]!r}: "
                                 f"both set {rule.engine_arg}; give one"))
    tokenizer = fields.get("tokenizer")
    if tokenizer is not None and "://" in tokenizer:
        problems.append(("tokenizer", f"{tokenizer!r}: only a local directory (s3:// and URLs "
                         "are not fetched; a checkpoint's own tokenizer needs no tokenizer)"))
    template = fields.get("chat_template")
    if template is not None:
        if _is_jinja(template):
            if problem := _jinja_problem(template):
                problems.append(("chat_template", problem))
        elif not _TEMPLATE_NAME.fullmatch(template):
            problems.append(("chat_template", f"{template[:80]!r} is neither a template name nor "
                             "inline Jinja text ({{ ... }} / {% ... %}); files are not read"))
    return problems


def _parallel_problems(config: ModelConfig, args: dict[str, Any], gpus: int, nodes: int) -> list[tuple[str, str]]:
    """tensor_parallel_size x pipeline_parallel_size against the job's gpus x nodes, when
    either size is set (by the job or the registry); gpus alone sets neither."""
    if "tensor_parallel_size" not in args and "pipeline_parallel_size" not in args:
        return []
    tp, pp = args.get("tensor_parallel_size", 1), args.get("pipeline_parallel_size", 1)
    if nodes > 1:  # a multi-node worker's default for the size left out (llm_batch.runtime.multinode)
        tp, pp = args.get("tensor_parallel_size", gpus), args.get("pipeline_parallel_size", nodes)
    if tp * pp == gpus * nodes:
        return []
    fields = _set_fields(config)
    named = [n for n in ("tensor_parallel_size", "num_shards", "pipeline_parallel_size") if n in fields]
    source = f"model_config.{named[0]}" if named else f"the registry entry of {config.model!r}"
    asked = f"gpus={gpus}" if nodes == 1 else f"gpus={gpus} x nodes_per_worker={nodes} = {gpus * nodes} GPUs"
    return [(named[0] if named else "gpus",
             f"tensor_parallel_size {tp} x pipeline_parallel_size {pp} = {tp * pp} GPUs (from "
             f"{source}), but the job asks for {asked}: they must be equal")]


def _raise_problems(problems: list[tuple[str, str]]) -> None:
    if problems:
        message = "; ".join(f"model_config.{name}: {why}" if name != "gpus" else why
                            for name, why in problems)
        raise InvalidModelConfig(f"invalid model_config: {message}", [name for name, _ in problems])


def _put(args: dict[str, Any], key: str, value: Any) -> None:
    """args[key] = value; ``a.b`` sets the key ``b`` of the dict argument ``a`` (copied)."""
    outer, _, inner = key.partition(".")
    if inner:
        args[outer] = {**(args.get(outer) or {}), inner: value}
    else:
        args[outer] = value


def _is_jinja(text: str) -> bool:
    return "{{" in text or "{%" in text


def _jinja_problem(text: str) -> str | None:
    """Why ``text`` is not a Jinja template (None: it parses, or jinja2 is not installed
    here and the engine will say). Tags of extensions (transformers' {% generation %}) pass."""
    try:
        from jinja2 import TemplateSyntaxError  # optional
        from jinja2.sandbox import ImmutableSandboxedEnvironment  # optional
    except ImportError:  # the core needs no jinja2; vLLM (which brings it) checks at start
        return None
    try:
        ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
    except TemplateSyntaxError as exc:
        if exc.message and "unknown tag" in exc.message:
            return None
        return f"not valid Jinja (line {exc.lineno}: {exc.message})"
    except Exception as exc:  # noqa: BLE001 - any text may come in; jinja2 may fail oddly
        return f"not valid Jinja ({type(exc).__name__})"
    return None


def _rope_parameters(checkpoint: Path, scaling: dict[str, Any]) -> dict[str, Any]:
    """model_config.rope_scaling over the checkpoint's own RoPE parameters (rope_theta...):
    vLLM 0.32 replaces the whole dict it is given, so it is merged here. Scale's legacy
    ``type`` key is vLLM's ``rope_type``."""
    try:
        hf_config = json.loads((checkpoint / "config.json").read_text())
    except (OSError, ValueError):
        hf_config = {}
    base = hf_config.get("rope_parameters")
    if not isinstance(base, dict):
        legacy = hf_config.get("rope_scaling")
        base = {**(legacy if isinstance(legacy, dict) else {}),
                **({"rope_theta": hf_config["rope_theta"]} if "rope_theta" in hf_config else {})}
    if base and all(isinstance(value, dict) for value in base.values()):
        raise InvalidModelConfig(
            "invalid model_config: model_config.rope_scaling: this checkpoint sets RoPE "
            "parameters per layer type; the registry entry can override them (hf_overrides)",
            ["rope_scaling"],
        )
    scaling = dict(scaling)
    if "type" in scaling:
        scaling.setdefault("rope_type", scaling.pop("type"))
    base = {key: value for key, value in base.items() if key != "type"}
    return {**base, **scaling}


def _template_file(text: str, settings: Settings) -> Path:
    """A job's chat template as a file of the model cache, named by its content: vLLM takes a
    string for a path first, so the text is never handed over as one."""
    path = Path(settings.model_cache, "chat-templates", hashlib.sha256(text.encode()).hexdigest()[:32] + ".jinja")
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(text)
        tmp.chmod(0o644)
        tmp.replace(path)
    return path


def _spec_for(config: ModelConfig, registry: Registry) -> ModelSpec | None:
    """The registry entry; a model outside the registry is fine only with a checkpoint."""
    if config.model in registry.models:
        return registry.models[config.model]
    if config.checkpoint_path:
        return None
    return registry.get(config.model)  # raises UnknownModel with the known names


def _task_of(engine_args: dict[str, Any]) -> Task:
    if engine_args.get("runner") != "pooling":
        return "generate"
    return "classify" if engine_args.get("convert") == "classify" else "embed"


def _class_labels(checkpoint: Path) -> tuple[str, ...]:
    """A classifier's labels in score order: its config.json's id2label (transformers'
    ``LABEL_<i>`` names when it has none)."""
    try:
        config = orjson.loads((checkpoint / "config.json").read_bytes())
    except (OSError, orjson.JSONDecodeError) as exc:
        raise CheckpointNotFound(f"{checkpoint}: cannot read config.json for the classifier's labels: {exc}") from None
    id2label = config.get("id2label") or {}
    count = len(id2label) or int(config.get("num_labels") or 2)
    return tuple(str(id2label.get(str(i), f"LABEL_{i}")) for i in range(count))


# --- where checkpoints live -----------------------------------------------------------


def _registered_checkpoint_dir(name: str, spec: ModelSpec, settings: Settings) -> Path:
    if spec.prepare is not None:
        path = cache_path(spec.checkpoint, settings)
        if not (path / READY_MARKER).is_file():
            raise ModelNotPrepared(
                f"model {name!r} is not prepared in {settings.model_cache}: "
                f"run `llm-batch models prepare {name}`"
            )
        return path
    return _checkpoint_dir(spec.checkpoint, settings, user_given=False)


def check_local_checkpoint(checkpoint: str, settings: Settings | None = None) -> Path:
    """A user's local ``checkpoint_path`` checked as the worker will check it (confined to
    the roots or the model cache, a model directory): the API calls it at submission.
    s3:// checkpoints are not fetched here; llm_batch.infra.user_paths covers them."""
    if checkpoint.startswith("s3://"):
        raise ValueError("check_local_checkpoint takes local paths only")
    return _checkpoint_dir(checkpoint, settings or get_settings(), user_given=True)


def _checkpoint_dir(checkpoint: str, settings: Settings, *, user_given: bool) -> Path:
    """A local model directory for ``checkpoint`` (s3:// prefix, absolute or cache-relative)."""
    if checkpoint.startswith("s3://"):
        return fetch_checkpoint(checkpoint, settings=settings)
    if "://" in checkpoint:
        raise CheckpointNotFound(
            f"checkpoint {checkpoint}: only local paths and s3:// are supported"
        )
    if user_given:
        path = _user_local_dir(checkpoint, settings, "checkpoint")
    else:
        path = cache_path(checkpoint, settings).resolve()
    if not (path / "config.json").is_file():
        raise CheckpointNotFound(
            f"checkpoint {checkpoint}: no model directory (config.json) at {path}"
        )
    return path


def local_tokenizer_dir(tokenizer: str, settings: Settings | None = None) -> Path:
    """A job's ``model_config.tokenizer`` as a local directory, under the rules of a local
    checkpoint_path (confined to the roots or the model cache; relative: in the model
    cache): the worker's check, and the API's at submission."""
    settings = settings or get_settings()
    if "://" in tokenizer:
        raise CheckpointNotAllowed(f"tokenizer {tokenizer}: only a local directory is supported")
    path = _user_local_dir(tokenizer, settings, "tokenizer")
    if not path.is_dir():
        raise CheckpointNotFound(f"tokenizer {tokenizer}: no directory at {path}")
    return path


def cache_path(checkpoint: str, settings: Settings) -> Path:
    path = Path(checkpoint).expanduser()
    return path if path.is_absolute() else Path(settings.model_cache) / path


def _user_local_dir(given: str, settings: Settings, what: str) -> Path:
    """A path a job gave, resolved (relative: in the model cache), within the local roots or
    the model cache; ``CheckpointNotAllowed`` naming ``what`` otherwise."""
    path = cache_path(given, settings).resolve()
    roots = [*settings.local_roots, Path(settings.model_cache).resolve()]
    if not any(path.is_relative_to(root) for root in roots):
        raise CheckpointNotAllowed(
            f"{what} {given}: outside the allowed local roots "
            f"({', '.join(str(root) for root in roots)})"
        )
    return path


def fetch_checkpoint(uri: str, *, settings: Settings | None = None, required: str = "config.json") -> Path:
    """Download the ``s3://`` prefix ``uri`` once into the model cache; return the directory.

    Concurrent callers on one machine (shards) wait on a file lock; the first downloads into
    a temporary directory, marks it ready and renames it into place, the others reuse it.
    A missing prefix is ``CheckpointNotFound``, a forbidden one ``CheckpointNotAllowed``;
    other ``StorageError``s (the server failing after retries) propagate: worth a retry.
    """
    dest = _s3_cache_dir(uri, settings or get_settings())
    if (dest / READY_MARKER).is_file():
        return dest

    def download(tmp: Path) -> None:
        try:
            storage.download_dir(uri.rstrip("/") + "/", tmp)
        except storage.ObjectNotFound as exc:
            raise CheckpointNotFound(f"checkpoint {uri}: {exc}") from None
        except (storage.PathNotAllowed, storage.AccessDenied) as exc:
            raise CheckpointNotAllowed(f"checkpoint {uri}: {exc}") from None
        if not (tmp / required).is_file():
            raise CheckpointNotFound(f"checkpoint {uri}: no {required} under this prefix")

    build_once(dest, {"source": uri}, download)
    return dest


def _s3_cache_dir(uri: str, settings: Settings) -> Path:
    """Where the s3:// prefix ``uri`` lives in the model cache: models/s3/<bucket>/<key>."""
    parts = [p for p in uri.removeprefix("s3://").split("/") if p]
    if not parts or any(p in (".", "..") for p in parts):
        raise CheckpointNotFound(f"checkpoint {uri}: not a usable s3:// prefix")
    return Path(settings.model_cache, "s3", *parts)


# --- offline preparation --------------------------------------------------------------


def model_status(name: str, spec: ModelSpec, settings: Settings | None = None) -> str:
    """``ready``, ``not prepared``, ``stale`` (older source), ``remote`` or ``missing``."""
    settings = settings or get_settings()
    if spec.checkpoint.startswith("s3://"):
        ready = (_s3_cache_dir(spec.checkpoint, settings) / READY_MARKER).is_file()
        return "ready" if ready else "remote"
    path = cache_path(spec.checkpoint, settings)
    if spec.prepare is None:
        return "ready" if (path / "config.json").is_file() else "missing"
    marker = _read_marker(path)
    if marker is None:
        return "not prepared"
    return "ready" if marker.get("source") == RECIPES[spec.prepare].source() else "stale"


def prepare_model(
    name: str,
    *,
    force: bool = False,
    registry: Registry | None = None,
    settings: Settings | None = None,
) -> Path:
    """Build the registered model ``name`` in the model cache with its offline recipe.

    Idempotent: a directory whose marker names the same source is left alone (this check
    imports nothing heavy, so it is fast). Otherwise the recipe builds into a temporary
    directory that replaces the old one in one rename. Returns the model directory.
    """
    settings = settings or get_settings()
    spec = (registry or load_registry(settings=settings)).get(name)
    if spec.prepare is None:
        raise ModelError(
            f"model {name!r} has no offline recipe (its checkpoint is {spec.checkpoint})"
        )
    if "://" in spec.checkpoint:
        raise ModelError(f"model {name!r}: a prepared model's checkpoint must be a local path")
    recipe = RECIPES[spec.prepare]
    dest = cache_path(spec.checkpoint, settings)
    marker = {"model": name, "recipe": spec.prepare, "source": recipe.source()}
    if not force and _read_marker(dest) == marker:
        return dest
    try:
        build_once(
            dest, marker, recipe.build, replace=lambda: force or _read_marker(dest) != marker
        )
    except MissingSource as exc:
        raise ModelError(f"model {name!r} cannot be prepared: {exc}") from None
    return dest


def _read_marker(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads((path / READY_MARKER).read_text())
    except (OSError, ValueError):
        return None


def build_once(
    dest: Path,
    marker: dict[str, Any],
    build: Callable[[Path], object],
    replace: Callable[[], bool] | None = None,
) -> None:
    """Build ``dest`` with ``build(tmp_dir)`` under a file lock, then swap it into place.

    ``replace()`` (default: "dest is not ready") is re-checked once the lock is held, so a
    caller that waited on another's build does not build again.
    """
    replace = replace or (lambda: not (dest / READY_MARKER).is_file())
    dest.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(dest.parent / f".{dest.name}.lock")):
        if not replace():
            return
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{dest.name}-", dir=dest.parent))
        try:
            build(tmp)
            (tmp / READY_MARKER).write_text(json.dumps(marker, sort_keys=True) + "\n")
            _readable_by_all(tmp)
            _swap_into_place(tmp, dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def _readable_by_all(root: Path) -> None:
    """mkdtemp and safetensors make private files; a shared cache is read by other users."""
    for path in [root, *root.rglob("*")]:
        if not path.is_symlink():
            extra = 0o555 if path.is_dir() else 0o444
            path.chmod(path.stat().st_mode | extra)


def _swap_into_place(new: Path, dest: Path) -> None:
    old = None
    if dest.exists() or dest.is_symlink():
        old = dest.with_name(f".old-{dest.name}-{os.getpid()}")
        dest.rename(old)
    new.rename(dest)
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)


def _describe(exc: ValidationError, prefix: str = "") -> str:
    """Pydantic errors as ``prefix.field.path: message; ...`` for people."""
    return "; ".join(
        f"{'.'.join([prefix, *(str(p) for p in err['loc'])]).strip('.') or '(top level)'}: "
        f"{'unknown field' if err['type'] == 'extra_forbidden' else err['msg']}"
        for err in exc.errors()
    )
