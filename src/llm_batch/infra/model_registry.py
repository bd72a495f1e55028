"""The model registry: the models and adapters a deployment serves (``models.yaml``, packaged,
or ``Settings.model_registry``), each with its checkpoint, task, serving features and engine
arguments; and the ``ModelError`` kinds of a job's model."""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from llm_batch.core.config import Settings, get_settings
from llm_batch.core.model_choice import ADAPTER_NAME
from llm_batch.core.model_config import (
    BUILTIN_CHAT_TEMPLATES,
    TEMPLATE_NAME,
    InvalidModelConfig,
    ModelError,
    describe_errors,
)
from llm_batch.core.model_recipes import RECIPES

PACKAGED_REGISTRY = "models.yaml"


class UnknownModel(ModelError, LookupError):
    """The name is not in the registry and no checkpoint_path was given."""


class ModelNotPrepared(ModelError):
    """A registered model whose offline recipe has not run on this machine yet."""


class CheckpointNotFound(ModelError):
    """A checkpoint location that holds no model directory."""


class CheckpointNotAllowed(ModelError):
    """A checkpoint outside the allowed local roots or buckets, or one we may not read."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FimTemplate(_Strict):
    """A model's fill-in-the-middle special tokens and their order: ``psm`` (StarCoder,
    Qwen2.5-Coder): prefix prompt suffix suffix-text middle; ``spm`` (Codestral): suffix
    suffix-text prefix prompt [middle]."""

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
        middle = self.middle or ""
        if self.order == "psm":
            return f"{self.prefix}{prompt}{self.suffix}{suffix}{middle}"
        return f"{self.suffix}{suffix}{self.prefix}{prompt}{middle}"


Task = Literal["generate", "embed", "classify", "transcribe", "ocr"]


class ModerationMap(_Strict):
    """A classifier's labels as moderation categories: each label that counts maps to one
    category or several; a category scores its labels' highest and is flagged at its
    threshold. Meant for a multi-label model, as moderation scores are independent."""

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
        return [(label, category) for label, named in self.categories.items()
                for category in ([named] if isinstance(named, str) else named)]

    @property
    def category_names(self) -> list[str]:
        return list(dict.fromkeys(category for _, category in self.pairs()))

    def threshold_of(self, category: str) -> float:
        return self.thresholds.get(category, self.threshold)


class Serving(_Strict):
    """What a registry entry serves beyond its task, and how (none outside the registry)."""

    fim: FimTemplate | None = None
    # Mistral's classifiers answer per target: {"<target>": {"scores": {label: score}}}.
    classifier_target: str = Field(default="label", min_length=1)
    moderation: ModerationMap | None = None
    # What an ocr model is asked of each page image.
    ocr_prompt: str = Field(default="Convert this page to markdown. Return only the markdown.", min_length=1)

    @property
    def features(self) -> list[str]:
        """The features endpoints may need (``FEATURE_OF_ENDPOINT``)."""
        return [name for name in ("fim", "moderation") if getattr(self, name) is not None]


class ModelSpec(Serving):
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


class AdapterSpec(_Strict):
    """A LoRA adapter of a registered generate model."""

    base: str = Field(min_length=1)
    # A folder: absolute, relative to the model cache, or an s3:// prefix (fetched once).
    checkpoint: str = Field(min_length=1)
    rank: int = Field(ge=1, le=512)
    # Random weights from ``seed``, for tests and demos.
    prepare: Literal["random-lora"] | None = None
    seed: int = 0
    description: str = ""


class Registry(_Strict):
    default_chat_model: str
    default_embedding_model: str
    models: dict[str, ModelSpec]
    adapters: dict[str, AdapterSpec] = Field(default_factory=dict)
    # Beside the built-in ones.
    chat_templates: dict[str, Annotated[str, Field(min_length=1)]] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _defaults_are_registered(self) -> Registry:
        for default in (self.default_chat_model, self.default_embedding_model):
            if default not in self.models:
                raise ValueError(f"default model {default!r} is not among the models")
        if bad := [name for name in self.chat_templates if not TEMPLATE_NAME.fullmatch(name)]:
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
            adapters = f", and adapters {', '.join(sorted(self.adapters))}" if self.adapters else ""
            raise UnknownModel(f"unknown model {name!r}: known models are {', '.join(sorted(self.models))}{adapters}"
                               " (or give model_config.checkpoint_path)") from None


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
        raise InvalidModelConfig(f"model registry {where}: {describe_errors(exc)}") from None
