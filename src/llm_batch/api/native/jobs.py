"""Native jobs: ``/v1/jobs`` (create from inline requests, uploaded files or a path, with an
optional client-chosen id; get; list with filters and a cursor; cancel), in the canonical
words (``llm_batch.core.jobs.JobStatus``). The route of ``llm_batch.airflow.operators.LLMBatchOperator``
and of the CLI's ``jobs`` / ``job``; every job is readable here, whichever route or
Airflow run created it.

A create with ``id`` is idempotent per owner: the id already yours answers that job (200,
nothing submitted), another owner's is 409. A retried Airflow task therefore re-attaches.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Body, Query

from llm_batch.api.auth import Caller, CallerDep
from llm_batch.api.cancellation import cancel_job
from llm_batch.api.dag_trigger import TriggerDep
from llm_batch.api.errors import ApiError, not_found
from llm_batch.api.idempotency import IdempotencyDep, IdempotentRoute
from llm_batch.api.limits import check_owner_limits
from llm_batch.api.mistral.jobs import _input_files
from llm_batch.api.native.models import JOB_ID_PATTERN, CreateJob, JobList, JobOut
from llm_batch.api.state import MAX_PAGE_SIZE, SettingsDep, StoreDep
from llm_batch.api.submission import (
    check_endpoint,
    check_model,
    check_output_target,
    check_user_path,
    inline_request_lines,
    priority_weight,
    save_inline_requests,
    submit,
)
from llm_batch.core.input_formats import InputFormat
from llm_batch.core.job_input import JobInput
from llm_batch.core.job_request import JobRequest
from llm_batch.core.jobs import JobStatus
from llm_batch.infra.jobstore import DuplicateId, InvalidCursor, Job, JobStore
from llm_batch.infra.model_registry import ModelError, job_model_config

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], route_class=IdempotentRoute)

_KIND = "job"
# The canonical status words, as a list filter takes them (a Literal: no separate enum schema).
StatusWord = Literal["QUEUED", "VALIDATING", "RUNNING", "FINALIZING", "CANCELLING", "SUCCEEDED", "FAILED",
                     "TIMEOUT_EXCEEDED", "CANCELLED"]
assert set(StatusWord.__args__) == {s.value for s in JobStatus}


def _reattach(store: JobStore, caller: Caller, job_id: str) -> Job | None:
    """The caller's job of that id (re-attach), None if the id is free; 409 if it is another owner's."""
    existing = store.get_job(job_id)
    if existing is None:
        return None
    if existing.owner != caller.name:
        raise ApiError(409, f"id {job_id!r} is taken: choose another id", param="id", code="id_taken")
    return existing


def _stored_model_config(model: str, model_config: dict[str, Any]) -> dict[str, Any]:
    try:
        return job_model_config({**model_config, "model": model})
    except ModelError as exc:
        fields = getattr(exc, "fields", ())
        param = f"model_config.{fields[0]}" if fields else "model_config"
        raise ApiError(400, str(exc), param=param, code="invalid_model_config") from None


def _output_target(store: JobStore, caller: Caller, output_uri: str, labels: dict[str, Any]) -> None:
    """check_output_target, its answer naming this route's field."""
    try:
        check_output_target(store, caller, output_uri, labels)
    except ApiError as exc:
        raise ApiError(exc.status_code, exc.message.replace("output_data_path", "output_uri"), param="output_uri",
                       code=exc.code) from None


