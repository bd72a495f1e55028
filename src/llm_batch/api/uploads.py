"""The file use cases: store an upload (size-capped, JSONL-checked), stream content back,
delete. Content lives in storage under ``Settings.files_uri``, metadata in the job store."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import BinaryIO

import orjson

from llm_batch.api.errors import ApiError
from llm_batch.api.file_models import MAX_EXPIRY_SECONDS, MIN_EXPIRY_SECONDS
from llm_batch.core.config import Settings
from llm_batch.core.layout import join_uri
from llm_batch.infra import storage
from llm_batch.infra.jobstore import FileObject, FileRepository, JobStore, new_file_id
from llm_batch.pipeline.housekeeping import live_jobs

# Mistral's: a file an /v1/ocr or /v1/audio/transcriptions line names, kept as it is (infra.media checks it).
MEDIA_PURPOSES = ("ocr", "audio")
ACCEPTED_PURPOSES = ("batch", *MEDIA_PURPOSES)
CHUNK_BYTES = 1 << 20


def _check_first_line(head: bytes, filename: str, max_line_bytes: int) -> None:
    """Its first non-blank line must be a JSON object; the job's validation checks the others
    one by one, so one bad line never rejects a whole batch."""
    text = head.lstrip()
    number = head[: len(head) - len(text)].count(b"\n") + 1
    line, newline, _ = text.partition(b"\n")
    if not newline and len(line) > max_line_bytes:
        raise _invalid(f"{filename}: not JSONL: line {number} is longer than {max_line_bytes} bytes")
    try:
        first = orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        raise _invalid(f"{filename}: not JSONL: line {number} is not valid JSON ({exc})") from None
    if not isinstance(first, dict):
        raise _invalid(f"{filename}: not JSONL: line {number} is a JSON {type(first).__name__}, not an object")


def _invalid(message: str) -> ApiError:
    return ApiError(400, message, param="file", code="invalid_file")


def save_upload(
    store: FileRepository,
    settings: Settings,
    owner: str,
    filename: str,
    purpose: str,
    stream: BinaryIO,
    check_quota: Callable[[int], None] | None = None,
    expires_after: timedelta | None = None,
) -> FileObject:
    """Copy `stream` to storage and record it; 413 above the size limit, 400 if it is empty or (a
    batch file) not JSONL, and whatever ``check_quota(bytes)`` raises once the size is known."""
    if purpose not in ACCEPTED_PURPOSES:
        raise ApiError(400, f"purpose {purpose!r} is not accepted: this service takes batch input files "
                       "(purpose='batch') and the audio and images batch lines name (purpose='audio' or 'ocr')",
                       param="purpose", code="invalid_purpose")
    media = purpose in MEDIA_PURPOSES
    limit = settings.max_media_bytes if media else settings.max_input_bytes
    file_id = new_file_id()
    uri = join_uri(settings.files_uri, file_id)
    written = 0
    head = b""  # the start of the file, until its first non-blank line is complete
    checked = media  # media files are not JSONL: their content is checked where a line names them
    with storage.open_write(uri) as out:
        while chunk := stream.read(CHUNK_BYTES):
            written += len(chunk)
            if written > limit:
                raise ApiError(413, f"{filename}: larger than the limit of {limit} bytes", param="file", code="file_too_large")
            if not checked:
                head += chunk
                text = head.lstrip()
                if b"\n" in text or len(text) > settings.max_line_bytes:
                    _check_first_line(head, filename, settings.max_line_bytes)
                    checked = True
                elif not text:  # only blank lines so far: keep their count, not their bytes
                    head = b"\n" * head.count(b"\n")
            out.write(chunk)
        if media and not written:
            raise _invalid(f"{filename}: the file is empty")
        if not checked:
            if not head.strip():
                raise _invalid(f"{filename}: the file is empty (no request line)")
            _check_first_line(head, filename, settings.max_line_bytes)
        if check_quota is not None:
            check_quota(written)
    return store.create_file(id=file_id, owner=owner, purpose=purpose, filename=filename, bytes=written, uri=uri,
                             expires_after=expires_after)


def expiry(settings: Settings, seconds: int | None) -> timedelta | None:
    """A requested expiry capped by the retention, which deletes every older file anyway."""
    return None if seconds is None else min(timedelta(seconds=seconds), timedelta(days=settings.retention_days))


def form_expires_after(anchor: str | None, seconds: str | None) -> int | None:
    """The seconds of an upload's ``expires_after[anchor]`` / ``expires_after[seconds]`` form fields
    (the openai SDK's encoding); None when neither is given."""
    if anchor is None and seconds is None:
        return None
    if anchor != "created_at":
        shown = "missing" if anchor is None else repr(anchor[:40])
        raise ApiError(400, f"expires_after[anchor] must be 'created_at' (got {shown})",
                       param="expires_after[anchor]", code="invalid_expires_after")
    try:
        value = int((seconds or "").strip())
    except ValueError:
        value = None
    if value is None or not MIN_EXPIRY_SECONDS <= value <= MAX_EXPIRY_SECONDS:
        shown = "missing" if seconds is None else repr(seconds[:40])
        raise ApiError(400, f"expires_after[seconds] must be an integer from {MIN_EXPIRY_SECONDS} (1 hour) to "
                       f"{MAX_EXPIRY_SECONDS} (30 days) (got {shown})",
                       param="expires_after[seconds]", code="invalid_expires_after")
    return value


def read_content(f: FileObject) -> Iterator[bytes]:
    """The file's content in chunks, opened now: a missing object raises here, not mid-response."""
    reader = storage.open_read(f.uri)
    stream = reader.__enter__()

    def chunks() -> Iterator[bytes]:
        try:
            while chunk := stream.read(CHUNK_BYTES):
                yield chunk
        finally:
            reader.__exit__(None, None, None)

    return chunks()


def some_ids(ids: list[str]) -> str:
    return ", ".join(ids[:5]) + (" ..." if len(ids) > 5 else "")


def delete_file(store: JobStore, f: FileObject, owner: str | None) -> None:
    """Mark `f` deleted and remove its content; 409 while a job that has not ended reads it."""
    if readers := [j.id for j in live_jobs(store) if f.id in (*(j.input.file_ids or []), j.input.inline_file_id)]:
        raise ApiError(409, f"file {f.id!r} is the input of jobs that have not ended ({some_ids(readers)}): cancel "
                       "them or wait, then delete", param="file_id", code="file_in_use")
    store.mark_file_deleted(f.id, owner=owner)
    with contextlib.suppress(storage.StorageError):  # the record says deleted; housekeeping retries the content
        storage.delete(f.uri)
