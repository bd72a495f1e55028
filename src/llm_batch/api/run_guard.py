"""A batch run is its job owner's in Airflow's ``/api/v2`` too (docs/api.md "Security model").

Airflow's auth managers are told the DAG, never the run, and listeners hear of a change after
it is made: so a root middleware refuses (403, Airflow's shape) a non-admin's write touching
another owner's batch run or an admin's DAG, and cuts other owners' batch confs and event
extras out of Airflow's answers. A new batch run that admission would refuse is refused here
(400, the reason as register words it), so the trigger form shows why and no run is made.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi.security.utils import get_authorization_scheme_param
from sqlalchemy import select
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llm_batch.api.app import read_body, replay
from llm_batch.api.auth import auth_manager, is_airflow_admin
from llm_batch.core.config import get_settings
from llm_batch.core.formats import not_json
from llm_batch.core.jobs import JobRejected
from llm_batch.core.run_conf import BATCH_DAG_ID, HOUSEKEEPING_DAG_ID, api_run_id, run_job_id
from llm_batch.infra.jobstore import get_job_store
from llm_batch.pipeline import admission, steps
from llm_batch.pipeline.recurring import DAG_ID_PREFIX as RECURRING_PREFIX

PREFIX = "/api/v2/"
WILDCARD = "~"  # Airflow's "any DAG" / "any run" in a path
_SAFE = frozenset({"GET", "HEAD", "OPTIONS"})
ADMINS_ONLY = "<admins>"  # the owner of the admin's DAGs' runs (no owner name has angle brackets)


@dataclass(frozen=True)
class Target:
    """A DAG's run a write touches; run_id None: runs it does not name (or the DAG itself)."""

    dag_id: str
    run_id: str | None


def is_product_dag(dag_id: str) -> bool:
    """The DAGs llm-batch ships, whose runs are jobs or the admin's schedules."""
    return dag_id in (BATCH_DAG_ID, HOUSEKEEPING_DAG_ID) or dag_id.startswith(RECURRING_PREFIX)


# -- which runs a request writes to -----------------------------------------------------------


def reads_body(parts: list[str]) -> bool:
    rest = parts[2:] if parts[:1] == ["dags"] else []
    return parts == ["backfills"] or rest in (["dagRuns"], ["clearTaskInstances"], ["clearDagRuns"], ["clearPartitions"]) or (
        len(rest) == 3 and rest[0] == "dagRuns" and rest[2] == "taskInstances")


def targets(method: str, parts: list[str], body: Any = None) -> list[Target]:
    """The runs a request to ``/api/v2/<parts>`` changes; `body` is its JSON (else it names none)."""
    if method in _SAFE:
        return []
    if parts == ["backfills"]:  # new runs of the body's DAG
        return [Target(_field(body, "dag_id") or WILDCARD, None)]
    if parts[:1] != ["dags"]:
        return []
    if len(parts) == 1:  # PATCH /dags: pause every DAG matching a pattern
        return [Target(WILDCARD, None)]
    dag, rest = parts[1], parts[2:]
    if rest in (["favorite"], ["unfavorite"]):  # the user's own list
        return []
    if rest == ["dagRuns"] and method == "POST":  # a new run: a batch run is its user's job
        return [Target(dag, None)] if is_product_dag(dag) and dag != BATCH_DAG_ID else []
    if rest == ["dagRuns"]:
        return _entities(body, dag, None, bare="run")
    if rest[:1] == ["dagRuns"] and len(rest) >= 2:
        run = rest[1]
        if method == "POST" and (rest[1:] == ["list"] or rest[2:] == ["taskInstances", "list"]):
            return []  # reads
        named = [_target(dag, run)]
        if rest[2:] == ["taskInstances"]:  # bulk: an entity may name another DAG's run
            named += _entities(body, dag, run, bare="task")
        return named
    if rest == ["clearTaskInstances"]:
        return [_target(dag, _field(body, "dag_run_id"))]
    if rest == ["clearDagRuns"]:
        runs = body.get("dag_runs") if isinstance(body, dict) else None
        if not runs or not isinstance(runs, list):  # by partition, or unreadable
            return [Target(dag, None)]
        return [_target(_field(r, "dag_id") or dag, _field(r, "dag_run_id")) for r in runs]
    if rest == ["clearPartitions"]:
        return [_target(dag, _field(body, "run_id"))]
    return [Target(dag, None)]  # the DAG itself, or what this guard does not know


def _entities(body: Any, dag: str, run: str | None, *, bare: str) -> list[Target]:
    """The runs a bulk body's entities name; a bare string is a run id (``bare="run"``) or a task."""
    actions = body.get("actions") if isinstance(body, dict) else None
    if not isinstance(actions, list):
        return [Target(dag, None)]
    named = []
    for action in actions:
        entities = action.get("entities") if isinstance(action, dict) else None
        for entity in entities if isinstance(entities, list) else [None]:
            if isinstance(entity, str):
                named.append(_target(dag, entity if bare == "run" else run))
            else:
                named.append(_target(_field(entity, "dag_id") or dag, _field(entity, "dag_run_id") or run))
    return named


