"""The submit use case: a dialect-neutral ``JobRequest`` (``llm_batch.core.job_request``) becomes a
job row and a DAG run.

Routers translate their dialect's body into a job's spec and input and pass the admission every
way in shares (``llm_batch.pipeline.admission.admit``, or its checks naming fields in the
dialect's words), which gives the ``JobRequest``; inline requests are then stored as a file
(``stored_inline``, ``save_inline_requests``); ``submit`` then
1. creates the QUEUED job in the store (owner = the caller),
2. triggers the ``batch_inference`` run through ``dag_trigger`` with ``dag_conf(job)``,
3. records the run id, or, if the trigger failed, marks the job FAILED with the reason,
so a job is never left queued without a run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Annotated, Any, NamedTuple

import orjson
from fastapi import Depends

from llm_batch.api.auth import Caller, CallerDep
from llm_batch.api.dag_trigger import Trigger, TriggerDep, TriggerError
from llm_batch.api.errors import ApiError
from llm_batch.api.idempotency import IdempotencyDep
from llm_batch.api.state import SettingsDep, StoreDep
from llm_batch.core.config import Settings
from llm_batch.core.formats import not_json
from llm_batch.core.job_input import JobInput
from llm_batch.core.job_request import JobRequest
from llm_batch.core.job_spec import JobOptions
from llm_batch.core.jobs import JobStatus
from llm_batch.core.layout import join_uri
from llm_batch.infra import storage
from llm_batch.infra.jobstore import Job, JobStore, new_file_id
from llm_batch.infra.log_context import bind_job


class Submitting(NamedTuple):
    """What a create route works with (``SubmittingDep``); depending on it also makes the
    route take an ``Idempotency-Key`` (on a router with ``route_class=IdempotentRoute``)."""

    caller: Caller
    store: JobStore
    settings: Settings
    trigger: Trigger


async def _submitting(caller: CallerDep, store: StoreDep, settings: SettingsDep, trigger: TriggerDep,
                      _idempotency: IdempotencyDep = None) -> Submitting:
    return Submitting(caller, store, settings, trigger)


SubmittingDep = Annotated[Submitting, Depends(_submitting)]


def inline_json(value: Any, param: str) -> bytes:
    """Inline content as JSON bytes, or 400 naming where it holds what JSON cannot carry:
    Python's JSON parser lets through lone surrogates, integers past 64 bits and NaN, which
    the pipeline's JSON (orjson) refuses, so they are caught here rather than as a 500."""
    problem = not_json(value, param)
    if problem is not None:
        code, message = problem
        raise ApiError(400, message, param=param, code=code.value)
    return orjson.dumps(value)


def inline_items(requests: Iterable[Any]) -> list[dict[str, Any]]:
    """Inline requests (items with ``custom_id`` and ``body``) as a job reads them; a missing
    custom_id is the item's 0-based position."""
    return [{"custom_id": str(i) if item.custom_id is None else item.custom_id, "body": item.body}
            for i, item in enumerate(requests)]


def stored_inline(store: JobStore, settings: Settings, owner: str, request: JobRequest) -> JobRequest:
    """An admitted request whose input is inline requests, reading them from a file instead."""
    lines = (inline_json(item, f"requests[{i}]") + b"\n" for i, item in enumerate(request.input.requests or []))
    saved = save_inline_requests(store, settings, owner, lines, "inline-requests.jsonl",
                                 **dict(request.input.part(JobOptions)))
    return dataclasses.replace(request, input=saved)


def save_inline_requests(
    store: JobStore, settings: Settings, owner: str, lines: Iterable[bytes], filename: str, **input_fields: Any
) -> JobInput:
    """Write inline requests (already serialised, one per item) to the files area, record
    them as an input file object of `owner`, and return the job's input reading it."""
    file_id = new_file_id()
    uri = join_uri(settings.files_uri, file_id)
    written = 0
    with storage.open_write(uri) as out:
        for line in lines:
            out.write(line)
            written += len(line)
    store.create_file(id=file_id, owner=owner, purpose="batch", filename=filename, bytes=written, uri=uri, kind="input")
    return JobInput(uri=uri, inline=True, inline_file_id=file_id, **input_fields)


def dag_conf(job: Job, request: JobRequest) -> dict[str, Any]:
    """The run's conf: the job id (the pipeline takes the job from the store) plus what its
    lane is chosen by and what the run does, as ids and counts under the DAG's Param names.
    Every Airflow viewer reads a run's conf: paths, labels and model configs stay in the store."""
    conf: dict[str, Any] = {
        "job_id": job.id,
        "input_file_ids": job.input.file_ids,
        "input_format": job.input_format,
        "endpoint": job.endpoint,
        "model": job.model,
        "data_parallelism": job.data_parallelism,
        "max_runtime_sec": job.max_runtime_sec,
        "priority": request.priority_name,
        "gpus": job.resources.get("gpus"),
        "gpu_type": job.resources.get("gpu_type"),
        "nodes_per_worker": job.resources.get("nodes_per_worker"),
    }
    return {key: value for key, value in conf.items() if value is not None}


def submit(store: JobStore, owner: str, request: JobRequest, trigger: Trigger) -> Job:
    """Create the job and start its run; returns the job (FAILED, with the reason, if the
    run could not be started)."""
    job = store.create_requested_job(request, owner)
    bind_job(job.id)  # this request's log lines from here on carry it
    try:
        run_id = trigger(job.id, dag_conf(job, request), job.created_at)
    except TriggerError as exc:
        return store.transition(job.id, JobStatus.FAILED, reason=str(exc))
    # The run may already have moved the job on; only the run id is ours to set.
    return store.set_dag_run(job.id, run_id)
