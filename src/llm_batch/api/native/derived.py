"""Retry and rerun: a new job made from an ended one, asking for what it asked for (but its
``output_uri``, which holds the original's results)."""

from __future__ import annotations

from llm_batch.api.cancellation import owned_job
from llm_batch.api.errors import ApiError
from llm_batch.api.submission import Submitting, save_inline_requests, submit
from llm_batch.core.input_formats import InputFormat
from llm_batch.core.job_request import DerivedFrom, JobRequest
from llm_batch.core.job_spec import JobOptions
from llm_batch.infra.jobstore import Job
from llm_batch.pipeline.admission import check_model, check_owner_limits
from llm_batch.pipeline.rerun import CannotDerive, rerun_input, retry_lines, retry_plan


def _priority_name(weights: dict[str, int], weight: int) -> str | None:
    """The band of a stored weight (the run's conf shows the name)."""
    return next((name for name, w in weights.items() if w == weight and weight != 0), None)


def derive_job(submitting: Submitting, job_id: str, kind: str) -> Job:
    """Create and start the `kind` (retry | rerun) of the caller's ended job `job_id`."""
    caller, store, settings, trigger = submitting
    caller.require_submit()
    source = owned_job(store, job_id, caller.owner_filter, "job")
    # What create checks, again: the model may have been removed or not be ready any more.
    check_model(source.model, dict(source.model_config), settings, param="model", endpoint=source.endpoint,
                principal=caller, store=store, owner=source.owner)
    check_owner_limits(store, settings, caller, new_jobs=1)
    try:
        if kind == "retry":
            plan = retry_plan(store, source)
            options = dict(source.input.part(JobOptions))
            counted = _Counted(retry_lines(store, source, plan))
            job_input = save_inline_requests(store, settings, source.owner, counted, f"retry-of-{source.id}.jsonl",
                                             **options)
            if counted.lines == 0:
                store.mark_file_deleted(job_input.inline_file_id or "")
                raise CannotDerive("nothing_to_retry", f"the input of job {source.id!r} no longer holds the lines "
                                   "that failed (it was changed since)")
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
        priority_name=_priority_name(settings.priority_weights, source.priority),
        data_parallelism=source.data_parallelism,
        resources=dict(source.resources),
        max_runtime_sec=source.max_runtime_sec or settings.default_max_runtime_sec,
        derived_from=DerivedFrom(source.id, kind),
    )
    return submit(store, source.owner, request, trigger)


class _Counted:
    """An iterable of lines that counts what it handed out."""

    def __init__(self, lines):
        self._lines = lines
        self.lines = 0

    def __iter__(self):
        for line in self._lines:
            self.lines += 1
            yield line