def _field(value: Any, name: str) -> str | None:
    found = value.get(name) if isinstance(value, dict) else None
    return found if isinstance(found, str) and found else None


def _target(dag: str, run: str | None) -> Target:
    return Target(dag, None if not run or run == WILDCARD else run)


# -- whose they are -----------------------------------------------------------------------------


OwnerOf = Callable[[str, str], "str | None"]


def refusal(user: str, targets_: list[Target], owner_of: OwnerOf) -> str | None:
    """Why `user` (no admin) may not make a write touching `targets_`, else None."""
    for target in targets_:
        if target.dag_id != WILDCARD and not is_product_dag(target.dag_id):
            continue
        if target.dag_id == WILDCARD:
            return ("a change that names no DAG may touch llm-batch's DAGs, whose runs are their owners': "
                    "name each DAG and run")
        if target.run_id is None:
            return (f"{target.dag_id} is llm-batch's DAG: pausing or deleting it, starting a run of an admin's "
                    "DAG and changing runs without naming each are for admins")
        owner = owner_of(target.dag_id, target.run_id)
        if owner == ADMINS_ONLY:
            return f"run {target.run_id!r} of {target.dag_id} is the admin's schedule: only an admin may change it"
        if owner is not None and owner != user:
            return (f"run {target.run_id!r} of {target.dag_id} is another user's batch job: only its owner or an "
                    "admin may end, clear, annotate or delete it")
    return None


def owner_of_run(dag_id: str, run_id: str) -> str | None:
    """The owner of a product DAG's run (ADMINS_ONLY for the admin's DAGs), None for no such run."""
    if dag_id != BATCH_DAG_ID:
        return ADMINS_ONLY
    from airflow.models.dagrun import DagRun  # airflow
    from airflow.utils.session import create_session  # airflow

    with create_session() as session:
        row = session.execute(select(DagRun.conf, DagRun.triggering_user_name).where(
            DagRun.dag_id == dag_id, DagRun.run_id == run_id)).one_or_none()
    if row is None:
        return None
    return batch_run_owner(run_id, row.conf if isinstance(row.conf, dict) else {}, row.triggering_user_name)


def batch_run_owner(run_id: str, conf: dict[str, Any], triggering_user: str | None) -> str:
    """Its job's owner, or before it registered its job, whoever's job it will make."""
    job = get_job_store(get_settings().database_url).get_job(run_job_id(conf, run_id))
    if job is not None and (job.dag_run_id == run_id or (job.dag_run_id is None and run_id == api_run_id(job.id))):
        return job.owner
    return steps.run_owner(triggering_user, conf, lambda _: False)[0]


# -- what a reader sees -----------------------------------------------------------------------------


def refused_run(user: str, is_admin: bool, body: Any) -> str | None:
    """Why the register step would refuse a new batch run of this trigger (the form's, or
    ``/api/v2``'s), or None: refused here, the trigger form shows the reason and no run is made."""
    conf = body.get("conf") if isinstance(body, dict) else None
    conf = conf if isinstance(conf, dict) else {}
    if not_json(conf, "conf") is not None:
        return None  # what JSON cannot carry: the strict-JSON edge behind this answers it
    store = get_job_store()
    if conf.get("job_id") and store.get_job(str(conf["job_id"])) is not None:
        return None  # a run of a job already made (the batch API's): register decides
    try:
        admission.admit_run(conf, user, is_admin, store, get_settings())
    except JobRejected as exc:
        return admission.refusal_text(exc)
    return None


def shows_events(method: str, parts: list[str]) -> bool:
    """Whether ``/api/v2/<parts>`` answers Airflow's event log."""
    return method == "GET" and parts[:1] == ["eventLogs"] and len(parts) <= 2


def shows_runs(method: str, parts: list[str]) -> bool:
    """Whether ``/api/v2/<parts>`` answers runs with their confs that may be batch runs."""
    if parts[:1] != ["dags"] or len(parts) < 3 or parts[1] not in (BATCH_DAG_ID, WILDCARD) or parts[2] != "dagRuns":
        return False
    if method == "POST":
        return parts[3:] == ["list"]
    return method == "GET" and len(parts) in (3, 4)


def hide_confs(answer: Any, user: str, owner: Callable[[dict[str, Any]], str]) -> Any:
    """`answer` with the conf of each batch run not `user`'s cut to its job id: a form run's conf
    holds what its user wrote (paths, prompts, schemas)."""
    runs = answer.get("dag_runs") if isinstance(answer, dict) and "dag_runs" in answer else [answer]
    for run in runs if isinstance(runs, list) else []:
        if (isinstance(run, dict) and run.get("dag_id") == BATCH_DAG_ID and isinstance(run.get("conf"), dict)
                and owner(run) != user):
            run["conf"] = {"job_id": run_job_id(run["conf"], str(run.get("dag_run_id")))}
    return answer


