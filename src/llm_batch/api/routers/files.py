"""Files: ``/v1/files`` as the OpenAI and Mistral SDKs call it (upload, list, get, content,
delete). Jobs' output and error files are file objects here too."""

from __future__ import annotations

from typing import Annotated, Literal
from urllib.parse import quote

from fastapi import APIRouter, File, Form, Query, Request, UploadFile
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse

from llm_batch.api.auth import Caller, CallerDep
from llm_batch.api.errors import ApiError, not_found
from llm_batch.api.file_models import FileDeleted, FileList, FileOut
from llm_batch.api.idempotency import IdempotencyDep, IdempotentRoute
from llm_batch.api.state import MAX_PAGE_SIZE, SettingsDep, StoreDep
from llm_batch.api.uploads import delete_file, expiry, form_expires_after, read_content, save_upload
from llm_batch.infra import storage
from llm_batch.infra.jobstore import FileObject
from llm_batch.pipeline.admission import check_owner_limits

router = APIRouter(prefix="/v1/files", tags=["files"], route_class=IdempotentRoute)


def _owned_file(store, caller: Caller, file_id: str) -> FileObject:
    if (found := store.get_file(file_id, owner=caller.owner_filter)) is None:
        raise not_found("file", file_id)
    return found


@router.post("", response_model=FileOut, summary="Upload a JSONL batch input file")
async def upload_file(
    request: Request, caller: CallerDep, store: StoreDep, settings: SettingsDep,
    file: Annotated[UploadFile, File(description="The JSONL file: one request per line")],
    purpose: Annotated[str, Form(max_length=64, description="`batch` (a JSONL input), or `audio` / `ocr` (a file that "
                                                      "/v1/audio/transcriptions or /v1/ocr lines name by id); 400 otherwise")] = "batch",
    expires_after_anchor: Annotated[str | None, Form(
        alias="expires_after[anchor]", max_length=64,
        description="OpenAI's expires_after.anchor: only `created_at`")] = None,
    expires_after_seconds: Annotated[str | None, Form(
        alias="expires_after[seconds]", max_length=64, description="OpenAI's expires_after.seconds: the file is "
        "deleted that long after its creation, 3600..2592000 (capped by the retention); 400 outside")] = None,
    _idempotency: IdempotencyDep = None,
) -> FileOut:
    caller.require_submit()
    expires_after = expiry(settings, form_expires_after(expires_after_anchor, expires_after_seconds))
    if (parts := len((await request.form()).getlist("file"))) > 1:
        # FastAPI would silently keep the last one: say so instead.
        raise ApiError(400, f"upload one file per request: got {parts} 'file' parts", param="file", code="invalid_file")
    if file.size is not None and file.size > settings.max_input_bytes:
        raise ApiError(413, f"{file.filename}: larger than the limit of {settings.max_input_bytes} bytes", param="file",
                       code="file_too_large")
    filename = (file.filename or "upload.jsonl")[:512]

    def check_quota(size: int) -> None:
        check_owner_limits(store, settings, caller, new_bytes=size)

    check_quota(file.size or 0)
    saved = await run_in_threadpool(save_upload, store, settings, caller.name, filename, purpose, file.file,
                                    check_quota, expires_after)
    return FileOut.of(saved)


@router.get("", response_model=FileList, summary="List files (OpenAI cursor or Mistral pages)")
def list_files(
    caller: CallerDep, store: StoreDep,
    purpose: Annotated[str | None, Query(max_length=64)] = None,
    after: Annotated[str | None, Query(max_length=128, description="OpenAI: the last id of the previous page")] = None,
    limit: Annotated[int | None, Query(ge=1, le=MAX_PAGE_SIZE)] = None,
    order: Literal["asc", "desc"] = "desc",
    page: Annotated[int, Query(ge=0, le=1_000_000, description="Mistral: 0-based page")] = 0,
    page_size: Annotated[int | None, Query(ge=1, le=MAX_PAGE_SIZE)] = None,
) -> FileList:
    size = limit or page_size or 100
    skipped = 0 if after else page * size
    outputs = purpose == "batch_output"
    files, total = store.list_files(owner=caller.owner_filter, purpose=None if outputs else purpose,
                                    kind="output" if outputs else None,
                                    order_by="created_at" if order == "asc" else "-created_at", limit=size,
                                    offset=skipped, after=after)
    data = [FileOut.of(f) for f in files]
    return FileList(data=data, total=total, has_more=len(data) == size if after else skipped + len(data) < total,
                    first_id=data[0].id if data else None, last_id=data[-1].id if data else None)


@router.get("/{file_id}", response_model=FileOut, summary="Get a file object")
def get_file(file_id: str, caller: CallerDep, store: StoreDep) -> FileOut:
    return FileOut.of(_owned_file(store, caller, file_id))


@router.get("/{file_id}/content", response_class=StreamingResponse,
            responses={200: {"content": {"application/octet-stream": {}}}}, summary="Download a file's content")
def get_file_content(file_id: str, caller: CallerDep, store: StoreDep) -> StreamingResponse:
    found = _owned_file(store, caller, file_id)
    try:
        chunks = read_content(found)
    except storage.ObjectNotFound:
        raise ApiError(404, f"file {file_id!r} has no content any more", param="file_id", code="content_missing") from None
    return StreamingResponse(chunks, media_type="application/octet-stream",
                             headers={"Content-Disposition": f"attachment; filename*=UTF-8''{quote(found.filename)}"})


@router.delete("/{file_id}", response_model=FileDeleted, summary="Delete a file")
def remove_file(file_id: str, caller: CallerDep, store: StoreDep) -> FileDeleted:
    caller.require_submit()
    delete_file(store, _owned_file(store, caller, file_id), caller.owner_filter)
    return FileDeleted(id=file_id)
