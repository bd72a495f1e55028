"""The canonical records that flow through a job, one JSON object per line: every input item ends
as exactly one ``ResultRecord`` or ``ErrorRecord``, ordered by ``index`` (``line`` is 1-based, for people)."""

from __future__ import annotations

from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict


class BatchRequest(BaseModel):
    """One validated request, as stored in validated and shard files."""

    model_config = ConfigDict(extra="forbid")

    index: int
    custom_id: str
    body: dict[str, Any]
    # 1-based line (JSONL) or element (arrays) in its input file: what error records report.
    line: int | None = None
    # The file the body names, resolved for the job's owner at validation: the worker reads only this.
    media: dict[str, Any] | None = None
    # The LoRA adapter the line runs on (None: the base model), and where an owner's own one is.
    adapter: str | None = None
    adapter_uri: str | None = None


class RequestError(BaseModel):
    code: str
    message: str


class ResultRecord(BaseModel):
    """A worker's answer to one request: ``body`` on success, ``error`` otherwise."""

    model_config = ConfigDict(extra="forbid")

    index: int
    custom_id: str
    status_code: int
    body: dict[str, Any] | None = None
    error: RequestError | None = None
    # The request's input line; merge copies it from the request when the worker did not.
    line: int | None = None
    # True when the answer came from the result cache (an earlier job's), not the engine.
    cached: bool | None = None
    # Checked outputs: how many answers before this one failed the job's check, and their tokens.
    retries: int | None = None
    retry_tokens: int | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and 200 <= self.status_code < 300


class ErrorRecord(BaseModel):
    """A request that produced no result: bad at validation, or never run."""

    model_config = ConfigDict(extra="forbid")

    index: int
    line: int
    custom_id: str | None = None
    code: str
    message: str


def dumps_line(record: BaseModel | dict[str, Any]) -> bytes:
    """One JSONL line (with the newline) for a record or a plain dict."""
    data = record.model_dump(exclude_none=True) if isinstance(record, BaseModel) else record
    return orjson.dumps(data) + b"\n"
