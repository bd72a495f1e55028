"""Jobs: their records, status moves and counters (the ``jobs`` table).

Status moves are compare-and-set and counters SQL increments, so many workers and API
callers can update one job at once; a move calls ``_job_moved`` in its transaction.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import ColumnElement, Row, Text, cast, delete, func, or_, select, update

from llm_batch.core.endpoints import parse_endpoint
from llm_batch.core.job_request import DerivedFrom, JobRequest
from llm_batch.core.jobs import JobStatus, check_transition
from llm_batch.core.snapshots import DIALECTS, Job
from llm_batch.infra.jobstore.errors import ConcurrentUpdate, JobNotFound
from llm_batch.infra.jobstore.models import FILES, HISTORY, JOBS, SHARDS
from llm_batch.infra.jobstore.paging import check_page, given, matching, ordering, owned, page
from llm_batch.infra.jobstore.repository import (
    CAS_ATTEMPTS,
    ENDED_STATUSES,
    Repository,
    job_snapshot,
    require_aware,
    require_non_negative,
    utcnow,
)

# The timestamps a status sets when entered (only if unset: a repeated step never moves them).
_STATUS_TIMESTAMPS: dict[JobStatus, tuple[str, ...]] = {
    JobStatus.QUEUED: (),
    JobStatus.VALIDATING: ("started_at",),
    JobStatus.RUNNING: ("started_at", "in_progress_at"),
    JobStatus.FINALIZING: ("finalizing_at",),
    JobStatus.CANCELLING: ("cancel_requested_at", "cancelling_at"),
    JobStatus.SUCCEEDED: ("completed_at",),
    JobStatus.FAILED: ("failed_at", "completed_at"),
    JobStatus.TIMEOUT_EXCEEDED: ("expired_at", "completed_at"),
    JobStatus.CANCELLED: ("cancelled_at", "completed_at"),
}
_JOB_ORDER_COLUMNS = {"created_at", "updated_at", "priority"}


MAX_SEARCH_LENGTH = 200


def search_filter(text: str) -> ColumnElement[bool]:
    """Jobs whose id starts with `text`, or whose input file's name, input path or labels
    contain it (ignoring case, taken literally)."""
    if not 1 <= len(text) <= MAX_SEARCH_LENGTH:
        raise ValueError(f"search must be 1-{MAX_SEARCH_LENGTH} characters, got {len(text)}")
    needle = text.lower()
    c = JOBS.c
    named_file = (
        select(FILES.c.id)
        .where(FILES.c.owner == c.owner, FILES.c.kind == "input",
               func.lower(FILES.c.filename).contains(needle, autoescape=True),
               cast(c.input, Text).contains(FILES.c.id))
        .exists()
    )
    return or_(
        func.lower(c.id).startswith(needle, autoescape=True),
        func.lower(c.input["path"].as_string()).contains(needle, autoescape=True),
        func.lower(cast(c.labels, Text)).contains(needle, autoescape=True),
        named_file,
    )


def _entering(row: Row, status: JobStatus, reason: str | None) -> dict[str, Any]:
    now = utcnow()
    values: dict[str, Any] = {"status": status.value}
    values.update({ts: now for ts in _STATUS_TIMESTAMPS[status] if getattr(row, ts) is None})
    if reason is not None:
        values["status_reason"] = reason
    return values


class JobRepository(Repository):
    def _compare_and_set(
        self, job_id: str, changes: Callable[[Row], dict[str, Any] | None], owner: str | None = None
    ) -> Job:
        """Apply ``changes(row)`` (None: nothing to do) if the status has not moved meanwhile, else retry."""
        for _ in range(CAS_ATTEMPTS):
            with self._transaction(write=True) as connection:
                row = connection.execute(select(JOBS).where(*owned(JOBS, job_id, owner))).one_or_none()
                if row is None:
                    raise JobNotFound(f"no job {job_id!r}")
                values = changes(row)
                if values is None:
                    return job_snapshot(row)
                updated = connection.execute(
                    update(JOBS)
                    .where(JOBS.c.id == job_id, JOBS.c.status == row.status)
                    .values(**values, updated_at=utcnow())
                    .returning(*JOBS.c)
                ).one_or_none()
                if updated is not None:
                    self._job_moved(connection, row, updated)
                    return job_snapshot(updated)
        raise ConcurrentUpdate(f"job {job_id!r}: status kept changing under {CAS_ATTEMPTS} attempts")

    def create_job(
        self,
        *,
        dialect: str,
        endpoint: str,
        model: str,
        owner: str,
        input: dict[str, Any] | None = None,
        input_format: str | None = None,
        model_config: dict[str, Any] | None = None,
        output_uri: str | None = None,
        array_output_uri: str | None = None,
        metadata: dict[str, Any] | None = None,
        labels: dict[str, Any] | None = None,
        priority: int = 0,
        data_parallelism: int = 1,
        resources: dict[str, Any] | None = None,
        max_runtime_sec: int | None = None,
        expires_at: datetime | None = None,
        dag_run_id: str | None = None,
        id: str | None = None,
        created_at: datetime | None = None,
        derived_from: DerivedFrom | None = None,
    ) -> Job:
        """Insert a QUEUED job (an id already taken: DuplicateId)."""
        if dialect not in DIALECTS:
            raise ValueError(f"dialect {dialect!r} is unknown; use one of {', '.join(DIALECTS)}")
        endpoint = parse_endpoint(endpoint).value
        if data_parallelism < 1:
            raise ValueError(f"data_parallelism must be >= 1, got {data_parallelism}")
        if max_runtime_sec is not None and max_runtime_sec < 1:
            raise ValueError(f"max_runtime_sec must be >= 1, got {max_runtime_sec}")
        require_aware(created_at=created_at, expires_at=expires_at)
        created_at = created_at or utcnow()
        if expires_at is None and max_runtime_sec is not None:
            expires_at = created_at + timedelta(seconds=max_runtime_sec)
        values = dict(
            id=id or f"job_{uuid.uuid4().hex}",
            dialect=dialect,
            endpoint=endpoint,
            model=model,
            owner=owner,
            input=input or {},
            input_format=input_format,
            model_config=model_config or {},
            output_uri=output_uri,
            array_output_uri=array_output_uri,
            metadata=metadata or {},
            labels=labels or {},
            priority=priority,
            data_parallelism=data_parallelism,
            resources=resources or {},
            max_runtime_sec=max_runtime_sec,
            expires_at=expires_at,
            dag_run_id=dag_run_id,
            derived_from_id=derived_from.job_id if derived_from else None,
            derived_kind=derived_from.kind if derived_from else None,
            status=JobStatus.QUEUED.value,
            created_at=created_at,
            updated_at=created_at,
        )  # the errors, counters and usage start at the columns' defaults (empty, 0)
        return job_snapshot(self._insert(JOBS, values, JOBS.c))

    def create_requested_job(self, request: JobRequest, owner: str, *, dag_run_id: str | None = None) -> Job:
        """The QUEUED job of a dialect-neutral request (``llm_batch.core.job_request``), owned by `owner`."""
        return self.create_job(
            id=request.id, dialect=request.dialect, endpoint=request.endpoint, model=request.model, owner=owner,
            input=request.input.stored(), input_format=request.input_format, model_config=request.model_config,
            array_output_uri=request.output_uri, metadata=request.metadata, labels=request.labels,
            priority=request.priority, data_parallelism=request.data_parallelism, resources=request.resources,
            max_runtime_sec=request.max_runtime_sec, dag_run_id=dag_run_id, derived_from=request.derived_from,
        )

    def get_job(self, job_id: str, owner: str | None = None) -> Job | None:
        """The job, or None if it does not exist or belongs to another owner."""
        return self._read_one(select(JOBS).where(*owned(JOBS, job_id, owner)), job_snapshot)

    def list_jobs(
        self,
        owner: str | None = None,
        statuses: Iterable[JobStatus | str] | None = None,
        model: str | None = None,
        metadata: Mapping[str, str] | None = None,
        created_after: datetime | None = None,
        dialect: str | None = None,
        expires_before: datetime | None = None,
        order_by: str = "-created_at",
        limit: int = 100,
        offset: int = 0,
        after: str | None = None,
        search: str | None = None,
        derived_from: str | None = None,
    ) -> tuple[list[Job], int]:
        """One page of jobs matching every given filter, and how many match in all (``after``:
        the previous page's last id, stable while new jobs arrive)."""
        check_page(limit, offset)
        require_aware(created_after=created_after, expires_before=expires_before)
        order = ordering(JOBS, order_by, _JOB_ORDER_COLUMNS)
        c = JOBS.c
        filters = matching(JOBS, owner=owner, model=model, dialect=dialect, derived_from_id=derived_from)
        if statuses is not None:
            filters.append(c.status.in_([JobStatus(s).value for s in statuses]))
        if created_after is not None:
            filters.append(c.created_at > created_after)
        if expires_before is not None:
            filters.append(c.expires_at < expires_before)
        for key, value in (metadata or {}).items():
            filters.append(c.metadata[key].as_string() == str(value))
        if search is not None:
            filters.append(search_filter(search))
        with self._transaction(write=False) as connection:
            rows, total = page(connection, JOBS, filters, order, limit, offset, after, owner=owner)
            return [job_snapshot(r) for r in rows], total

    def transition(self, job_id: str, new_status: JobStatus | str, reason: str | None = None) -> Job:
        """Move the job to `new_status` (its own status: a no-op, so a retried step is harmless)."""
        new = JobStatus(new_status)

        def changes(row: Row) -> dict[str, Any] | None:
            current = JobStatus(row.status)
            check_transition(current, new)
            if current == new:
                return None
            return _entering(row, new, reason)

        return self._compare_and_set(job_id, changes)

    def end_job(self, job_id: str, status: JobStatus | str, reason: str | None = None) -> Job:
        """End a live job in the terminal `status`; an ended job is returned as it ended."""
        final = JobStatus(status)
        if not final.terminal:
            raise ValueError(f"end_job needs a terminal status, got {final}")

        def changes(row: Row) -> dict[str, Any] | None:
            if JobStatus(row.status).terminal:
                return None
            return _entering(row, final, reason)

        return self._compare_and_set(job_id, changes)

    def request_cancel(self, job_id: str, owner: str | None = None, reason: str | None = None) -> Job:
        """Move a live job to CANCELLING, or a QUEUED one straight to CANCELLED: nothing of it has
        been read, so there is nothing to stop or account for, and its run, when it starts, finds
        it ended. One already cancelling or ended is left as it is."""

        def changes(row: Row) -> dict[str, Any] | None:
            current = JobStatus(row.status)
            if current.terminal or current == JobStatus.CANCELLING:
                return None
            if current == JobStatus.QUEUED:
                ended = _entering(row, JobStatus.CANCELLED, f"{reason or 'cancel requested'} before its input "
                                  "was read: no request was run")
                return ended | {"cancel_requested_at": ended["cancelled_at"], "cancelling_at": ended["cancelled_at"]}
            return _entering(row, JobStatus.CANCELLING, reason or "cancel requested")

        return self._compare_and_set(job_id, changes, owner)

    def set_counts(
        self,
        job_id: str,
        *,
        total: int | None = None,
        completed: int | None = None,
        succeeded: int | None = None,
        failed: int | None = None,
        invalid: int | None = None,
    ) -> Job:
        """Overwrite the given counters (None leaves one as it is)."""
        values = given(total=total, completed=completed, succeeded=succeeded, failed=failed, invalid=invalid)
        require_non_negative(values)
        return self._update_job(job_id, **values)

    def set_usage(
        self,
        job_id: str,
        *,
        prompt_tokens: int,
        completion_tokens: int,
        cached_prompt_tokens: int | None,
        reasoning_tokens: int,
        model_usage: dict[str, dict[str, int]] | None = None,
        result_cache_hits: int = 0,
        result_cache_tokens: int = 0,
        invalid_output: int = 0,
        output_retries: int = 0,
        retry_tokens: int = 0,
        tokens_per_s: float = 0.0,
    ) -> Job:
        """Overwrite the job's usage figures with the merge's exact sums (cached None: unknown)."""
        return self._update_job(job_id, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                                cached_prompt_tokens=cached_prompt_tokens, reasoning_tokens=reasoning_tokens,
                                model_usage=model_usage, result_cache_hits=result_cache_hits,
                                result_cache_tokens=result_cache_tokens, invalid_output=invalid_output,
                                output_retries=output_retries, retry_tokens=retry_tokens, tokens_per_s=tokens_per_s)

    def add_counts(
        self, job_id: str, *, total: int = 0, completed: int = 0, succeeded: int = 0, failed: int = 0
    ) -> Job:
        """Add to the counters in SQL: safe when many workers report at once."""
        deltas = dict(total=total, completed=completed, succeeded=succeeded, failed=failed)
        return self._update_job(job_id, **{name: JOBS.c[name] + delta for name, delta in deltas.items() if delta})

    def set_outputs(
        self,
        job_id: str,
        *,
        output_uri: str | None = None,
        array_output_uri: str | None = None,
        output_file_id: str | None = None,
        error_file_id: str | None = None,
        errors: list[dict[str, Any]] | None = None,
    ) -> Job:
        """Record where the results went and the error summary (None: unchanged)."""
        return self._update_job(job_id, **given(output_uri=output_uri, array_output_uri=array_output_uri,
                                                output_file_id=output_file_id, error_file_id=error_file_id,
                                                errors=errors))

    def set_priority(self, job_id: str, priority: int, owner: str | None = None) -> Job:
        return self._update_job(job_id, owner, priority=priority)

    def set_dag_run(self, job_id: str, dag_run_id: str) -> Job:
        return self._update_job(job_id, dag_run_id=dag_run_id)

    def delete_job(self, job_id: str, owner: str | None = None) -> None:
        """Remove an ended job's record (a live one: JobNotFound)."""
        with self._transaction(write=True) as connection:
            deleted = connection.execute(
                delete(JOBS).where(*owned(JOBS, job_id, owner), JOBS.c.status.in_(ENDED_STATUSES)))
            if deleted.rowcount != 1:
                raise JobNotFound(f"no ended job {job_id!r}")
            connection.execute(delete(SHARDS).where(SHARDS.c.job_id == job_id))
            connection.execute(delete(HISTORY).where(HISTORY.c.job_id == job_id))

    def jobs_writing(self, array_output_uri: str) -> list[Job]:
        """Every job (any owner, any status) whose results go to this user path."""
        return self._read_all(select(JOBS).where(JOBS.c.array_output_uri == array_output_uri), job_snapshot)
