"""What a job's model runs as: its ``model_config`` over its registry entry, as vLLM's engine
arguments and a local checkpoint (``resolve_model``). Everything wrong with it is a
``ModelError`` raised before any engine loads."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from llm_batch.core.config import Settings, get_settings
from llm_batch.core.model_config import (
    MODEL_CONFIG_FIELDS,
    InvalidModelConfig,
    ModelConfig,
    is_jinja,
    raise_problems,
    set_fields,
    validate_model_config,
)
from llm_batch.infra.model_cache import checkpoint_dir, local_tokenizer_dir, registered_checkpoint_dir, user_local_dir
from llm_batch.infra.model_registry import (
    CheckpointNotFound,
    FimTemplate,
    ModelSpec,
    Registry,
    Serving,
    Task,
    load_registry,
)


@dataclass(frozen=True)
class ResolvedModel:
    """``vllm.LLM(**engine_args)``; ``name`` is the model every result names."""

    name: str
    path: Path
    task: Task
    engine_args: dict[str, Any] = field(default_factory=dict)
    response_role: str = "assistant"
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


def resolve_model(model_config: dict[str, Any] | ModelConfig, *, registry: Registry | None = None,
                  settings: Settings | None = None) -> ResolvedModel:
    """``job_engine_args`` with the tokenizer as a local directory, the chat template as a
    file and ``model`` the local checkpoint (an ``s3://`` one downloaded once). Only a storage
    failure while downloading (``StorageError``, worth a retry) is not a ``ModelError``."""
    settings = settings or get_settings()
    config = validate_model_config(model_config)
    registry = registry or load_registry(settings=settings)
    check_model_config(config, registry)
    spec = spec_for(config, registry)
    if config.checkpoint_path:
        path = checkpoint_dir(config.checkpoint_path, settings, user_given=True)
    else:
        path = registered_checkpoint_dir(registry.base_of(config.model), spec, settings)
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
        path=path, task=task, engine_args=engine_args, response_role=config.response_role or "assistant",
        serving=spec or Serving(), labels=_class_labels(path) if task == "classify" else (),
    )


def check_model_config(config: ModelConfig, registry: Registry, *, gpus: int | None = None,
                       nodes: int | None = None) -> None:
    """The rules that need the registry and the job's ``gpus`` (per node) and ``nodes``:
    trust_remote_code only where the registry allows it, a chat_template it knows, and
    tensor x pipeline parallel sizes = gpus x nodes; ``InvalidModelConfig`` otherwise."""
    spec = spec_for(config, registry)
    problems: list[tuple[str, str]] = []
    vetted = spec and spec.engine_args.get("trust_remote_code") is True and not config.checkpoint_path
    if config.trust_remote_code and not vetted:
        where = ("with checkpoint_path, whose code the registry has not vetted"
                 if config.checkpoint_path else
                 f"the registry entry of {config.model!r} does not allow it (an operator sets "
                 "trust_remote_code: true in its engine_args)")
        problems.append(("trust_remote_code", f"true runs Python code from the checkpoint: refused {where}"))
    template = config.chat_template
    if template and not is_jinja(template) and template not in registry.templates:
        problems.append(("chat_template", f"{template!r} is not a template the registry knows "
                         f"({', '.join(sorted(registry.templates))}) nor inline Jinja text; "
                         "files are not read"))
    if gpus is not None or (nodes or 1) > 1:
        problems += _parallel_problems(config, job_engine_args(config, registry), gpus or 1, nodes or 1)
    raise_problems(problems)


def submission_problems(config: ModelConfig, registry: Registry, settings: Settings) -> list[tuple[str, str]]:
    """What the engine would refuse at start-up that the API can see in a local checkpoint's
    config.json, as (field, why); ``ModelNotPrepared`` for a registered model not prepared."""
    spec = spec_for(config, registry)
    if config.checkpoint_path:
        if "://" in config.checkpoint_path:
            return []
        path = user_local_dir(config.checkpoint_path, settings, "checkpoint")
    elif spec is not None and spec.prepare is not None:
        path = registered_checkpoint_dir(registry.base_of(config.model), spec, settings)  # ModelNotPrepared
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


def job_engine_args(config: ModelConfig, registry: Registry, settings: Settings | None = None) -> dict[str, Any]:
    """The ``vllm.LLM`` keywords of a job but ``model``, no I/O. Later wins: seed=0, the weak
    fields, the registry's engine_args (without trust_remote_code for a checkpoint_path),
    the other MODEL_CONFIG_FIELDS, the job's engine_args, the deployment's enforce_eager."""
    spec = spec_for(config, registry)
    fields = set_fields(config)
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
                arg = rule.convert(value) if rule.convert else value
                outer, _, inner = rule.engine_arg.partition(".")  # "a.b": the key b of the dict argument a
                args[outer] = {**(args.get(outer) or {}), inner: arg} if inner else arg
    if config.chat_template:
        args["chat_template"] = registry.templates.get(config.chat_template, config.chat_template)
    args.update(config.engine_args)
    # The deployment's choice wins over the job's (a job may not turn compilation back on).
    if settings is not None and settings.enforce_eager:
        args["enforce_eager"] = True
    return args


def _parallel_problems(config: ModelConfig, args: dict[str, Any], gpus: int, nodes: int) -> list[tuple[str, str]]:
    """When either size is set (gpus alone sets neither)."""
    if "tensor_parallel_size" not in args and "pipeline_parallel_size" not in args:
        return []
    tp, pp = args.get("tensor_parallel_size", 1), args.get("pipeline_parallel_size", 1)
    if nodes > 1:  # a multi-node worker's default for the size left out (llm_batch.runtime.multinode)
        tp, pp = args.get("tensor_parallel_size", gpus), args.get("pipeline_parallel_size", nodes)
    if tp * pp == gpus * nodes:
        return []
    fields = set_fields(config)
    named = [n for n in ("tensor_parallel_size", "num_shards", "pipeline_parallel_size") if n in fields]
    source = f"model_config.{named[0]}" if named else f"the registry entry of {config.model!r}"
    asked = f"gpus={gpus}" if nodes == 1 else f"gpus={gpus} x nodes_per_worker={nodes} = {gpus * nodes} GPUs"
    return [(named[0] if named else "gpus",
             f"tensor_parallel_size {tp} x pipeline_parallel_size {pp} = {tp * pp} GPUs (from "
             f"{source}), but the job asks for {asked}: they must be equal")]


def _rope_parameters(checkpoint: Path, scaling: dict[str, Any]) -> dict[str, Any]:
    """model_config.rope_scaling over the checkpoint's own RoPE parameters: vLLM replaces the
    whole dict it is given. Scale's legacy ``type`` key is vLLM's ``rope_type``."""
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
        raise InvalidModelConfig("invalid model_config: model_config.rope_scaling: this checkpoint sets RoPE "
                                 "parameters per layer type; the registry entry can override them (hf_overrides)",
                                 ["rope_scaling"])
    scaling = dict(scaling)
    if "type" in scaling:
        scaling.setdefault("rope_type", scaling.pop("type"))
    base = {key: value for key, value in base.items() if key != "type"}
    return {**base, **scaling}


def _template_file(text: str, settings: Settings) -> Path:
    """A file named by its content: vLLM takes a string for a path first."""
    path = Path(settings.model_cache, "chat-templates", hashlib.sha256(text.encode()).hexdigest()[:32] + ".jinja")
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(text)
        tmp.chmod(0o644)
        tmp.replace(path)
    return path


def spec_for(config: ModelConfig, registry: Registry) -> ModelSpec | None:
    """A model outside the registry is fine only with a checkpoint."""
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
    """A classifier's labels in score order (transformers' ``LABEL_<i>`` without id2label)."""
    try:
        config = orjson.loads((checkpoint / "config.json").read_bytes())
    except (OSError, orjson.JSONDecodeError) as exc:
        raise CheckpointNotFound(f"{checkpoint}: cannot read config.json for the classifier's labels: {exc}") from None
    id2label = config.get("id2label") or {}
    count = len(id2label) or int(config.get("num_labels") or 2)
    return tuple(str(id2label.get(str(i), f"LABEL_{i}")) for i in range(count))
