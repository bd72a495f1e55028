"""Retry-safe creates: the ``Idempotency-Key`` header of every create route and upload.

A create route takes it by depending on ``IdempotencyDep`` and by belonging to a router
built with ``route_class=IdempotentRoute``; nothing else changes in the route:

- the dependency (after authentication) checks the key (400 naming the header when it is
  empty, longer than 255 characters or not printable ASCII), fingerprints the request
  (sha256 of the raw body; of a multipart upload: its fields and file content, the
  boundary aside) and reserves the key for the caller (the owner) in the job store: the
  store's primary key (owner, key) lets exactly one of many concurrent requests have it.
  The others wait (up to ``WAIT_S``) for the first's response and replay it; after that
  wait they get 409 ``idempotency_key_in_progress``. A key already used on another route
  or with another body is 422 ``idempotency_key_reused`` (param ``Idempotency-Key``).
- the route class runs the route and stores its response (status code, content type,
  body) on the reservation: 2xx and 4xx answers are kept and replayed, except 429 (a limit
  of the moment). A 5xx, an unexpected exception or a request that fails the schema
  releases the key, so a retry runs afresh; a reservation whose request never finished (a
  killed server) is free again after ``LEASE``.

Replays carry ``Idempotent-Replayed: true``. Keys are kept 24 hours at least: housekeeping
deletes older ones (llm_batch.pipeline.housekeeping.delete_old_idempotency_keys).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Annotated, Any

from fastapi import Depends, Header, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute
from starlette.datastructures import UploadFile

from llm_batch.api.auth import CallerDep
from llm_batch.api.errors import ApiError, error_response
from llm_batch.api.state import StoreDep
from llm_batch.core.jobs import Refused
from llm_batch.infra.jobstore import JobStore, utcnow

log = logging.getLogger("llm_batch.api.idempotency")

HEADER = "Idempotency-Key"
MAX_KEY_CHARS = 255
# How long a retry waits for the first request's response before 409.
WAIT_S = 30.0
# A pending reservation older than this belongs to a request that never finished.
LEASE = timedelta(minutes=5)
# Answers not kept: a retry runs again.
_NOT_KEPT = {429}
_HASH_CHUNK = 1 << 20
_STATE = "llm_batch_idempotency"

_DESCRIPTION = (
    "Makes the create retry-safe: the same key (yours, up to 255 printable ASCII characters) with the same "
    "body answers the first request's response again (same status and body, same id) instead of creating "
    "another object; another body or route with a used key is 422 `idempotency_key_reused`. Kept 24 hours."
)


@dataclass(frozen=True)
class _Held:
    """The reservation this request holds."""

    store: JobStore
    owner: str
    key: str
    locked_at: datetime


class _Replay(Exception):
    """Raised by the dependency to answer a stored response instead of running the route."""

    def __init__(self, response: Response):
        self.response = response


def check_key(key: str) -> None:
    """400 naming the header unless `key` is usable."""
    problem = None
    if not key:
        problem = "is empty"
    elif len(key) > MAX_KEY_CHARS:
        problem = f"is longer than {MAX_KEY_CHARS} characters ({len(key)})"
    elif not all(" " <= ch <= "~" for ch in key):
        problem = "has characters that are not printable ASCII"
    if problem:
        raise ApiError(400, f"the {HEADER} header {problem}: give up to {MAX_KEY_CHARS} printable ASCII characters",
                       param=HEADER, code="invalid_idempotency_key")


def _hash_file(upload: UploadFile, digest: Any) -> None:
    stream = upload.file
    stream.seek(0)
    while chunk := stream.read(_HASH_CHUNK):
        digest.update(chunk)
    stream.seek(0)


async def fingerprint(request: Request) -> str:
    """sha256 of the request body; of a multipart form: of its fields (name and value, a
    file's content; the file name and the multipart boundary aside), in name order."""
    content_type = request.headers.get("content-type", "")
    if not content_type.startswith("multipart/form-data"):
        return hashlib.sha256(await request.body()).hexdigest()
    digest = hashlib.sha256(b"multipart\0")
    form = await request.form()
    for name, value in sorted(form.multi_items(), key=lambda item: item[0]):
        digest.update(name.encode() + b"\0")
        if isinstance(value, UploadFile):
            await run_in_threadpool(_hash_file, value, digest)
        else:
            digest.update(value.encode())
        digest.update(b"\0")
    return digest.hexdigest()


def _replay(record: Any) -> Response:
    return Response(
        content=(record.response_body or "").encode(),
        status_code=record.status_code,
        media_type=record.content_type,
        headers={"Idempotent-Replayed": "true"},
    )


async def idempotency_key(
    request: Request,
    caller: CallerDep,
    store: StoreDep,
    key: Annotated[str | None, Header(alias=HEADER, description=_DESCRIPTION)] = None,
) -> str | None:
    """The dependency of the create routes (see the module docstring): None without the header."""
    if key is None:
        return None
    check_key(key)
    caller.require_submit()  # a viewer's 403 is not kept under the key
    route_obj = request.scope.get("route")
    route = f"{request.method} {getattr(route_obj, 'path_format', request.url.path)}"
    body_hash = await fingerprint(request)
    if request.path_params:  # a route on an object (POST /v1/jobs/{job_id}/retry): which object counts too
        params = "\0".join(f"{k}={v}" for k, v in sorted(request.path_params.items()))
        body_hash = hashlib.sha256(f"{params}\0{body_hash}".encode()).hexdigest()
    deadline = time.monotonic() + WAIT_S
    delay = 0.02
    record = None
    while True:
        if record is None or (record.status_code is None and record.locked_at <= utcnow() - LEASE):
            taken, record = await run_in_threadpool(
                store.reserve_idempotency_key, caller.name, key, route, body_hash, LEASE
            )
            if taken:
                setattr(request.state, _STATE, _Held(store, caller.name, key, record.locked_at))
                return key
        if record.route != route or record.fingerprint != body_hash:
            raise ApiError(422, f"the {HEADER} was already used with another request body or on another route "
                           f"({record.route}): use a new key for a different request",
                           param=HEADER, code="idempotency_key_reused", location="header")
        if record.status_code is not None:
            raise _Replay(_replay(record))
        if time.monotonic() > deadline:
            raise ApiError(
                409, f"a request with this {HEADER} is still being processed: retry in a few seconds",
                param=HEADER, code="idempotency_key_in_progress", headers={"Retry-After": "5"},
            )
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.25)
        record = await run_in_threadpool(store.get_idempotency_key, caller.name, key)


