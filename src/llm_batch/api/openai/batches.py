"""OpenAI Batch API: ``/v1/batches`` (create from an uploaded file, list, get, cancel)."""

from __future__ import annotations

import dataclasses
from typing import Annotated

import orjson
from fastapi import APIRouter, Body, Query

from llm_batch.api.auth import CallerDep
from llm_batch.api.cancellation import CancellingDep, owned_job
from llm_batch.api.errors import ApiError
from llm_batch.api.idempotency import IdempotentRoute
from llm_batch.api.openai.models import (
    COMPLETION_WINDOW_SECONDS,
    MODERATION_CATEGORIES,
    OPENAI_STATUS,
    BatchList,
    BatchOut,
    CreateBatchRequest,
)
from llm_batch.api.state import MAX_OPENAI_PAGE_SIZE, StoreDep
from llm_batch.api.submission import SubmittingDep, submit
from llm_batch.api.uploads import expiry
from llm_batch.core.endpoints import Endpoint
from llm_batch.core.job_spec import JobInput, JobSpec, ModerationShape
from llm_batch.infra import input_files, storage
from llm_batch.pipeline.admission import admit, check_owner_limits, model_registry, parse_spec

router = APIRouter(prefix="/v1/batches", tags=["openai"], route_class=IdempotentRoute)


def _model_of_first_line(uri: str, file_id: str) -> str:
    """OpenAI batches name the model per line; the job records the first request line's
    model (blank lines are skipped, as the pipeline skips them)."""
    number, line = 0, b""
    with storage.open_read(uri) as stream:
        for number, line in enumerate(stream, start=1):
            if line.strip():
                break
    try:
        model = orjson.loads(line).get("body", {}).get("model")
    except (orjson.JSONDecodeError, AttributeError):
        model = None
    if not isinstance(model, str) or not model:
        message = f"file {file_id!r}: line {number or 1} has no body.model (a string naming the model)"
        raise ApiError(400, message, param="input_file_id", code="missing_model")
    return model


def _check_moderation_categories(model: str, settings) -> None:
    """OpenAI's moderation result has a fixed set of categories: the model's map must name
    each (a model mapped to Mistral's categories serves Mistral's /v1/moderations)."""
    moderation = model_registry(settings).get(model).moderation
    if missing := [c for c in MODERATION_CATEGORIES if c not in moderation.category_names]:
        raise ApiError(400, f"model {model!r} maps its labels to {', '.join(moderation.category_names)}; an OpenAI "
                       f"/v1/moderations batch answers OpenAI's categories and the map lacks {', '.join(missing)} "
                       "(docs/models.md: a label may count for several categories; or submit the batch through "
                       "the Mistral API, which answers the map's own categories)",
                       param="input_file_id", code="model_endpoint_mismatch")


def _spec(settings, body: CreateBatchRequest, model: str) -> JobSpec:
    """The batch's job spec: its model is the first line's (``_model_of_first_line``)."""
    expires = expiry(settings, body.output_expires_after.seconds if body.output_expires_after else None)
    return parse_spec(JobSpec, {
        "model": model, "endpoint": body.endpoint, "metadata": body.metadata or {},
        "max_runtime_sec": COMPLETION_WINDOW_SECONDS[body.completion_window],
        "output_expires_after_s": int(expires.total_seconds()) if expires else None,
        "moderation_shape": ModerationShape.FLAGGED,  # OpenAI's moderation results
        "unique_custom_ids": True,  # OpenAI fails a batch with a custom_id twice
    })


@router.post("", response_model=BatchOut, summary="Create a batch from an uploaded JSONL file")
def create_batch(body: Annotated[CreateBatchRequest, Body()], submitting: SubmittingDep) -> BatchOut:
    caller, store, settings, trigger = submitting
    caller.require_submit()
    check_owner_limits(store, settings, caller, new_jobs=1)  # before the file is read for the model
    input_file = store.get_file(body.input_file_id, owner=caller.owner_filter)
    if input_file is None:
        raise ApiError(404, f"No file found with id {body.input_file_id!r}.", param="input_file_id", code="not_found")
    if (why := input_files.refusal(input_file)) is not None:
        raise ApiError(400, why, param="input_file_id", code="invalid_input_file")
    spec = _spec(settings, body, _model_of_first_line(input_file.uri, input_file.id))
    request = admit(spec, JobInput(file_ids=[input_file.id]), caller, store, settings,
                    words={"model": "input_file_id", "input_file_ids": "input_file_id"})
    if request.endpoint == Endpoint.MODERATIONS:
        _check_moderation_categories(request.model, settings)
    return BatchOut.of(submit(store, caller.name, dataclasses.replace(request, dialect="openai"), trigger))


@router.get("", response_model=BatchList, summary="List batches, newest first")
def list_batches(
    caller: CallerDep,
    store: StoreDep,
    after: Annotated[str | None, Query(max_length=128)] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_OPENAI_PAGE_SIZE)] = 20,
) -> BatchList:
    jobs, _ = store.list_jobs(owner=caller.owner_filter, dialect="openai", limit=limit + 1, after=after)
    data = [BatchOut.of(j) for j in jobs[:limit]]
    return BatchList(
        data=data,
        has_more=len(jobs) > limit,
        first_id=data[0].id if data else None,
        last_id=data[-1].id if data else None,
    )


@router.get("/{batch_id}", response_model=BatchOut, summary="Get a batch")
def get_batch(batch_id: str, caller: CallerDep, store: StoreDep) -> BatchOut:
    return BatchOut.of(owned_job(store, batch_id, caller.owner_filter, "batch"))


@router.post("/{batch_id}/cancel", response_model=BatchOut, summary="Cancel a batch")
def cancel_batch(batch_id: str, cancelling: CancellingDep) -> BatchOut:
    return BatchOut.of(cancelling(batch_id, refuse_ended=OPENAI_STATUS))
