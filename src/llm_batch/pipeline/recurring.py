"""Recurring batch specs: a small YAML file per scheduled batch, each the DAG ``recurring__<name>``
(no Airflow here; the rules: docs/orchestration.md "Recurring batches"). A spec that does not
parse raises ``RecurringSpecError`` naming the file and the field."""

from __future__ import annotations

from datetime import date
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from llm_batch.core import owners
from llm_batch.core.endpoints import Endpoint
from llm_batch.core.input_formats import INPUT_FORMATS, InputFormat
from llm_batch.core.run_conf import DEFAULT_RUNTIME_SEC, MAX_DATA_PARALLELISM, MAX_RUNTIME_SEC

DAG_ID_PREFIX = "recurring__"


def output_asset_uri(name: str) -> str:
    """The asset every successful run of spec `name` updates (its output paths change per run)."""
    return f"llm-batch://recurring/{name}"


class RecurringSpecError(ValueError):
    """A spec file that cannot become a DAG; the message names the file and the reason."""


class AssetSchedule(BaseModel):
    model_config = ConfigDict(extra="forbid")

    asset: str = Field(min_length=1, description="URI of the asset whose updates start a run")


class RecurringParams(BaseModel):
    """The batch_inference params a recurring run passes on (same ranges as the DAG form)."""

    model_config = ConfigDict(extra="forbid")

    data_parallelism: int = Field(1, ge=1, le=MAX_DATA_PARALLELISM)
    max_runtime_sec: int = Field(DEFAULT_RUNTIME_SEC, ge=1, le=MAX_RUNTIME_SEC)
    priority: str | int | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    metadata: dict[str, str] = Field(default_factory=dict)
    gpus: int = Field(1, ge=1, le=8)
    gpu_type: str | None = None
    nodes_per_worker: int = Field(1, ge=1, le=16)


class RecurringSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,200}$")
    description: str = ""
    owner: str | None = Field(None, pattern=owners.OWNER_NAME.pattern.join("^$"),
                              description="whose jobs the runs make (an owner name); default: the admin's")
    schedule: str | AssetSchedule
    start_date: date = date(2025, 1, 1)
    input_uri: str = Field(min_length=1)
    input_format: Literal[INPUT_FORMATS] = InputFormat.JSONL
    output_uri: str | None = None
    endpoint: Endpoint = Endpoint.CHAT_COMPLETIONS
    model: str = Field(min_length=1)
    engine_config: dict[str, Any] = Field(default_factory=dict, alias="model_config")
    params: RecurringParams = Field(default_factory=RecurringParams)
    tags: list[str] = Field(default_factory=list)

    @property
    def dag_id(self) -> str:
        return DAG_ID_PREFIX + self.name

    @property
    def output_asset(self) -> str:
        """The asset URI updated (by batch_inference's finalize) when a run's batch succeeds."""
        return output_asset_uri(self.name)

    def run_conf(self) -> dict[str, Any]:
        """The batch_inference conf of a run (input/output still templates)."""
        params = self.params.model_dump(exclude_none=True)
        params["labels"] = {"recurring": self.name, **params["labels"]}
        params["metadata"] = {"recurring": self.name, **params["metadata"]}
        conf = {"input_uri": self.input_uri, "input_format": self.input_format, "output_uri": self.output_uri,
                "endpoint": self.endpoint.value, "model": self.model, "model_config": self.engine_config,
                "owner": self.owner, **params}
        return {key: value for key, value in conf.items() if value is not None}


def spec_files(folder: Path) -> list[Path]:
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.suffix in (".yaml", ".yml") and p.is_file())


def load_spec(path: Path) -> RecurringSpec:
    """The spec in `path`, or RecurringSpecError saying what is wrong and where."""
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise RecurringSpecError(f"{path.name}: not readable YAML: {exc}") from None
    if not isinstance(data, dict):
        raise RecurringSpecError(f"{path.name}: must be a mapping of fields, got {type(data).__name__}")
    try:
        return RecurringSpec.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in error['loc']) or 'spec'}: {error['msg']}"
                             for error in exc.errors())
        raise RecurringSpecError(f"{path.name}: {problems}") from None
