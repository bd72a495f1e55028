"""Native jobs: ``/v1/jobs`` in the canonical words, the batch step's and the CLI's route;
every job is readable here. A create with an ``id`` already yours answers that job, so a
retried Airflow task re-attaches.
"""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from airflow.api_fastapi.common.db.common import SessionDep
from fastapi import APIRouter, Body, Query

from llm_batch.api.auth import Caller, CallerDep
from llm_batch.api.cancellation import CancellingDep, owned_job
from llm_batch.api.errors import ApiError
from llm_batch.api.idempotency import IdempotentRoute
from llm_batch.api.native.derived import derive_job
from llm_batch.api.native.models import JOB_ID_PATTERN, CreateJob, EstimateOut, JobList, JobOut, QueueOut
from llm_batch.api.run_queue import QueuePlace, job_places
from llm_batch.api.state import MAX_PAGE_SIZE, StoreDep
from llm_batch.api.submission import SubmittingDep, inline_items, stored_inline, submit
from llm_batch.core.config import Settings
from llm_batch.core.job_input import JobInput
from llm_batch.core.job_request import JobRequest
from llm_batch.core.job_spec import JobSpec
from llm_batch.core.jobs import JobRejected, JobStatus
from llm_batch.infra.jobstore import DuplicateId, Job, JobRepository, JobStore
from llm_batch.infra.jobstore.jobs import MAX_SEARCH_LENGTH
from llm_batch.infra.storage import StorageError
from llm_batch.pipeline.admission import admit, one_input
from llm_batch.pipeline.estimate import estimate_input
from llm_batch.pipeline.steps import input_source, job_model_choice
from llm_batch.pipeline.validation import BatchRejected

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], route_class=IdempotentRoute)

_KIND = "job"
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