IdempotencyDep = Annotated[str | None, Depends(idempotency_key)]


def depends_on(dependant: Dependant, call: Any) -> bool:
    """Whether `call` is among the dependencies of `dependant`, at any depth."""
    return any(d.call is call or depends_on(d, call) for d in dependant.dependencies)


async def _finish(held: _Held | None, response: Response | None) -> None:
    """Keep `response` under the held key, or release the key (no response, 5xx, 429)."""
    if held is None:
        return
    keep = response is not None and response.status_code < 500 and response.status_code not in _NOT_KEPT
    body = getattr(response, "body", None) if keep else None
    try:
        if keep and isinstance(body, (bytes, bytearray)):
            await run_in_threadpool(
                held.store.complete_idempotency_key, held.owner, held.key, held.locked_at,
                response.status_code, response.headers.get("content-type"), bytes(body).decode("utf-8", "replace"),
            )
        else:
            await run_in_threadpool(held.store.release_idempotency_key, held.owner, held.key, held.locked_at)
    except Exception:  # noqa: BLE001 - the answer stands; the lease frees a key left pending
        log.exception("idempotency key %r of %s: could not store the outcome", held.key, held.owner)


class IdempotentRoute(APIRoute):
    """A route class for routers with create routes: a route that depends on
    ``IdempotencyDep`` has its response kept under the key (others run unchanged)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        if not depends_on(self.dependant, idempotency_key):
            return handler

        async def run(request: Request) -> Response:
            try:
                response = await handler(request)
            except _Replay as replay:
                return replay.response
            except Refused as exc:  # the route's ApiError, or the admission's refusal
                held = getattr(request.state, _STATE, None)
                if held is None or exc.status_code >= 500 or exc.status_code in _NOT_KEPT:
                    await _finish(held, None)
                    raise
                response = error_response(request, exc)
                await _finish(held, response)
                return response
            except Exception:  # a request that fails the schema (RequestValidationError) too
                await _finish(getattr(request.state, _STATE, None), None)
                raise
            await _finish(getattr(request.state, _STATE, None), response)
            return response

        return run
