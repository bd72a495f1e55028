"""A job's ``model_config`` (every field of Scale's batch completions model config, plus
``engine_args``): what each field does (``MODEL_CONFIG_FIELDS``, the one table), its typed
form, and the checks that need no registry and no file (the rest:
``llm_batch.infra.model_resolution``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import orjson
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator

from llm_batch.core.engine_args import PlainDict, allowed_engine_args
from llm_batch.core.model_recipes import TINY_CHAT_TEMPLATE


class ModelError(Exception):
    """The model of a job cannot be used; the message says why and what to do."""


class InvalidModelConfig(ModelError, ValueError):
    """A model_config (or registry file) that does not validate; ``fields``: those at fault."""

    def __init__(self, message: str, fields: Iterable[str] = ()):
        super().__init__(message)
        self.fields = tuple(fields)


_PositiveInt = Annotated[int, Field(ge=1)]
_Parallel = Annotated[int, Field(ge=1, le=64)]
_Name = Annotated[str, Field(min_length=1, max_length=256)]
TEMPLATE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
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
    """What one model_config field does here: honoured as ``engine_arg`` (``a.b``: key ``b`` of
    the dict argument ``a``), or only the ``allowed`` values (else refused saying ``why``), or
    used by ``resolve_model`` itself. Null and ``default`` (the clients' unset value) mean not
    set. ``weak``: the registry's engine_args override it. ``shard_only``: what a shard's results
    say, nothing the engine loads (shards differing only there share a warm engine)."""

    type: Any
    does: str
    engine_arg: str | None = None
    allowed: frozenset[Any] | None = None
    why: str = ""
    default: Any = None
    convert: Callable[[Any], Any] | None = None
    weak: bool = False
    shard_only: bool = False


def _honoured(type_: Any, engine_arg: str, does: str = "", **more: Any) -> FieldRule:
    return FieldRule(type_, does or f"honoured as `{engine_arg}`", engine_arg=engine_arg, **more)


def _refused(type_: Any, why: str, allowed: Iterable[Any] = ()) -> FieldRule:
    return FieldRule(type_, f"refused: {why}", allowed=frozenset(allowed), why=why)


# The one table: llmengine's BatchCompletionsModelConfig's fields, plus our own engine_args.
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
                               "the role of chat answers (default assistant)", shard_only=True),
    "served_model_name": FieldRule(_Name, "the `model` every result carries (default: the "
                                   "model's name)", shard_only=True),
    "labels": FieldRule(dict[str, str], "the job's labels (with the request's labels), not "
                        "an engine setting", default={}, shard_only=True),
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


def validate_model_config(model_config: dict[str, Any] | ModelConfig) -> ModelConfig:
    """The parsed model_config, or ``InvalidModelConfig`` naming each bad field (no file, no
    registry: cheap enough for every submission)."""
    if isinstance(model_config, ModelConfig):
        return model_config
    try:
        config = ModelConfig.model_validate(model_config)
    except ValidationError as exc:
        message = describe_errors(exc, "model_config")
        fields = [str(err["loc"][0]) for err in exc.errors() if err["loc"]]
        raise InvalidModelConfig(f"invalid model_config: {message}", fields) from None
    raise_problems(_field_problems(config))
    return config


def engine_fields(model_config: dict[str, Any]) -> dict[str, Any]:
    """The fields of a job's model_config its engine depends on (``FieldRule.shard_only`` left out)."""
    return {name: value for name, value in model_config.items()
            if not (name in MODEL_CONFIG_FIELDS and MODEL_CONFIG_FIELDS[name].shard_only)}


def job_model_config(model_config: dict[str, Any] | ModelConfig) -> dict[str, Any]:
    """A job's model_config as stored: validated, nulls and client defaults dropped."""
    config = validate_model_config(model_config)
    return {"model": config.model, **set_fields(config)}


def set_fields(config: ModelConfig) -> dict[str, Any]:
    """The fields the job set: not null, not the client's default; "model" aside."""
    return {
        name: value
        for name, rule in MODEL_CONFIG_FIELDS.items()
        if name != "model"
        and (value := getattr(config, name)) is not None
        and not (type(value) is type(rule.default) and value == rule.default)
    }


def _field_problems(config: ModelConfig) -> list[tuple[str, str]]:
    """(field, why) of each refused value, engine argument set twice differently, bad template."""
    fields = set_fields(config)
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
        if is_jinja(template):
            if problem := _jinja_problem(template):
                problems.append(("chat_template", problem))
        elif not TEMPLATE_NAME.fullmatch(template):
            problems.append(("chat_template", f"{template[:80]!r} is neither a template name nor "
                             "inline Jinja text ({{ ... }} / {% ... %}); files are not read"))
    return problems


def raise_problems(problems: list[tuple[str, str]]) -> None:
    if problems:
        message = "; ".join(f"model_config.{name}: {why}" if name != "gpus" else why
                            for name, why in problems)
        raise InvalidModelConfig(f"invalid model_config: {message}", [name for name, _ in problems])


def is_jinja(text: str) -> bool:
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


def describe_errors(exc: ValidationError, prefix: str = "") -> str:
    """Pydantic errors as ``prefix.field.path: message; ...`` for people."""
    return "; ".join(
        f"{'.'.join([prefix, *(str(p) for p in err['loc'])]).strip('.') or '(top level)'}: "
        f"{'unknown field' if err['type'] == 'extra_forbidden' else err['msg']}"
        for err in exc.errors()
    )
