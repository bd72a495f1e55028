"""Retry-safe creates: the ``Idempotency-Key`` header (docs/api.md "Retry-safe creates"). A create
route depends on ``IdempotencyDep`` (the key reserved for the owner: one of concurrent requests wins,
the others wait for its answer) on a router with ``route_class=IdempotentRoute`` (keeps the answer)."""

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
WAIT_S = 30.0  # for the first request's answer, before 409
LEASE = timedelta(minutes=5)  # a pending reservation older than this is free again
_NOT_KEPT = {429}  # a limit of the moment: a retry runs again
_HASH_CHUNK = 1 << 20
_STATE = "llm_batch_idempotency"

_DESCRIPTION = (
    "Makes the create retry-safe: the same key (yours, up to 255 printable ASCII characters) with the same "
    "body answers the first request's response again (same status and body, same id) instead of creating "
    "another object; another body or route with a used key is 422 `idempotency_key_reused`. Kept 24 hours."
)


@dataclass(frozen=True)
class _Held:
    store: JobStore
    owner: str
    key: str
    locked_at: datetime


class _Replay(Exception):
    """Raised by the dependency to answer a stored response instead of running the route."""

    def __init__(self, response: Response):
        self.response = response


def check_key(key: str) -> None:
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
    """sha256 of the body; of a multipart form, of its fields in name order (the boundary and
    file names change on every send)."""
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


async def idempotency_key(
    request: Request, caller: CallerDep, store: StoreDep,
    key: Annotated[str | None, Header(alias=HEADER, description=_DESCRIPTION)] = None,
) -> str | None:
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
            taken, record = await run_in_threadpool(store.reserve_idempotency_key, caller.name, key, route,
                                                    body_hash, LEASE)
            if taken:
                setattr(request.state, _STATE, _Held(store, caller.name, key, record.locked_at))
                return key
        if record.route != route or record.fingerprint != body_hash:
            raise ApiError(422, f"the {HEADER} was already used with another request body or on another route "
                           f"({record.route}): use a new key for a different request",
                           param=HEADER, code="idempotency_key_reused", location="header")
        if record.status_code is not None:
            raise _Replay(Response((record.response_body or "").encode(), record.status_code,
                                   headers={"Idempotent-Replayed": "true"}, media_type=record.content_type))
        if time.monotonic() > deadline:
            raise ApiError(409, f"a request with this {HEADER} is still being processed: retry in a few seconds",
                           param=HEADER, code="idempotency_key_in_progress", headers={"Retry-After": "5"})
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.25)
        record = await run_in_threadpool(store.get_idempotency_key, caller.name, key)


IdempotencyDep = Annotated[str | None, Depends(idempotency_key)]


def depends_on(dependant: Dependant, call: Any) -> bool:
    """Whether `call` is among the dependencies of `dependant`, at any depth."""
    return any(d.call is call or depends_on(d, call) for d in dependant.dependencies)


async def _finish(held: _Held | None, response: Response | None) -> None:
    """Keep `response` under the held key, or release it (no response, 5xx, 429)."""
    if held is None:
        return
    keep = response is not None and response.status_code < 500 and response.status_code not in _NOT_KEPT
    body = getattr(response, "body", None) if keep else None
    try:
        if keep and isinstance(body, (bytes, bytearray)):
            await run_in_threadpool(held.store.complete_idempotency_key, held.owner, held.key, held.locked_at,
                                    response.status_code, response.headers.get("content-type"),
                                    bytes(body).decode("utf-8", "replace"))
        else:
            await run_in_threadpool(held.store.release_idempotency_key, held.owner, held.key, held.locked_at)
    except Exception:  # noqa: BLE001 - the answer stands; the lease frees a key left pending
        log.exception("idempotency key %r of %s: could not store the outcome", held.key, held.owner)


class IdempotentRoute(APIRoute):
    """Keeps the answer of a route that depends on ``IdempotencyDep`` under its key."""

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
