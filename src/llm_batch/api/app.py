"""``create_app()``: the FastAPI app the plugin mounts at ``/batch`` on ``airflow api-server``.

OpenAPI at ``/batch/openapi.json``, docs at ``/batch/docs`` (Swagger UI served from the
``swagger-ui-bundle`` package: nothing loads from a CDN), the Batch jobs page of Airflow's
UI at ``/batch/ui/jobs`` (routers/ui.py, assets in ``ui/static``) (paths are relative to the
mount, so the SDKs use base URLs ``<airflow>/batch/v1`` (OpenAI), ``<airflow>/batch``
(Mistral), ``<airflow>/batch/`` (Scale's ``LLM_ENGINE_BASE_PATH``)).

The document declares each route's 4xx answers with their error bodies in one place here
(``declare_error_responses``), derived from what the route takes (credentials, ids, a body,
query parameters): route functions declare only their successes and anything special.
"""

from __future__ import annotations

import re
from typing import Any

from fastapi import FastAPI, Request, params
from fastapi.dependencies.utils import get_flat_params
from fastapi.openapi.docs import get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import HTMLResponse
from fastapi.routing import APIRoute
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llm_batch.api.auth import get_caller
from llm_batch.api.errors import OPENAI_PREFIXES, ApiError, error_response, install_error_handlers
from llm_batch.api.idempotency import depends_on, idempotency_key
from llm_batch.api.mistral import jobs as mistral_jobs
from llm_batch.api.native import (
    jobs,
    results,
    usage,
    webhooks,  # webhooks: /v1/webhooks
)
from llm_batch.api.openai import batches as openai_batches
from llm_batch.api.openai import webhooks as openai_webhooks  # OpenAI's: /v1/webhook_endpoints
from llm_batch.api.routers import adapters, files, health, metrics, ui
from llm_batch.api.scale import batch_completions as scale_batch_completions
from llm_batch.api.state import MAX_JSON_BODY_BYTES, ApiState
from llm_batch.core import strict_json
from llm_batch.core.config import Settings, get_settings
from llm_batch.infra.jobstore import JobStore, get_job_store

# Multipart framing on top of the largest accepted file.
_MULTIPART_OVERHEAD = 1024**2


class BodyLimit:
    """413 for a request body above the limit (multipart uploads: the file limit), checked on
    Content-Length up front and on the bytes actually streamed (chunked bodies).

    A streamed overflow is raised as an ``HTTPException`` from ``receive``: FastAPI passes
    that through its body parsing (any other exception there becomes a vague 400), so the
    app's error handlers answer it in the route's dialect.
    """

    def __init__(self, app: ASGIApp, json_limit: int, upload_limit: int):
        self.app = app
        self.json_limit = json_limit
        self.upload_limit = upload_limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        is_upload = headers.get(b"content-type", b"").startswith(b"multipart/")
        limit = self.upload_limit if is_upload else self.json_limit
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            error = {"message": too_large_message(limit), "type": "invalid_request_error", "param": None,
                     "code": "body_too_large"}
            await JSONResponse({"error": error}, status_code=413)(scope, _replay([]), send)
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > limit:
                raise StarletteHTTPException(413, too_large_message(limit))
            return message

        await self.app(scope, counted, send)


def too_large_message(limit: int) -> str:
    return f"request body larger than the limit of {limit} bytes"


