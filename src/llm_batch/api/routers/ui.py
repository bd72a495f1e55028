"""The "Batch jobs" page of Airflow's UI (an ``external_views`` entry, docs/ui.md) and the JSON
routes it reads with the Airflow user's session cookie. Writes never ride on the cookie
(auth.py): ``GET /ui/api/session`` hands the page a short-lived JWT of the same user."""

from __future__ import annotations

import dataclasses
from datetime import datetime
from itertools import islice
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import quote

import orjson
from airflow.api_fastapi.common.db.common import SessionDep
from fastapi import APIRouter, Query, Request
from fastapi.responses import HTMLResponse
from fastapi.security import HTTPAuthorizationCredentials

from llm_batch.api.auth import Caller, CallerDep, auth_manager
from llm_batch.api.cancellation import CancellingDep, owned_job
from llm_batch.api.native.jobs import label_pairs, labelled_jobs
from llm_batch.api.run_queue import QueuePlace, job_places
from llm_batch.api.state import DAG_ID, MAX_PAGE_SIZE, SettingsDep, StoreDep
from llm_batch.core.config import Settings
from llm_batch.core.jobs import JobStatus
from llm_batch.core.run_conf import SHARD_TASK_ID
from llm_batch.infra import storage
from llm_batch.infra.jobstore import FileRepository, Job
from llm_batch.infra.jobstore.jobs import MAX_SEARCH_LENGTH
from llm_batch.pipeline.merge import PartialOrder, partial_entries
from llm_batch.pipeline.steps import layout_of

STATIC_DIR = Path(__file__).resolve().parent.parent / "ui" / "static"
ERROR_LINES = 20  # first lines of the error file shown on the detail
PREVIEW_LINES = 5  # and of the output file
PARTIAL_SCAN = 2_000  # finished lines a running job's detail reads at most for its previews
SESSION_TOKEN_SECONDS = 15 * 60
_ENDED_AT = ("completed_at", "failed_at", "cancelled_at", "expired_at")
ERROR_LINE_CHARS = 2000  # of an error line kept (a message longer than this is cut)
RESULT_LINE_CHARS = 256 * 1024  # of a result line read (a longer one is shown as its text)
EXCERPT_CHARS = 300  # of an answer shown

router = APIRouter(prefix="/ui", tags=["ui"], include_in_schema=False)


@router.get("/jobs", response_class=HTMLResponse)
def page() -> HTMLResponse:
    """The page's shell: its data comes from the JSON routes, with the caller's rights."""
    return HTMLResponse((STATIC_DIR / "jobs.html").read_text(), headers={"Cache-Control": "no-store"})


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def _may_write(caller: Caller, job: Job) -> bool:
    return caller.can_submit and (caller.is_admin or job.owner == caller.name)


def _summary(caller: Caller, job: Job, place: QueuePlace | None = None) -> dict[str, Any]:
    ended = [getattr(job, name) for name in _ENDED_AT if getattr(job, name) is not None]
    # tokens_per_s: output tokens per engine second (steps.engine_rate), engine start and queue left out.
    shown = ("dialect", "model", "endpoint", "owner", "labels", "total", "completed", "succeeded", "failed",
             "tokens_per_s")
    return {
        "id": job.id,
        "status": job.status.value,
        **{name: getattr(job, name) for name in shown},
        "created_at": _iso(job.created_at),
        "ended_at": _iso(max(ended)) if ended and job.terminal else None,
        "can_cancel": _may_write(caller, job) and not job.terminal and not job.cancel_requested,
        "queue": dataclasses.asdict(place) if place and not job.terminal else None,
    }


@router.get("/api/session")
async def session(request: Request, caller: CallerDep) -> dict[str, Any]:
    """Who the page acts for, and the header token its writes carry (an API key is one already)."""
    token = None
    if caller.via == "airflow":
        from airflow.api_fastapi.core_api.security import get_user  # airflow

        scheme, _, value = request.headers.get("authorization", "").strip().partition(" ")
        bearer = HTTPAuthorizationCredentials(scheme=scheme, credentials=value.strip()) if scheme.lower() == "bearer" else None
        user = await get_user(request, None, bearer)
        token = auth_manager(request.app).generate_jwt(user, expiration_time_in_seconds=SESSION_TOKEN_SECONDS)
    return {"user": caller.name, "is_admin": caller.is_admin, "can_submit": caller.can_submit, "token": token,
            "dag_id": DAG_ID, "statuses": [s.value for s in JobStatus]}


