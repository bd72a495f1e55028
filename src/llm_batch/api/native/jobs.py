"""Native jobs: ``/v1/jobs`` in the canonical words, the batch step's and the CLI's route;
every job is readable here. A create with an ``id`` already yours answers that job, so a
retried Airflow task re-attaches. A retry or rerun asks for what its ended job asked for (but
its ``output_uri``, which holds the original's results); ``/results`` streams a running job's
finished lines, the very lines its output and error files will hold (docs/api.md).
"""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime
from itertools import chain
from typing import Annotated, Any, Literal

import orjson
from airflow.api_fastapi.common.db.common import SessionDep
from fastapi import APIRouter, Body, Query
from fastapi.responses import StreamingResponse

from llm_batch.api.auth import Caller, CallerDep
from llm_batch.api.cancellation import CancellingDep, owned_job
from llm_batch.api.errors import ApiError
from llm_batch.api.idempotency import IdempotentRoute
from llm_batch.api.native.models import JOB_ID_PATTERN, CreateJob, EstimateOut, JobList, JobOut, QueueOut
from llm_batch.api.run_queue import QueuePlace, job_places
from llm_batch.api.state import MAX_PAGE_SIZE, SettingsDep, StoreDep
from llm_batch.api.submission import (
    Submitting,
    SubmittingDep,
    inline_items,
    save_inline_requests,
    stored_inline,
    submit,
)
from llm_batch.core.config import Settings
from llm_batch.core.input_formats import InputFormat
from llm_batch.core.job_request import DerivedFrom, JobRequest
from llm_batch.core.job_spec import JobInput, JobOptions, JobSpec
from llm_batch.core.jobs import JobRejected, JobStatus
from llm_batch.core.placement import priority_name
from llm_batch.infra.jobstore import DuplicateId, Job, JobRepository, JobStore
from llm_batch.infra.jobstore.jobs import MAX_SEARCH_LENGTH
from llm_batch.infra.storage import StorageError
from llm_batch.pipeline.admission import admit, check_model, check_owner_limits, one_input
from llm_batch.pipeline.estimate import estimate_input
from llm_batch.pipeline.merge import PartialOrder, partial_entries
from llm_batch.pipeline.rerun import CannotDerive, rerun_input, retry_lines, retry_plan
from llm_batch.pipeline.steps import input_source, job_model_choice, layout_of
from llm_batch.pipeline.validation import BatchRejected

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], route_class=IdempotentRoute)

_KIND = "job"
NDJSON = "application/x-ndjson"
# The canonical status words, as a list filter takes them (a Literal: no separate enum schema).
StatusWord = Literal[tuple(s.value for s in JobStatus)]


def _reattach(store: JobRepository, caller: Caller, job_id: str) -> Job | None:
    """The caller's job of that id (re-attach), None if the id is free; 409 if it is another owner's."""
    existing = store.get_job(job_id)
    if existing is None:
        return None
    if existing.owner != caller.name:
        raise ApiError(409, f"id {job_id!r} is taken: choose another id", param="id", code="id_taken")
    return existing


@router.post("", response_model=JobOut | EstimateOut,
             summary="Create a job (with `id`: idempotent, re-attaches to yours; with `dry_run`: only its estimate)")
def create_job(body: Annotated[CreateJob, Body()], submitting: SubmittingDep) -> JobOut | EstimateOut:
    caller, store, settings, trigger = submitting
    caller.require_submit()
    existing = _reattach(store, caller, body.id) if body.id is not None else None
    if existing is not None and not body.dry_run:
        return JobOut.of(existing)
    param = one_input({"requests": body.requests, "input_file_ids": body.input_file_ids, "input_uri": body.input_uri})
    given = JobInput(uri=body.input_uri, file_ids=body.input_file_ids,
                     requests=inline_items(body.requests) if body.requests else None)
    request = admit(body.part(JobSpec), given, caller, store, settings, job_id=body.id)
    if body.dry_run:
        return _dry_run(store, settings, caller, request, param)
    # Every check is done: only now is anything written.
    if body.requests:
        request = stored_inline(store, settings, caller.name, request)
    elif body.input_uri is not None:
        request = dataclasses.replace(request, input=request.input.model_copy(update={"path": body.input_uri}))
    try:
        job = submit(store, caller.name, request, trigger)
    except DuplicateId:  # a concurrent create of the same id won
        existing = body.id and _reattach(store, caller, body.id)
        if not existing:
            raise
        return JobOut.of(existing)
    return JobOut.of(job)