@router.post("", response_model=JobOut, summary="Create a job (with `id`: idempotent, re-attaches to yours)")
def create_job(
    body: Annotated[CreateJob, Body()],
    caller: CallerDep,
    store: StoreDep,
    settings: SettingsDep,
    trigger: TriggerDep,
    _idempotency: IdempotencyDep = None,
) -> JobOut:
    caller.require_submit()
    if body.id is not None and (existing := _reattach(store, caller, body.id)) is not None:
        return JobOut.of(existing)
    given = [name for name in ("requests", "input_file_ids", "input_uri") if getattr(body, name) is not None]
    if len(given) != 1:
        raise ApiError(400, "give exactly one of requests (inline), input_file_ids (uploaded files) or input_uri "
                       f"(a path); got {', '.join(given) or 'none'}", param="requests", code="invalid_input")
    endpoint = check_endpoint(body.endpoint)
    model_config = _stored_model_config(body.model, body.model_config_)  # a bad field: 400 naming it
    check_model(body.model, model_config, settings, param="model", endpoint=endpoint, caller=caller)
    labels = dict(body.labels or {})
    weight = priority_weight(settings, body.priority)
    check_owner_limits(store, settings, caller, new_jobs=1, new_requests=len(body.requests or []))
    input_uri = check_user_path(body.input_uri, "input_uri", settings, caller) if body.input_uri else None
    output_uri = None
    if body.output_uri is not None:
        output_uri = check_user_path(body.output_uri, "output_uri", settings, caller)
        if output_uri == input_uri:
            raise ApiError(400, "output_uri is the input_uri: the results would overwrite the requests",
                           param="output_uri", code="invalid_output")
        _output_target(store, caller, output_uri, labels)
    # Every check is done: only now is anything written.
    if body.input_file_ids:
        try:
            files = _input_files(store, caller, body.input_file_ids)
        except ApiError as exc:  # the Mistral check, naming this route's field
            param = (exc.param or "").replace("input_files", "input_file_ids")
            raise ApiError(exc.status_code, exc.message.replace("input_files[", "input_file_ids["), param=param,
                           code=exc.code) from None
        job_input = JobInput(file_ids=[f.id for f in files])
    elif input_uri is not None:
        job_input = JobInput(uri=input_uri, path=body.input_uri)
    else:
        inline = save_inline_requests(store, settings, caller.name, inline_request_lines(body.requests or []), "inline-requests.jsonl")
        job_input = JobInput(uri=inline.uri, inline=True, inline_file_id=inline.id)
    request = JobRequest(
        dialect="airflow",
        endpoint=endpoint,
        model=body.model,
        input=job_input,
        input_format=InputFormat.JSONL,
        model_config=model_config,
        output_uri=output_uri,
        labels=labels,
        priority=weight,
        priority_name=body.priority,
        data_parallelism=body.data_parallelism,
        resources={"gpu_type": body.gpu_type} if body.gpu_type else {},
        max_runtime_sec=body.max_runtime_sec or settings.default_max_runtime_sec,
        id=body.id,
    )
    try:
        job = submit(store, caller.name, request, trigger)
    except DuplicateId:  # a concurrent create of the same id won
        existing = body.id and _reattach(store, caller, body.id)
        if not existing:
            raise
        return JobOut.of(existing)
    return JobOut.of(job)


def _label_pairs(labels: list[str]) -> dict[str, str]:
    pairs = {}
    for index, item in enumerate(labels):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ApiError(400, f"label[{index}] {item!r} is not key=value", param="label", code="invalid_label")
        pairs[key] = value
    return pairs


@router.get("", response_model=JobList, summary="List jobs, newest first")
def list_jobs(
    caller: CallerDep,
    store: StoreDep,
    status: Annotated[list[StatusWord] | None, Query(description="Only jobs in one of these statuses")] = None,
    model: Annotated[str | None, Query(max_length=256, description="Only jobs of this model")] = None,
    label: Annotated[
        list[str] | None, Query(max_length=64, description="Only jobs with this label, `key=value`; repeat for all of several")
    ] = None,
    owner: Annotated[
        str | None, Query(max_length=256, description="Admins: only this owner's jobs (others always see only their own)")
    ] = None,
    after: Annotated[
        str | None, Query(max_length=128, pattern=JOB_ID_PATTERN, description="The `next_cursor` of the previous page")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE_SIZE, description="Jobs per page, 1-1000")] = 100,
) -> JobList:
    wanted = _label_pairs(label or [])
    if caller.is_admin:
        owner_filter = owner
    else:
        owner_filter = caller.name
        if owner is not None and owner != caller.name:
            return JobList(data=[], next_cursor=None, has_more=False)
    found: list[Job] = []
    cursor, batch = after, min(MAX_PAGE_SIZE, max(limit + 1, 100))
    while len(found) <= limit:
        try:
            page, _ = store.list_jobs(owner=owner_filter, statuses=status, model=model, limit=batch, after=cursor)
        except InvalidCursor as exc:
            raise ApiError(400, str(exc), param="after", code="invalid_cursor") from None
        found += [j for j in page if all(k in j.labels and str(j.labels[k]) == v for k, v in wanted.items())]
        if len(page) < batch:
            break
        cursor = page[-1].id
    has_more = len(found) > limit
    data = found[:limit]
    return JobList(data=[JobOut.of(j) for j in data], next_cursor=data[-1].id if has_more else None, has_more=has_more)


@router.get("/{job_id}", response_model=JobOut, summary="Get a job")
def get_job(job_id: str, caller: CallerDep, store: StoreDep) -> JobOut:
    job = store.get_job(job_id, owner=caller.owner_filter)
    if job is None:
        raise not_found(_KIND, job_id)
    return JobOut.of(job)


@router.post("/{job_id}/cancel", response_model=JobOut, summary="Cancel a job (idempotent; an ended job is answered as it is)")
def cancel(job_id: str, caller: CallerDep, store: StoreDep, settings: SettingsDep) -> JobOut:
    caller.require_submit()
    return JobOut.of(cancel_job(store, settings, job_id, caller.owner_filter, kind=_KIND))