def hide_event_extras(answer: Any, user: str) -> Any:
    """`answer` without the ``extra`` (a request's body) of another user's batch DAG events."""
    events = answer.get("event_logs") if isinstance(answer, dict) and "event_logs" in answer else [answer]
    for event in events if isinstance(events, list) else []:
        if isinstance(event, dict) and event.get("dag_id") == BATCH_DAG_ID and event.get("owner") != user:
            event["extra"] = None
    return answer


def owner_of_shown_run(run: dict[str, Any]) -> str:
    return batch_run_owner(str(run.get("dag_run_id")), run["conf"], run.get("triggering_user_name"))


# -- the middleware -------------------------------------------------------------------------------


class RunOwnerGuard:
    """The root middleware; its lookups are parameters for tests."""

    def __init__(self, app: ASGIApp, owner_of: OwnerOf = owner_of_run,
                 user_of: Callable[[Scope], Awaitable[Any]] | None = None,
                 shown_owner: Callable[[dict[str, Any]], str] = owner_of_shown_run,
                 refused_run: Callable[[str, bool, Any], str | None] = refused_run):
        self.app, self.owner_of, self.user_of, self.shown_owner = app, owner_of, user_of or airflow_user, shown_owner
        self.refused_run = refused_run

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        path = path.removeprefix(scope.get("root_path", "") or "")
        if not path.startswith(PREFIX):
            await self.app(scope, receive, send)
            return
        parts, method = path[len(PREFIX):].split("/"), scope["method"]
        if shows_runs(method, parts) or shows_events(method, parts):
            await self._read(scope, receive, send, runs=shows_runs(method, parts))
        elif method in _SAFE:
            await self.app(scope, receive, send)
        else:
            await self._write(scope, receive, send, parts)

    async def _read(self, scope: Scope, receive: Receive, send: Send, *, runs: bool) -> None:
        user = await self.user_of(scope)
        if user is not None and not is_airflow_admin(user):
            name = user.get_name()
            send = _rewriting(send, (lambda answer: hide_confs(answer, name, self.shown_owner)) if runs
                              else (lambda answer: hide_event_extras(answer, name)))
            # Airflow's gzip sits inside this middleware: the answer to rewrite comes plain.
            scope = {**scope, "headers": [(k, v) for k, v in scope.get("headers") or []
                                          if k.lower() != b"accept-encoding"]}
        await self.app(scope, receive, send)

    async def _write(self, scope: Scope, receive: Receive, send: Send, parts: list[str]) -> None:
        body = b""
        if reads_body(parts):
            body = await read_body(receive) or b""
            receive = replay(body)
        named = targets(scope["method"], parts, _json(body))
        why, status = None, 403
        if any(t.dag_id == WILDCARD or is_product_dag(t.dag_id) for t in named):
            user = await self.user_of(scope)
            if user is not None and not is_airflow_admin(user):
                why = await run_in_threadpool(refusal, user.get_name(), named, self.owner_of)
        elif scope["method"] == "POST" and parts == ["dags", BATCH_DAG_ID, "dagRuns"]:  # a new run: a job
            user = await self.user_of(scope)
            if user is not None:
                why = await run_in_threadpool(self.refused_run, user.get_name(), is_airflow_admin(user), _json(body))
                status = 400
        answer = self.app if why is None else JSONResponse({"detail": why}, status_code=status)
        await answer(scope, receive, send)


def _rewriting(send: Send, rewrite: Callable[[Any], Any]) -> Send:
    """A send that answers Airflow's JSON (a 200) as `rewrite` makes it."""
    start: dict[str, Any] = {}
    chunks: list[bytes] = []

    async def rewriting(message: Message) -> None:
        if message["type"] == "http.response.start":
            start.update(message)
            return
        if message["type"] != "http.response.body" or not start:
            await send(message)
            return
        chunks.append(message.get("body", b""))
        if message.get("more_body", False):
            return
        body = b"".join(chunks)
        answer = _json(body) if start.get("status") == 200 else None
        if answer is not None:
            body = json.dumps(await run_in_threadpool(rewrite, answer)).encode()
        headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
        await send({**start, "headers": [*headers, (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    return rewriting


def _json(body: bytes) -> Any:
    try:
        return json.loads(body) if body.strip() else None
    except ValueError:
        return None


async def airflow_user(scope: Scope) -> Any:
    """The user Airflow's ``get_user`` would find (Bearer token, else cookie); None without a valid token."""
    from airflow.api_fastapi.auth.managers.base_auth_manager import COOKIE_NAME_JWT_TOKEN  # airflow

    request = Request(scope)
    # As Airflow's HTTPBearer reads the header: an explicit Bearer token wins over the cookie.
    scheme, token = get_authorization_scheme_param(request.headers.get("authorization"))
    if scheme.lower() != "bearer" or not token:
        token = request.cookies.get(COOKIE_NAME_JWT_TOKEN)
    if not token:
        return None
    try:
        return await auth_manager(scope.get("app")).get_user_from_token(token)
    except Exception:  # noqa: BLE001 - expired or invalid: Airflow refuses it the same way
        return None