def _dry_run(store: JobStore, settings: Settings, caller: Caller, request: JobRequest, param: str) -> EstimateOut:
    """The estimate of the job `request` would create, made on a job that is never stored."""
    now = datetime.now(UTC)
    job = Job(id="dry-run", dialect=request.dialect, endpoint=request.endpoint, model=request.model,
              owner=caller.name, status=JobStatus.QUEUED, created_at=now, updated_at=now,
              model_config=request.model_config, input=request.input, input_format=request.input_format,
              priority=request.priority, data_parallelism=request.data_parallelism, resources=request.resources)
    try:
        source, fmt = input_source(store, job)
        estimate = estimate_input(store, settings, job, source=source, fmt=fmt,
                                  models=job_model_choice(store, job, settings), now=now)
    except (BatchRejected, JobRejected, StorageError) as exc:  # what would fail the job at its prepare step
        raise ApiError(400, f"the job's input would be rejected: {exc}", param=param, code="input_rejected") from None
    return EstimateOut(**estimate.model_dump())


def label_pairs(labels: list[str]) -> dict[str, str]:
    """The ``label`` filter's ``key=value`` items as a dict; 400 naming a malformed one."""
    pairs = {}
    for index, item in enumerate(labels):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ApiError(400, f"label[{index}] {item!r} is not key=value", param="label", code="invalid_label")
        pairs[key] = value
    return pairs


def labelled_jobs(store: JobRepository, wanted: dict[str, str], *, limit: int, after: str | None, batch: int,
                  **filters: Any) -> tuple[list[Job], bool, int]:
    """Up to `limit` jobs matching `filters` and every `wanted` label (matched page by page),
    whether more follow, and how many match `filters`."""
    found: list[Job] = []
    cursor, matching = after, 0
    while len(found) <= limit:
        page, matching = store.list_jobs(limit=batch, after=cursor, **filters)
        found += [j for j in page if all(k in j.labels and str(j.labels[k]) == v for k, v in wanted.items())]
        if len(page) < batch:
            break
        cursor = page[-1].id
    return found[:limit], len(found) > limit, matching


@router.get("", response_model=JobList, summary="List jobs, newest first")
def list_jobs(
    caller: CallerDep,
    store: StoreDep,
    session: SessionDep,
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
    q: Annotated[
        str | None, Query(min_length=1, max_length=MAX_SEARCH_LENGTH, pattern=r"^[^\x00-\x1f\x7f]+$",
                          description="Search, 1-200 printable characters taken literally, any case: a job id "
                          "(prefix), an uploaded input file's name or the input path, a label's key or value")
    ] = None,
    derived_from: Annotated[
        str | None, Query(max_length=128, pattern=JOB_ID_PATTERN,
                          description="Only the jobs made from this job (its retries and reruns)")
    ] = None,
) -> JobList:
    wanted = label_pairs(label or [])
    if not caller.is_admin and owner not in (None, caller.name):
        return JobList(data=[], next_cursor=None, has_more=False)
    data, has_more, _ = labelled_jobs(
        store, wanted, limit=limit, after=after, batch=min(MAX_PAGE_SIZE, max(limit + 1, 100)),
        owner=owner if caller.is_admin else caller.name, statuses=status, model=model, search=q,
        derived_from=derived_from)
    places = job_places(data, session)
    return JobList(data=[JobOut.of(j, _queue_out(places.get(j.id))) for j in data],
                   next_cursor=data[-1].id if has_more else None, has_more=has_more)


def _queue_out(place: QueuePlace | None) -> QueueOut | None:
    return QueueOut(**dataclasses.asdict(place)) if place else None


@router.get("/{job_id}", response_model=JobOut, summary="Get a job")
def get_job(job_id: str, caller: CallerDep, store: StoreDep, session: SessionDep) -> JobOut:
    job = owned_job(store, job_id, caller.owner_filter, _KIND)
    return JobOut.of(job, _queue_out(job_places([job], session).get(job.id)))


