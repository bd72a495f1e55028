"""Mistral batch jobs: ``/v1/batch/jobs`` (create from files or inline requests, list with
filters, get, cancel)."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

import orjson
from fastapi import APIRouter, Body, Query, Request

from llm_batch.api.auth import CallerDep
from llm_batch.api.cancellation import CancellingDep, owned_job
from llm_batch.api.errors import ApiError
from llm_batch.api.idempotency import IdempotentRoute
from llm_batch.api.mistral.models import (
    MISTRAL_STATUS,
    BatchJobList,
    BatchJobOut,
    CreateBatchJobRequest,
    DeleteBatchJobResponse,
)
from llm_batch.api.state import MAX_PAGE_SIZE, SettingsDep, StoreDep
from llm_batch.api.submission import SubmittingDep, inline_items, stored_inline, submit
from llm_batch.core.job_spec import MAX_INLINE_REQUESTS, JobInput
from llm_batch.infra import storage
from llm_batch.infra.jobstore import FileRepository, Job
from llm_batch.pipeline import housekeeping
from llm_batch.pipeline.admission import admit

router = APIRouter(prefix="/v1/batch/jobs", tags=["mistral"], route_class=IdempotentRoute)

MistralStatus = Literal[
    "QUEUED", "RUNNING", "SUCCESS", "FAILED", "TIMEOUT_EXCEEDED", "CANCELLATION_REQUESTED", "CANCELLED"
]


def _outputs(store: FileRepository, job: Job) -> list[dict[str, Any]] | None:
    """Inline jobs answer their results inline once the output file exists."""
    if not job.input.inline or not job.output_file_id:
        return None
    output = store.get_file(job.output_file_id)
    if output is None:
        return None
    results = []
    try:
        with storage.open_read(output.uri) as stream:
            for line in stream:
                if line.strip():
                    results.append(orjson.loads(line))
                if len(results) >= MAX_INLINE_REQUESTS:
                    break
    except (storage.StorageError, orjson.JSONDecodeError):
        return None
    return results


_LIST_PARAMS = frozenset(
    {"page", "page_size", "model", "agent_id", "metadata", "created_after", "created_by_me", "status", "order_by"}
)


@router.post("", response_model=BatchJobOut, summary="Create a batch job")
def create_batch_job(body: Annotated[CreateBatchJobRequest, Body()], submitting: SubmittingDep) -> BatchJobOut:
    caller, store, settings, trigger = submitting
    caller.require_submit()
    if body.agent_id is not None:
        raise ApiError(400, "agent_id is not supported: this system runs models, not agents; give model", param="agent_id")
    if bool(body.input_files) == bool(body.requests):
        raise ApiError(400, "give exactly one of input_files (uploaded file ids) or requests (inline)", param="input_files")
    given = JobInput(file_ids=body.input_files, requests=inline_items(body.requests) if body.requests else None)
    request = admit(body.spec(), given, caller, store, settings, words={"input_file_ids": "input_files"})
    if body.requests:
        request = stored_inline(store, settings, caller.name, request)
    request = dataclasses.replace(request, dialect="mistral")
    job = submit(store, caller.name, request, trigger)
    return BatchJobOut.of(job)


@router.get("", response_model=BatchJobList, summary="List batch jobs")
def list_batch_jobs(
    request: Request,
    caller: CallerDep,
    store: StoreDep,
    page: Annotated[int, Query(ge=0, le=1_000_000)] = 0,
    page_size: Annotated[int, Query(ge=1, le=MAX_PAGE_SIZE)] = 100,
    model: Annotated[str | None, Query(max_length=256)] = None,
    agent_id: Annotated[str | None, Query(max_length=256, description="No job here runs an agent")] = None,
    metadata: Annotated[
        str | None,
        Query(
            max_length=4096,
            description='Jobs whose metadata has these pairs: a JSON object (e.g. {"team": "a"}), or, as the '
            "Mistral SDK sends it (form style, exploded), any other query parameter such as team=a",
        ),
    ] = None,
    created_after: datetime | None = None,
    created_by_me: bool = False,
    status: Annotated[list[MistralStatus] | None, Query()] = None,
    order_by: Literal["created", "-created"] = "-created",
) -> BatchJobList:
    # Mistral's metadata filter arrives form-exploded: every unknown query parameter.
    wanted_metadata = {key: value for key, value in request.query_params.items() if key not in _LIST_PARAMS}
    if metadata:
        try:
            given = orjson.loads(metadata)
        except orjson.JSONDecodeError as exc:
            raise ApiError(400, f"metadata must be a JSON object: {exc}", param="metadata") from None
        if not isinstance(given, dict):
            raise ApiError(400, "metadata must be a JSON object", param="metadata")
        wanted_metadata.update(given)
    if agent_id is not None:
        return BatchJobList(data=[], total=0)
    if created_after is not None and created_after.tzinfo is None:
        created_after = created_after.replace(tzinfo=UTC)  # a time without zone is UTC
    jobs, total = store.list_jobs(
        owner=caller.name if created_by_me else caller.owner_filter,
        statuses={canonical for canonical, word in MISTRAL_STATUS.items() if word in status} if status else None,
        model=model,
        metadata={str(k): str(v) for k, v in wanted_metadata.items()} if wanted_metadata else None,
        created_after=created_after,
        dialect="mistral",
        order_by="created_at" if order_by == "created" else "-created_at",
        limit=page_size,
        offset=page * page_size,
    )
    return BatchJobList(data=[BatchJobOut.of(j) for j in jobs], total=total)


@router.get("/{job_id}", response_model=BatchJobOut, summary="Get a batch job")
def get_batch_job(job_id: str, caller: CallerDep, store: StoreDep) -> BatchJobOut:
    job = owned_job(store, job_id, caller.owner_filter, "batch job")
    return BatchJobOut.of(job, outputs=_outputs(store, job))


@router.post("/{job_id}/cancel", response_model=BatchJobOut, summary="Cancel a batch job")
def cancel_batch_job(job_id: str, cancelling: CancellingDep) -> BatchJobOut:
    job = cancelling(job_id, kind="batch job", refuse_ended=MISTRAL_STATUS)
    return BatchJobOut.of(job)


@router.delete(
    "/{job_id}",
    response_model=DeleteBatchJobResponse,
    summary="Delete an ended batch job: its record, results and errors (a live job: 409, cancel it first)",
)
def delete_batch_job(job_id: str, caller: CallerDep, store: StoreDep, settings: SettingsDep) -> DeleteBatchJobResponse:
    caller.require_submit()
    job = owned_job(store, job_id, caller.owner_filter, "batch job")
    if not job.terminal:
        raise ApiError(409, f"batch job {job_id!r} is {MISTRAL_STATUS[job.status]}: cancel it first, then delete it "
                       "once it has ended", param="job_id", code="job_not_ended")
    housekeeping.delete_job(store, settings, job)
    return DeleteBatchJobResponse(id=job_id)
