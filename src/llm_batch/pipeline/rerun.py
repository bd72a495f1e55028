"""What a retry or a rerun of an ended job reads: the new job's input.

A rerun reads the job's input again as it was given. A retry reads only the lines that did not
succeed and could (engine errors, lines never run), matched by custom_id: lines refused at
validation are not retried, as the same bytes would be refused again (docs/api.md, "Retry, run again")."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime

import orjson

from llm_batch.core.input_formats import InputFormat
from llm_batch.core.job_spec import JobInput
from llm_batch.infra import storage
from llm_batch.infra.jobstore import FileRepository, Job, JobStore
from llm_batch.infra.storage import iter_lines, stored_lines
from llm_batch.pipeline.merge import NOT_RUN_CODES


class CannotDerive(Exception):
    """The job cannot be retried or run again: ``code`` says why (the API's 409 code)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class RetryPlan:
    """The custom_ids to retry (None: every line, nothing ran) and how many were left out because
    validation refused them."""

    custom_ids: frozenset[str] | None
    refused_at_validation: int


def check_ended(job: Job) -> None:
    if not job.status.terminal:  # every end: a succeeded job may still have failed lines
        raise CannotDerive("not_ended", f"job {job.id!r} is {job.status.value}: only an ended job can be "
                           "retried or run again (cancel it first)")


def _input_file_uri(store: FileRepository, job: Job, file_id: str) -> str:
    found = store.get_file(file_id, owner=job.owner)
    now = datetime.now(UTC)
    if found is None or (found.expires_at is not None and found.expires_at <= now):
        raise CannotDerive("input_unavailable", f"the input file {file_id!r} of job {job.id!r} has expired or "
                           "been deleted: upload it again and submit a new job")
    return found.uri


def rerun_input(store: JobStore, job: Job) -> JobInput:
    """The job's input for a new job, once every file it names is still there."""
    check_ended(job)
    source = job.input
    for file_id in source.file_ids or ():
        _input_file_uri(store, job, file_id)
    if source.inline_file_id is not None:
        _input_file_uri(store, job, source.inline_file_id)
    if source.uri is not None and not source.file_ids and not storage.exists(source.uri):
        named = source.path or source.uri
        raise CannotDerive("input_unavailable", f"the input {named!r} of job {job.id!r} no longer exists")
    return source


def retry_plan(store: FileRepository, job: Job) -> RetryPlan:
    """Which lines of the ended `job` a retry runs; CannotDerive when none."""
    check_ended(job)
    if job.input_format not in (None, InputFormat.JSONL.value):
        raise CannotDerive("unsupported_input_format", f"job {job.id!r} read {job.input_format} input: only "
                           "JSONL lines can be retried one by one; run it again instead")
    if job.error_file_id is None:
        if job.output_file_id is None and job.succeeded == 0:
            return RetryPlan(None, 0)  # nothing ran: every line
        raise CannotDerive("nothing_to_retry", f"job {job.id!r} has no failed lines")
    error_file = store.get_file(job.error_file_id, owner=job.owner)
    if error_file is None:
        raise CannotDerive("input_unavailable", f"the error file {job.error_file_id!r} of job {job.id!r} has "
                           "expired or been deleted: which lines failed is no longer known")
    wanted: set[str] = set()
    refused = 0
    for line in stored_lines(error_file.uri):
        record = orjson.loads(line)
        code = (record.get("error") or {}).get("code")
        if record.get("response") is not None or code in NOT_RUN_CODES:
            if record.get("custom_id") is not None:
                wanted.add(record["custom_id"])
        else:
            refused += 1
    if not wanted:
        why = f" ({refused} refused at validation would be refused again)" if refused else ""
        raise CannotDerive("nothing_to_retry", f"job {job.id!r} has no failed or never-run lines to retry{why}")
    return RetryPlan(frozenset(wanted), refused)


def _input_streams(store: JobStore, job: Job) -> Iterator[bytes]:
    """Every line of the job's input, in order, as stored."""
    source = rerun_input(store, job)
    if source.requests is not None:  # a DAG run's inline requests
        for request in source.requests:
            yield orjson.dumps(request) + b"\n"
        return
    uris = [_input_file_uri(store, job, f) for f in source.file_ids] if source.file_ids else [source.uri]
    for uri in uris:
        if uri is None:
            continue
        with storage.open_read(uri) as stream:
            yield from iter_lines(stream)


def retry_lines(store: JobStore, job: Job, plan: RetryPlan) -> Iterator[bytes]:
    """The input lines `plan` selects, as they were (newline-terminated), in input order; each
    custom_id once (its first line)."""
    left = None if plan.custom_ids is None else set(plan.custom_ids)
    for line in _input_streams(store, job):
        if not line.strip():
            continue
        if not line.endswith(b"\n"):
            line += b"\n"
        if left is None:
            yield line
            continue
        try:
            custom_id = orjson.loads(line).get("custom_id")
        except (orjson.JSONDecodeError, AttributeError):
            continue  # refused at validation
        if custom_id in left:
            left.discard(custom_id)
            yield line