class StrictJsonBodies:
    """The one edge every JSON body crosses: ``llm_batch.core.strict_json`` checks it before any
    route reads it, and a body that is JSON to Python but not strict JSON (a lone surrogate,
    NaN, an integer past 64 bits, nesting deeper than ``strict_json.MAX_DEPTH``) is answered
    400 in the route's dialect naming what and where. Text that is not JSON at all goes on to
    FastAPI, whose 422 already says where it breaks.

    A body is JSON when its Content-Type says so or is missing (FastAPI then reads JSON).
    In the batch app it sits inside ``BodyLimit``, so what it buffers is bounded. The plugin
    also puts it in front of Airflow's own REST API (``prefixes``: ``/api/v2/``), where a
    user's run conf arrives, since Python's parser there admits the same values.
    """

    def __init__(self, app: ASGIApp, prefixes: tuple[str, ...] = ("",)):
        self.app = app
        self.prefixes = prefixes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(self.prefixes) or not _declares_json(scope):
            await self.app(scope, receive, send)
            return
        chunks, more = [], True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                await self.app(scope, _replay([message]), send)
                return
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        if body.strip():
            try:
                strict_json.check(body)
            except strict_json.NotStrictJson as exc:
                if not exc.syntax:
                    param = f"body.{exc.where}" if exc.where else "body"
                    error = ApiError(400, f"the request body is not strict JSON: {exc}", param=param, code="invalid_json")
                    await error_response(Request(scope), error)(scope, _replay([]), send)
                    return
        await self.app(scope, _replay([{"type": "http.request", "body": body, "more_body": False}]), send)


class UnroutablePaths:
    """Paths under the batch API's mount that Starlette's mount pattern cannot match (a
    control character such as a newline in an id: ``.*`` stops at it) would reach Airflow's
    own 404 (``{"detail": "Not Found"}``); answered here as the API answers an unknown id, in
    the route's dialect. A root middleware of the plugin."""

    def __init__(self, app: ASGIApp, prefix: str = "/batch"):
        self.app = app
        self.prefix = prefix

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if not path.startswith(self.prefix + "/") or not _CONTROL.search(path):
            await self.app(scope, receive, send)
            return
        shown = _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", path[len(self.prefix):])
        error = ApiError(404, f"no such object: {scope['method']} {shown} (a path never holds a control "
                              "character)", code="not_found")
        await error_response(Request({**scope, "root_path": self.prefix}), error)(scope, receive, send)


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _declares_json(scope: Scope) -> bool:
    if scope.get("method") in ("GET", "HEAD", "OPTIONS"):
        return False
    content_type = dict(scope.get("headers") or []).get(b"content-type", b"").split(b";")[0].strip().lower()
    return not content_type or content_type == b"application/json" or (
        content_type.startswith(b"application/") and content_type.endswith(b"+json"))


def _replay(messages: list[Message]) -> Receive:
    """A receive that hands on what was read, then waits for the client to go."""
    pending = list(messages)

    async def receive() -> Message:
        return pending.pop(0) if pending else {"type": "http.disconnect"}

    return receive


class ErrorBody(BaseModel):
    """An error of the Mistral, Scale and other routes."""

    detail: str = Field(description="What went wrong, in a sentence")
    param: str | None = Field(description="Where: the parameter or body field")
    code: str | None = Field(description="The reason for programs, e.g. invalid_api_key, not_found, limit_exceeded")


class FieldProblem(BaseModel):
    """One problem of a request that fails the schema (an item of FastAPI's list)."""

    loc: list[str | int] = Field(description="Where: `body`, `query`, `path` or `header`, then field names and list indexes")
    msg: str = Field(description="What is wrong, in a sentence")
    type: str = Field(description="The kind of problem (pydantic's error type), e.g. missing, string_too_long")


class ValidationErrorBody(BaseModel):
    """A request that fails the schema, on the Mistral, Scale and other routes: FastAPI's
    per-field list (clients parse it) plus one sentence."""

    detail: list[FieldProblem] = Field(description="Every problem, one item each (FastAPI's list)")
    message: str = Field(description="The first problem as a sentence naming its place (`requests[3].body: Field "
                         "required`), and how many more there are")
    param: str | None = Field(description="Where the first problem is, e.g. `requests[3].body`; `body` when the body "
                              "is not JSON")


class OpenAIError(BaseModel):
    """The error object of the OpenAI routes."""

    message: str = Field(description="What went wrong, in a sentence")
    type: str = Field(description="invalid_request_error, authentication_error, permission_error, not_found_error, ...")
    param: str | None = Field(description="Where: the parameter or body field")
    code: str | None = Field(description="The reason for programs, e.g. invalid_api_key, not_found, limit_exceeded")