def derive_job(submitting: Submitting, job_id: str, kind: str) -> Job:
    """Create and start the `kind` (retry | rerun) of the caller's ended job `job_id`."""
    caller, store, settings, trigger = submitting
    caller.require_submit()
    source = owned_job(store, job_id, caller.owner_filter, _KIND)
    # What create checks, again: the model may have been removed or not be ready any more.
    check_model(source.model, source.model_config, settings, param="model", endpoint=source.endpoint,
                principal=caller, store=store, owner=source.owner)
    check_owner_limits(store, settings, caller, new_jobs=1)
    try:
        if kind == "retry":
            lines = retry_lines(store, source, retry_plan(store, source))
            if (first := next(lines, None)) is None:
                raise CannotDerive("nothing_to_retry", f"the input of job {source.id!r} no longer holds the lines "
                                   "that failed (it was changed since)")
            job_input = save_inline_requests(store, settings, source.owner, chain([first], lines),
                                             f"retry-of-{source.id}.jsonl", **dict(source.input.part(JobOptions)))
            input_format = InputFormat.JSONL.value
        else:
            job_input = rerun_input(store, source)
            input_format = source.input_format or InputFormat.JSONL.value
    except CannotDerive as exc:
        raise ApiError(409, str(exc), param="job_id", code=exc.code) from None
    request = JobRequest(
        dialect=source.dialect,
        endpoint=source.endpoint,
        model=source.model,
        input=job_input,
        input_format=input_format,
        model_config=dict(source.model_config),
        labels=dict(source.labels),
        metadata=dict(source.metadata),
        priority=source.priority,
        priority_name=priority_name(settings, source.priority),
        data_parallelism=source.data_parallelism,
        resources=dict(source.resources),
        max_runtime_sec=source.max_runtime_sec or settings.default_max_runtime_sec,
        derived_from=DerivedFrom(source.id, kind),
    )
    return submit(store, source.owner, request, trigger)


@router.post("/{job_id}/retry", response_model=JobOut,
             summary="Retry an ended job's failed and never-run lines as a new job (409 when there are none)")
def retry(job_id: str, submitting: SubmittingDep) -> JobOut:
    return JobOut.of(derive_job(submitting, job_id, "retry"))


@router.post("/{job_id}/rerun", response_model=JobOut, summary="Run an ended job's whole input again as a new job")
def rerun(job_id: str, submitting: SubmittingDep) -> JobOut:
    return JobOut.of(derive_job(submitting, job_id, "rerun"))


@router.post("/{job_id}/cancel", response_model=JobOut, summary="Cancel a job (idempotent; an ended job is answered as it is)")
def cancel(job_id: str, cancelling: CancellingDep) -> JobOut:
    return JobOut.of(cancelling(job_id, kind=_KIND))


@router.get("/{job_id}/results", response_class=StreamingResponse,
            responses={200: {"content": {NDJSON: {}}, "description": "One finished line per line, in input order"}},
            summary="Read a job's finished lines, while it runs or after (NDJSON)")
def get_results(
    job_id: str, caller: CallerDep, store: StoreDep, settings: SettingsDep,
    order: Annotated[PartialOrder, Query(
        description="`input`: input order up to the first line not finished yet; `finished`: every finished "
        "line, in input order, lines not finished yet left out")] = PartialOrder.INPUT,
    start: Annotated[int, Query(
        ge=0, le=10**9, description="Leave out the lines before this input index (a poller of `input` order "
        "passes the number of lines it already has)")] = 0,
) -> StreamingResponse:
    job = owned_job(store, job_id, caller.owner_filter, _KIND)
    entries = partial_entries(layout_of(settings, job.id), order, start)
    # The first entry is read here: storage failing is an error response, not a stream cut after its headers.
    first = next(entries, None)
    lines = (orjson.dumps(entry) + b"\n" for entry in chain([first] if first else [], entries))
    return StreamingResponse(lines, media_type=NDJSON, headers={
        "X-Job-Status": job.status.value, "X-Results-Complete": "true" if job.terminal else "false"})
