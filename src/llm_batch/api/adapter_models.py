"""An owner's own LoRA adapters as ``/v1/adapters`` answers them (never where their files are)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from llm_batch.api.file_models import epoch
from llm_batch.infra.jobstore import OwnerAdapter


class AdapterOut(BaseModel):
    """A LoRA adapter the caller uploaded: a batch line names it as its model (``body.model``),
    as does a job's ``model``; seen and used by its owner only."""

    object: Literal["adapter"] = Field(default="adapter", description="Always `adapter`")
    name: str = Field(description="Its name, unique among the owner's adapters: what a line's `body.model` gives")
    base: str = Field(description="The registered generate model it adapts: its lines run on that model")
    rank: int = Field(description="Its LoRA rank `r`, at most the deployment's LLM_BATCH_MAX_LORA_RANK")
    bytes: int = Field(description="Bytes its two files store, counted in the owner's stored bytes "
                       "(the max_file_bytes limit)")
    created_at: int = Field(description="When it was uploaded, Unix time in seconds")

    @classmethod
    def of(cls, adapter: OwnerAdapter) -> AdapterOut:
        return cls(name=adapter.name, base=adapter.base, rank=adapter.rank, bytes=adapter.bytes,
                   created_at=epoch(adapter.created_at) or 0)


class AdapterList(BaseModel):
    """The caller's own adapters, by name."""

    object: Literal["list"] = Field(default="list", description="Always `list`")
    data: list[AdapterOut] = Field(description="Every adapter of the caller (at most a hundred), by name")


class AdapterDeleted(BaseModel):
    """What ``DELETE /v1/adapters/{name}`` answers."""

    name: str = Field(description="The name of the deleted adapter (free to upload again)")
    object: Literal["adapter"] = Field(default="adapter", description="Always `adapter`")
    deleted: Literal[True] = Field(default=True, description="Always true")