class OpenAIErrorBody(BaseModel):
    """Every error of the OpenAI routes (``/v1/files``, ``/v1/batches``), as the OpenAI API answers."""

    error: OpenAIError = Field(description="The error")


_ERROR_MODELS = (ErrorBody, ValidationErrorBody, OpenAIErrorBody)
_REF = "#/components/schemas/"

_ERROR_DESCRIPTIONS = {
    400: "Refused: the message says why, `param` where",
    401: "No usable credentials: none, malformed, unknown, revoked or expired (see WWW-Authenticate)",
    403: "Authenticated but not allowed: no read right on batch_inference runs, or a read-only user (viewer) on a "
    "write",
    404: "No such object, or one that is not the caller's (the same answer)",
    409: "Conflicts with the state of an object: cancelling an ended job, deleting a file a job still reads, "
    "an output another job writes",
    413: "Request body larger than the limit",
    422: "The request does not match the schema (or, on a create, its Idempotency-Key was used with another body)",
    429: "A per-owner limit is reached (code limit_exceeded or rate_limit_exceeded)",
}
_WWW_AUTHENTICATE = {
    "WWW-Authenticate": {
        "description": '`Bearer` without credentials, `Bearer error="invalid_token"` for unusable ones (RFC 6750)',
        "schema": {"type": "string"},
    }
}
# Body fields that name uploaded files by id (a missing or someone else's is 404).
_FILE_REFERENCE = re.compile(r"(^|_)(file_ids?|files)$")


def _names_files(route: APIRoute) -> bool:
    model = route.body_field.field_info.annotation if route.body_field is not None else None
    return any(_FILE_REFERENCE.search(name) for name in getattr(model, "model_fields", {}))


def error_statuses(route: APIRoute) -> list[int]:
    """The 4xx statuses `route` may answer, from what it takes."""
    authenticated = depends_on(route.dependant, get_caller)
    takes_id = bool(route.dependant.path_params)
    has_body = route.body_field is not None
    flat = get_flat_params(route.dependant)
    statuses = set()
    if has_body or any(isinstance(p.field_info, params.Query) for p in flat):
        statuses.add(400)
    if authenticated:
        statuses |= {401, 403}
    if takes_id or _names_files(route):
        statuses.add(404)
    if authenticated and route.methods - {"GET", "HEAD"}:
        statuses.add(409)  # a write can conflict with what exists
    if has_body:
        statuses.add(413)
    if has_body or flat:  # where FastAPI itself declares 422
        statuses.add(422)
    if authenticated and "POST" in route.methods and not takes_id:
        statuses.add(429)  # creates and uploads: per-owner limits
    if takes_idempotency_key(route):
        statuses |= {400, 422}  # a malformed key; a key used with another body or route
    return sorted(statuses)


def takes_idempotency_key(route: APIRoute) -> bool:
    return depends_on(route.dependant, idempotency_key)


def _error_response(status: int, openai: bool, keyed: bool = False) -> dict[str, Any]:
    model = OpenAIErrorBody if openai else ValidationErrorBody if status == 422 else ErrorBody
    schema: dict[str, Any] = {"$ref": _REF + model.__name__}
    if status == 413 and not openai:
        # BodyLimit answers a too large Content-Length before routing, in OpenAI's shape.
        schema = {"anyOf": [schema, {"$ref": _REF + OpenAIErrorBody.__name__}]}
    if status == 422 and keyed and not openai:
        # idempotency_key_reused is the API's own refusal, in its error body.
        schema = {"anyOf": [schema, {"$ref": _REF + ErrorBody.__name__}]}
    response: dict[str, Any] = {
        "description": _ERROR_DESCRIPTIONS[status],
        "content": {"application/json": {"schema": schema}},
    }
    if status == 401:
        response["headers"] = _WWW_AUTHENTICATE
    return response