@router.get("/api/jobs")
def list_jobs(
    caller: CallerDep, store: StoreDep, session: SessionDep,
    status: Annotated[list[JobStatus] | None, Query()] = None,
    owner: Annotated[str | None, Query(max_length=256)] = None,
    model: Annotated[str | None, Query(max_length=256)] = None,
    label: Annotated[list[str] | None, Query(max_length=640)] = None,
    after: Annotated[str | None, Query(max_length=128)] = None,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
    q: Annotated[str | None, Query(max_length=MAX_SEARCH_LENGTH, pattern=r"^[^\x00-\x1f\x7f]*$")] = None,
) -> dict[str, Any]:
    """One page of jobs, newest first, after the previous page's ``next_after``; ``total`` counts every
    match (null with a label filter: labels are matched page by page)."""
    wanted = label_pairs(label or [])
    if not caller.is_admin and owner not in (None, "", caller.name):
        return {"jobs": [], "total": 0, "next_after": None}
    shown, has_more, matching = labelled_jobs(
        store, wanted, limit=limit, after=after, batch=MAX_PAGE_SIZE if wanted else limit + 1,
        owner=(owner if caller.is_admin else caller.name) or None, statuses=status, model=model or None,
        search=q or None)
    places = job_places(shown, session)
    return {"jobs": [_summary(caller, j, places.get(j.id)) for j in shown], "total": None if wanted else matching,
            "next_after": shown[-1].id if has_more else None}


def _shard(record: Any) -> dict[str, Any]:
    rate = record.completion_tokens / record.engine_seconds if record.engine_seconds > 0 else 0.0
    return {"shard": record.shard, "state": record.state, "total": record.total, "done": record.done,
            "succeeded": record.succeeded, "failed": record.failed, "tokens_per_s": round(rate, 1),
            "reason": record.reason, "updated_at": _iso(record.updated_at)}


def _links(job: Job) -> dict[str, str] | None:
    if not job.dag_run_id:
        return None
    # Airflow 3.3's UI routes: the shard task's mapped instances, with their tries and logs.
    run = f"/dags/{quote(DAG_ID)}/runs/{quote(job.dag_run_id, safe='')}"
    return {"run": run, "logs": f"{run}/tasks/{SHARD_TASK_ID}/mapped"}


def _finished_so_far(settings: Settings, job: Job) -> dict[str, Any]:
    """A job without output files yet: its first finished lines (at most PARTIAL_SCAN read: cheap)."""
    preview: list[dict[str, Any]] = []
    errors: list[dict[str, Any]] = []
    for entry in islice(partial_entries(layout_of(settings, job.id), PartialOrder.FINISHED), PARTIAL_SCAN):
        if "output" in entry and len(preview) < PREVIEW_LINES:
            preview.append(result_row(orjson.dumps(entry["output"]).decode()))
        elif "error" in entry and len(errors) < ERROR_LINES:
            errors.append(error_row(orjson.dumps(entry["error"]).decode()))
        if len(preview) >= PREVIEW_LINES and len(errors) >= ERROR_LINES:
            break
    return {"preview": preview, "error_lines": errors, "preview_partial": True}


def first_lines(store: FileRepository, file_id: str | None, limit: int, chars: int = ERROR_LINE_CHARS) -> list[str]:
    """The first `limit` lines of a stored file, each cut at `chars`; [] without one."""
    file = store.get_file(file_id) if file_id else None
    if file is None or file.deleted:
        return []
    lines: list[str] = []
    try:
        with storage.open_read(file.uri) as stream:
            for raw in stream:
                lines.append(raw.decode("utf-8", "replace").rstrip("\r\n")[:chars])
                if len(lines) >= limit:
                    break
    except storage.StorageError as exc:
        return [f"(the file could not be read: {exc})"]
    return lines


def _record(raw: str) -> dict[str, Any] | None:
    try:
        record = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    return record if isinstance(record, dict) else None


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _text(value: Any) -> str | None:
    return None if value is None else str(value)


