"""File objects as both file-speaking SDKs read them (OpenAI ``FileObject``, Mistral
``FileSchema``/``GetFileResponse``): one shape carrying both sets of fields."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel

from llm_batch.jobstore import FileObject

# Mistral's sample_type per file kind; OpenAI's purpose for a job's results.
_SAMPLE_TYPES = {"input": "batch_request", "output": "batch_result", "error": "batch_error"}


def epoch(value: datetime | None) -> int | None:
    return int(value.timestamp()) if value is not None else None


class FileOut(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: Literal["uploaded", "processed", "error"] = "processed"
    status_details: str | None = None
    expires_at: int | None = None
    # Mistral's fields.
    sample_type: str
    source: Literal["upload", "repository", "mistral"] = "upload"
    num_lines: int | None = None
    mimetype: str | None = "application/jsonl"
    signature: str | None = None
    deleted: bool = False
    job_id: str | None = None

    @classmethod
    def of(cls, f: FileObject) -> FileOut:
        return cls(
            id=f.id,
            bytes=f.bytes,
            created_at=epoch(f.created_at) or 0,
            filename=f.filename,
            purpose=f.purpose if f.kind == "input" else "batch_output",
            expires_at=epoch(f.expires_at),
            sample_type=_SAMPLE_TYPES.get(f.kind, "batch_request"),
            source="upload" if f.kind == "input" else "mistral",
            deleted=f.deleted,
            job_id=f.job_id,
        )


class FileList(BaseModel):
    """OpenAI's cursor page and Mistral's counted page in one."""

    object: Literal["list"] = "list"
    data: list[FileOut]
    total: int
    has_more: bool
    first_id: str | None = None
    last_id: str | None = None


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True