def declare_error_responses(app: FastAPI) -> None:
    """Add each route's 4xx answers (``error_statuses``) with the body of its dialect to the
    app's OpenAPI document; a response a route declares itself is kept as it is."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = build()
            schemas = document.setdefault("components", {}).setdefault("schemas", {})
            for model in _ERROR_MODELS:
                schema = model.model_json_schema(ref_template=_REF + "{model}")
                schemas.update(schema.pop("$defs", {}))
                schemas[model.__name__] = schema
            for route in app.routes:
                if not isinstance(route, APIRoute) or not route.include_in_schema:
                    continue
                openai = route.path.startswith(OPENAI_PREFIXES)
                for method in route.methods:
                    responses = document["paths"][route.path_format][method.lower()]["responses"]
                    keyed = takes_idempotency_key(route)
                    for status in error_statuses(route):
                        if status not in route.responses and str(status) not in route.responses:
                            responses[str(status)] = _error_response(status, openai, keyed)
                        elif keyed and status == 422:  # FastAPI's own 422 declaration, widened
                            responses["422"] = _error_response(status, openai, keyed)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def serve_docs_offline(app: FastAPI) -> None:
    """``/docs``: FastAPI's Swagger UI page with its JS, CSS and icon served from the
    ``swagger-ui-bundle`` package under ``/docs/assets`` (FastAPI's default loads them from
    a CDN, which an offline or locked-down Airflow cannot reach)."""
    import swagger_ui_bundle  # optional

    app.mount("/docs/assets", StaticFiles(directory=swagger_ui_bundle.swagger_ui_path), name="swagger-assets")

    @app.get("/docs", include_in_schema=False)
    def docs(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "").rstrip("/")
        return get_swagger_ui_html(
            openapi_url=f"{root}{app.openapi_url}",
            title=f"{app.title} - Swagger UI",
            swagger_js_url=f"{root}/docs/assets/swagger-ui-bundle.js",
            swagger_css_url=f"{root}/docs/assets/swagger-ui.css",
            swagger_favicon_url=f"{root}/docs/assets/favicon-32x32.png",
            oauth2_redirect_url=f"{root}/docs/oauth2-redirect",
        )

    @app.get("/docs/oauth2-redirect", include_in_schema=False)
    def oauth2_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()


def create_app(settings: Settings | None = None, store: JobStore | None = None) -> FastAPI:
    """The batch API app; `settings` and `store` default to the process-wide ones."""
    settings = settings or get_settings()
    app = FastAPI(
        title="llm-batch",
        description="Batch LLM inference: OpenAI batches, Mistral batch jobs and Scale batch completions "
        "over one job store, run by the batch_inference DAG.",
        version="0.1.0",
        docs_url=None,  # serve_docs_offline
        openapi_url="/openapi.json",
    )
    app.state.llm_batch = ApiState(settings=settings, store=store or get_job_store(settings.database_url))
    install_error_handlers(app)
    for module in (health, files, adapters, openai_batches, mistral_jobs, scale_batch_completions, usage, jobs,
                   results, webhooks):
        app.include_router(module.router)
    app.include_router(openai_webhooks.router)
    app.include_router(scale_batch_completions.v1_router)
    app.include_router(ui.router)
    app.include_router(metrics.router)
    app.mount("/ui/static", StaticFiles(directory=ui.STATIC_DIR), name="ui-static")
    serve_docs_offline(app)
    declare_error_responses(app)
    # The largest upload: a batch file, or an adapter's archive.
    upload_limit = max(settings.max_input_bytes, settings.max_adapter_bytes) + _MULTIPART_OVERHEAD
    # Inline requests become an input file: no larger than a batch file may be.
    json_limit = min(MAX_JSON_BODY_BYTES, settings.max_input_bytes + _MULTIPART_OVERHEAD)
    # Added last = outermost: the size limit first, then the strict JSON edge inside it.
    app.add_middleware(StrictJsonBodies)
    app.add_middleware(BodyLimit, json_limit=json_limit, upload_limit=upload_limit)
    app.add_middleware(metrics.RequestMetrics)  # outermost: every answer is counted, a refused one too
    return app
