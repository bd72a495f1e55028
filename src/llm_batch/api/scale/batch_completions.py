"""Scale batch completions v2: ``/v2/batch-completions`` (and v1's create)."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any

import orjson
from airflow.api_fastapi.common.db.common import SessionDep
from fastapi import APIRouter, Body

from llm_batch.api.auth import Caller, CallerDep
from llm_batch.api.cancellation import CancellingDep, owned_job
from llm_batch.api.dag_trigger import reprioritize_waiting_tasks
from llm_batch.api.errors import ApiError
from llm_batch.api.idempotency import IdempotentRoute
from llm_batch.api.scale.models import (
    BatchCompletionsJob,
    CancelBatchCompletionsResponse,
    CreateBatchCompletionsRequest,
    CreateBatchCompletionsV1Response,
    GetBatchCompletionResponse,
    ListBatchCompletionsResponse,
    UpdateBatchCompletionsRequest,
    UpdateBatchCompletionsResponse,
    V1Content,
)
from llm_batch.api.state import MAX_PAGE_SIZE, SettingsDep, StoreDep
from llm_batch.api.submission import SubmittingDep, inline_json, save_inline_requests, submit
from llm_batch.core.config import Settings
from llm_batch.core.endpoints import Endpoint
from llm_batch.core.input_formats import InputFormat
from llm_batch.core.job_spec import JobInput, JobOptions, JobSpec, OutputFormat
from llm_batch.core.jobs import JobStatus
from llm_batch.core.placement import priority_name
from llm_batch.infra.jobstore import Job
from llm_batch.pipeline.admission import admit, check_input_readable, check_user_path, parse_spec, priority_weight

router = APIRouter(prefix="/v2/batch-completions", tags=["scale"], route_class=IdempotentRoute)
# Scale's client (llmengine Completion.batch_create) still posts v1; same job, v1 answer.
v1_router = APIRouter(prefix="/v1/llm/batch-completions", tags=["scale"], route_class=IdempotentRoute)

_SNIFF_BYTES = 64 * 1024


def _content_kind(content: list[dict[str, Any]] | V1Content) -> tuple[str, str]:
    """(endpoint, input format) of inline content: chat when its first request has messages."""
    if isinstance(content, V1Content):
        return Endpoint.COMPLETIONS.value, InputFormat.SCALE_V1
    chat = "messages" in content[0]
    return (Endpoint.CHAT_COMPLETIONS.value if chat else Endpoint.COMPLETIONS.value), InputFormat.SCALE_V2


def _sniff_file(uri: str, given: str, caller: Caller, settings: Settings) -> tuple[str, str]:
    """(endpoint, input format) of a Scale input file, from its first 64 KiB (an array:
    scale-v2, an object: scale-v1); what cannot be either is refused now."""
    param = "input_data_path"
    head = check_input_readable(uri, given, param, settings, caller, head=_SNIFF_BYTES + 1)
    start = head.lstrip()[:1]
    if not start:
        raise ApiError(400, f"input_data_path {uri!r} is empty", param=param, code="invalid_input")
    if start not in (b"[", b"{"):
        raise ApiError(400, f"input_data_path {uri!r}: {_EXPECTED_INPUT}", param=param, code="invalid_input")
    if len(head) <= _SNIFF_BYTES:  # the whole file: parse it
        try:
            parsed = orjson.loads(head)
        except orjson.JSONDecodeError as exc:
            raise ApiError(400, f"input_data_path {uri!r}: not valid JSON ({exc}); {_EXPECTED_INPUT}", param=param, code="invalid_input") from None
        if parsed == []:
            raise ApiError(400, f"input_data_path {uri!r} holds no requests (an empty array)", param=param, code="invalid_input")
    if start == b"{":
        return Endpoint.COMPLETIONS.value, InputFormat.SCALE_V1
    messages, prompt = head.find(b'"messages"'), head.find(b'"prompt')
    chat = messages >= 0 and (prompt < 0 or messages < prompt)
    return (Endpoint.CHAT_COMPLETIONS.value if chat else Endpoint.COMPLETIONS.value), InputFormat.SCALE_V2


_EXPECTED_INPUT = "expected a JSON array of completion or chat requests, or a {\"prompts\": [...]} object"


def _job_out(settings: Settings, job: Job) -> BatchCompletionsJob:
    name = priority_name(settings, job.priority) or (str(job.priority) if job.priority else None)
    return BatchCompletionsJob.of(job, name)


@router.post("", response_model=BatchCompletionsJob, summary="Create a batch completions job")
def create_batch_completions(body: Annotated[CreateBatchCompletionsRequest, Body()],
                             submitting: SubmittingDep) -> BatchCompletionsJob:
    caller, store, settings, trigger = submitting
    caller.require_submit()
    if body.tool_config is not None:
        raise ApiError(400, "tool_config is not supported: this system runs no tools", param="tool_config")
    if (body.input_data_path is None) == (body.content is None):
        raise ApiError(400, "give exactly one of input_data_path or content", param="input_data_path")
    if body.content == []:
        raise ApiError(400, "content holds no requests (an empty list)", param="content", code="invalid_input")
    v1 = isinstance(body.content, V1Content)
    if body.input_data_path is not None:
        input_uri = check_user_path(body.input_data_path, "input_data_path", settings, caller)
        endpoint, input_format = _sniff_file(input_uri, body.input_data_path, caller, settings)
        given = JobInput(uri=body.input_data_path, path=body.input_data_path)
    else:
        endpoint, input_format = _content_kind(body.content)
        # The requests the content stands for, as the owner's limits count them.
        given = JobInput(requests=[{"prompt": p} for p in body.content.prompts] if v1 else body.content)
    spec = parse_spec(JobSpec, {
        "model": body.model_config_.model, "model_config": body.model_config_.model_dump(), "endpoint": endpoint,
        "input_format": input_format, "output_uri": body.output_data_path, "output_format": OutputFormat.JSON_ARRAY,
        "labels": {**(body.model_config_.labels or {}), **body.labels}, "priority": body.priority,
        "data_parallelism": body.data_parallelism, "max_runtime_sec": body.max_runtime_sec,
        "gpu_type": body.gpu_type, "nodes_per_worker": body.nodes_per_worker or 1,
    })
    resources = body.model_dump(include={"gpus", "gpu_type", "nodes_per_worker", "cpus", "memory", "storage"},
                                exclude_none=True)
    request = admit(spec, given, caller, store, settings, words=_WORDS, resources=resources)
    if body.content is not None:  # saved once admitted: a refused job leaves nothing behind
        content = body.content.model_dump() if v1 else body.content
        saved = save_inline_requests(store, settings, caller.name, [inline_json(content, "content")],
                                     "inline-content.json", **dict(request.input.part(JobOptions)))
        request = dataclasses.replace(request, input=saved)
    job = submit(store, caller.name, dataclasses.replace(request, dialect="scale"), trigger)
    return _job_out(settings, job)


# Scale's names of the job's fields, for admission's refusals.
_WORDS = {"model": "model_config.model", "input_uri": "input_data_path", "output_uri": "output_data_path"}


@v1_router.post("", response_model=CreateBatchCompletionsV1Response, summary="Create a job (Scale v1 client)")
def create_batch_completions_v1(body: Annotated[CreateBatchCompletionsRequest, Body()],
                                submitting: SubmittingDep) -> CreateBatchCompletionsV1Response:
    job = create_batch_completions(body, submitting)
    return CreateBatchCompletionsV1Response(job_id=job.job_id)


@router.get("", response_model=ListBatchCompletionsResponse, summary="List batch completions jobs")
def list_batch_completions(caller: CallerDep, store: StoreDep, settings: SettingsDep) -> ListBatchCompletionsResponse:
    jobs, _ = store.list_jobs(owner=caller.owner_filter, dialect="scale", limit=MAX_PAGE_SIZE)
    return ListBatchCompletionsResponse(jobs=[_job_out(settings, j) for j in jobs])


@router.get("/{batch_completion_id}", response_model=GetBatchCompletionResponse, summary="Get a job")
def get_batch_completion(
    batch_completion_id: str, caller: CallerDep, store: StoreDep, settings: SettingsDep
) -> GetBatchCompletionResponse:
    job = owned_job(store, batch_completion_id, caller.owner_filter, "batch completion")
    return GetBatchCompletionResponse(job=_job_out(settings, job))


@router.post(
    "/{batch_completion_id}", response_model=UpdateBatchCompletionsResponse, summary="Update a job's priority"
)
def update_batch_completion(
    batch_completion_id: str,
    body: Annotated[UpdateBatchCompletionsRequest, Body()],
    caller: CallerDep,
    store: StoreDep,
    settings: SettingsDep,
    session: SessionDep,
) -> UpdateBatchCompletionsResponse:
    """The new priority is the job's and its tasks' that have not started."""
    caller.require_submit()
    job = owned_job(store, batch_completion_id, caller.owner_filter, "batch completion")
    if body.priority is not None:
        weight = priority_weight(settings, body.priority)
        job = store.set_priority(job.id, weight, owner=caller.owner_filter)
        if not job.terminal:
            reprioritize_waiting_tasks(job.id, weight, session)
    return UpdateBatchCompletionsResponse(**_job_out(settings, job).model_dump(by_alias=True), success=True)


@router.post(
    "/{batch_completion_id}/actions/cancel",
    response_model=CancelBatchCompletionsResponse,
    summary="Cancel a job (success: it is cancelling or cancelled now)",
)
def cancel_batch_completion(batch_completion_id: str, cancelling: CancellingDep) -> CancelBatchCompletionsResponse:
    job = cancelling(batch_completion_id, kind="batch completion")
    return CancelBatchCompletionsResponse(success=job.status in (JobStatus.CANCELLING, JobStatus.CANCELLED))
