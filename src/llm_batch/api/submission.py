"""The submit use case: an admitted ``JobRequest`` becomes a job row and a DAG run (or a
FAILED job with the reason: never a queued job without a run).
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
from llm_batch.core.job_request import JobRequest
from llm_batch.core.job_spec import JobInput, JobOptions
from llm_batch.core.jobs import JobStatus
from llm_batch.core.layout import join_uri
from llm_batch.infra import storage
from llm_batch.infra.jobstore import FileRepository, Job, JobRepository, JobStore, new_file_id
from llm_batch.infra.log_context import bind_job


class Submitting(NamedTuple):
    """What a create route works with; depending on it makes the route take an ``Idempotency-Key``."""

    caller: Caller
    store: JobStore
    settings: Settings
    trigger: Trigger


async def _submitting(caller: CallerDep, store: StoreDep, settings: SettingsDep, trigger: TriggerDep,
                      _idempotency: IdempotencyDep = None) -> Submitting:
    return Submitting(caller, store, settings, trigger)


SubmittingDep = Annotated[Submitting, Depends(_submitting)]


def inline_json(value: Any, param: str) -> bytes:
    """Inline content as JSON bytes, or 400 naming what orjson would refuse (not a 500 later)."""
    problem = not_json(value, param)
    if problem is not None:
        code, message = problem
        raise ApiError(400, message, param=param, code=code.value)
    return orjson.dumps(value)


def inline_items(requests: Iterable[Any]) -> list[dict[str, Any]]:
    """Inline requests as a job reads them; a missing custom_id is the item's position."""
    return [{"custom_id": str(i) if item.custom_id is None else item.custom_id, "body": item.body}
            for i, item in enumerate(requests)]


def stored_inline(store: JobStore, settings: Settings, owner: str, request: JobRequest) -> JobRequest:
    """An admitted request whose input is inline requests, reading them from a file instead."""
    lines = (inline_json(item, f"requests[{i}]") + b"\n" for i, item in enumerate(request.input.requests or []))
    saved = save_inline_requests(store, settings, owner, lines, "inline-requests.jsonl",
                                 **dict(request.input.part(JobOptions)))
    return dataclasses.replace(request, input=saved)


def save_inline_requests(
    store: FileRepository, settings: Settings, owner: str, lines: Iterable[bytes], filename: str, **input_fields: Any
) -> JobInput:
    """Store serialised inline requests as an input file of `owner`; the job's input reading it."""
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
    """The run's conf: the job id and what its lane is chosen by, ids and counts only (every
    Airflow viewer reads a run's conf: paths, labels and model configs stay in the store)."""
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


def submit(store: JobRepository, owner: str, request: JobRequest, trigger: Trigger) -> Job:
    """Create the job and start its run (FAILED with the reason if it could not start)."""
    job = store.create_requested_job(request, owner)
    bind_job(job.id)  # this request's log lines from here on carry it
    try:
        run_id = trigger(job.id, dag_conf(job, request), job.created_at)
    except TriggerError as exc:
        return store.transition(job.id, JobStatus.FAILED, reason=str(exc))
    # The run may already have moved the job on; only the run id is ours to set.
    return store.set_dag_run(job.id, run_id)
