"""Retry and rerun: a new job made from an ended one, asking for what it asked for (but its
``output_uri``, which holds the original's results)."""

from __future__ import annotations

from itertools import chain

from llm_batch.api.cancellation import owned_job
from llm_batch.api.errors import ApiError
from llm_batch.api.submission import Submitting, save_inline_requests, submit
from llm_batch.core.input_formats import InputFormat
from llm_batch.core.job_request import DerivedFrom, JobRequest
from llm_batch.core.job_spec import JobOptions
from llm_batch.core.placement import priority_name
from llm_batch.infra.jobstore import Job
from llm_batch.pipeline.admission import check_model, check_owner_limits
from llm_batch.pipeline.rerun import CannotDerive, rerun_input, retry_lines, retry_plan


def derive_job(submitting: Submitting, job_id: str, kind: str) -> Job:
    """Create and start the `kind` (retry | rerun) of the caller's ended job `job_id`."""
    caller, store, settings, trigger = submitting
    caller.require_submit()
    source = owned_job(store, job_id, caller.owner_filter, "job")
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

