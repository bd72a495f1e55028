"""File objects as both file-speaking SDKs read them (OpenAI ``FileObject``, Mistral
``FileSchema``/``GetFileResponse``): one shape carrying both sets of fields."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, Field

from llm_batch.core.snapshots import FileObject

# Mistral's sample_type per file kind; OpenAI's purpose for a job's results.
_SAMPLE_TYPES = {"input": "batch_request", "output": "batch_result", "error": "batch_error"}


UNIX = "Unix time in seconds"  # the unit of every answer's `..._at` field


def epoch(value: datetime | None) -> int | None:
    return int(value.timestamp()) if value is not None else None


# OpenAI's bounds of an expiry policy (files' expires_after, batches' output_expires_after).
MIN_EXPIRY_SECONDS = 3600
MAX_EXPIRY_SECONDS = 2_592_000


class ExpiresAfter(BaseModel):
    """An expiry policy (OpenAI's): the file is deleted `seconds` after its creation."""

    anchor: Literal["created_at"] = Field(description="Only `created_at`: the file's creation time")
    seconds: int = Field(ge=MIN_EXPIRY_SECONDS, le=MAX_EXPIRY_SECONDS, description="Seconds after the anchor, "
                         "3600 (1 hour) to 2592000 (30 days); the deployment's retention (LLM_BATCH_RETENTION_DAYS) "
                         "caps it")


class FileOut(BaseModel):
    """A file object: an uploaded batch input, or a job's output or error file (owned by the
    job's owner). OpenAI's ``FileObject`` fields, then Mistral's."""

    id: str = Field(description="The file id (`file-<hex>`)")
    object: Literal["file"] = Field(default="file", description="Always `file`")
    bytes: int = Field(description="Size of the content in bytes")
    created_at: int = Field(description="When the file was created, Unix time in seconds")
    filename: str = Field(description="The name given at upload (up to 512 characters; `upload.jsonl` when none); "
                          "`<job id>_output.jsonl` / `<job id>_error.jsonl` for a job's files, `inline-requests.jsonl` "
                          "/ `inline-content.json` for the inline input of a create")
    purpose: str = Field(description="`batch` for an input file (the only purpose an upload takes), `batch_output` for "
                         "a job's output and error files")
    status: Literal["uploaded", "processed", "error"] = Field(
        default="processed", description="Always `processed` (OpenAI's deprecated field): a stored file is ready")
    status_details: str | None = Field(default=None, description="Always null (OpenAI's deprecated field)")
    expires_at: int | None = Field(default=None, description="When the file is deleted (Unix time in seconds; 404 "
                                   "after): set by an upload's `expires_after` or a batch's `output_expires_after`, "
                                   "capped by the retention; null for other files, which housekeeping deletes once "
                                   "older than the retention (LLM_BATCH_RETENTION_DAYS, 30 days by default)")
    # Mistral's fields.
    sample_type: str = Field(description="Mistral's kind of file: `batch_request` (an input), `batch_result` (a job's "
                             "output), `batch_error` (a job's errors)")
    source: Literal["upload", "repository", "mistral"] = Field(
        default="upload", description="`upload` for an input file, `mistral` for a job's output or error file")
    num_lines: int | None = Field(default=None, description="Always null: lines are not counted")
    mimetype: str | None = Field(default="application/jsonl", description="Always `application/jsonl`")
    signature: str | None = Field(default=None, description="Always null")
    deleted: bool = Field(default=False, description="Always false: a deleted file is not found (404)")
    job_id: str | None = Field(default=None, description="The job whose output or error file it is; null for an "
                               "uploaded file")

    @classmethod
    def of(cls, f: FileObject) -> FileOut:
        uploaded = f.kind == "input"
        return cls(id=f.id, bytes=f.bytes, created_at=epoch(f.created_at) or 0, filename=f.filename,
                   purpose=f.purpose if uploaded else "batch_output", expires_at=epoch(f.expires_at),
                   sample_type=_SAMPLE_TYPES.get(f.kind, "batch_request"), source="upload" if uploaded else "mistral",
                   deleted=f.deleted, job_id=f.job_id)


class FileList(BaseModel):
    """OpenAI's cursor page and Mistral's counted page in one."""

    object: Literal["list"] = Field(default="list", description="Always `list`")
    data: list[FileOut] = Field(description="Your files of this page, newest first unless `order=asc`")
    total: int = Field(description="How many of your files match `purpose`, over all pages")
    has_more: bool = Field(description="Whether files follow this page (with `after`: true whenever the page is full)")
    first_id: str | None = Field(default=None, description="Id of the first file of the page; null when it is empty")
    last_id: str | None = Field(default=None, description="Id of the last file of the page (pass it as `after` for the "
                                "next page); null when empty")


class FileDeleted(BaseModel):
    """The answer to a delete: the record is marked deleted and the content removed."""

    id: str = Field(description="The deleted file's id")
    object: Literal["file"] = Field(default="file", description="Always `file`")
    deleted: bool = Field(default=True, description="Always true")