def error_row(raw: str) -> dict[str, Any]:
    """One error line: line, custom_id, code, message (each dialect has them in its own place)."""
    record = _record(raw)
    if record is None:
        return {"line": None, "custom_id": None, "code": None, "message": raw}
    body = _dict(_dict(record.get("response")).get("body"))
    error = next((e for e in (record.get("error"), body.get("error")) if isinstance(e, dict)), {})
    return {"line": record.get("line") if isinstance(record.get("line"), int) else None,
            "custom_id": _text(record.get("custom_id")), "code": _text(error.get("code")),
            "message": _text(error.get("message")) or raw}


def _answer(body: dict[str, Any]) -> str:
    """What a result says in short: a chat message or text, an embedding's size, else the body."""
    choices = body.get("choices") if isinstance(body.get("choices"), list) else []
    first = _dict(choices[0]) if choices else {}
    data = body.get("data") if isinstance(body.get("data"), list) else []
    if isinstance(_dict(first.get("message")).get("content"), str):
        text = first["message"]["content"]
    elif isinstance(first.get("text"), str):
        text = first["text"]
    elif isinstance(embedding := _dict(data[0]).get("embedding") if data else None, list):
        text = f"embedding of {len(embedding)} numbers"
    else:
        text = orjson.dumps(body).decode()
    # One line: whitespace runs as one space, other invisible characters as U+FFFD (so they do not look like none).
    text = "".join(ch if ch.isprintable() else "\ufffd" for ch in " ".join(text.split()))
    if not text:
        return "(empty)"
    return text if len(text) <= EXCERPT_CHARS else text[: EXCERPT_CHARS - 1] + "…"


def result_row(raw: str) -> dict[str, Any]:
    """One output line: custom_id and the answer in short."""
    record = _record(raw)
    if record is None:
        return {"custom_id": None, "answer": raw[:EXCERPT_CHARS]}
    body = _dict(_dict(record.get("response")).get("body"))
    return {"custom_id": _text(record.get("custom_id")), "answer": _answer(body) if body else raw[:EXCERPT_CHARS]}


@router.get("/api/jobs/{job_id}")
def job_detail(job_id: str, caller: CallerDep, store: StoreDep, settings: SettingsDep,
               session: SessionDep) -> dict[str, Any]:
    job = owned_job(store, job_id, caller.owner_filter, "job")
    # The job as it is now ends the series (a last point even between two history points).
    history = [*((p.at, p) for p in store.progress_history(job.id)), (job.updated_at, job)]
    return {
        **_summary(caller, job, job_places([job], session).get(job.id)),
        "status_reason": job.status_reason,
        "derived_from": {"job_id": job.derived_from.job_id, "kind": job.derived_from.kind} if job.derived_from else None,
        # POST /v1/jobs/{id}/retry|rerun with the session's token.
        "can_retry": _may_write(caller, job) and job.terminal and job.failed > 0,
        "can_rerun": _may_write(caller, job) and job.terminal,
        "errors": job.errors,
        # What the job was expected to take (pipeline/estimate.py, kept at validation) beside what it took.
        "estimate": job.estimate,
        "usage": {"prompt_tokens": job.prompt_tokens, "completion_tokens": job.completion_tokens,
                  "engine_seconds": job.engine_seconds},
        "output_file_id": job.output_file_id,
        "error_file_id": job.error_file_id,
        "dag_run_id": job.dag_run_id,
        "cached": job.result_cache_hits,
        "cached_tokens": job.result_cache_tokens,
        "invalid_output": job.invalid_output,
        "output_retries": job.output_retries,
        "links": _links(job),
        "shards": [_shard(r) for r in store.shard_records(job.id)],
        "history": [{"at": _iso(at), "total": p.total, "completed": p.completed, "succeeded": p.succeeded,
                     "failed": p.failed, "tokens_per_s": p.tokens_per_s} for at, p in history],
        **(_finished_so_far(settings, job) if job.output_file_id is None and job.error_file_id is None else {
            "error_lines": [error_row(line) for line in first_lines(store, job.error_file_id, ERROR_LINES)],
            "preview": [result_row(line) for line in first_lines(store, job.output_file_id, PREVIEW_LINES,
                                                                RESULT_LINE_CHARS)],
            "preview_partial": False,
        }),
    }


@router.post("/api/jobs/{job_id}/cancel")
def cancel(job_id: str, cancelling: CancellingDep) -> dict[str, Any]:
    """Cancel (owners and admins; with a header credential, as every write: auth.py)."""
    return _summary(cancelling.caller, cancelling(job_id, kind="job"))
