"""``create_app()``: the FastAPI app the plugin mounts at ``/batch``, and its ASGI edges.

Each route's 4xx answers are declared here (``declare_error_responses``), derived from what
the route takes, so route functions declare only their successes and anything special.
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
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llm_batch.api.auth import get_caller
from llm_batch.api.errors import OPENAI_PREFIXES, ApiError, error_response, install_error_handlers
from llm_batch.api.idempotency import depends_on, idempotency_key
from llm_batch.api.mistral import jobs as mistral_jobs
from llm_batch.api.native import jobs, usage, webhooks  # webhooks: /v1/webhooks
from llm_batch.api.openai import batches as openai_batches
from llm_batch.api.openai import webhooks as openai_webhooks  # OpenAI's: /v1/webhook_endpoints
from llm_batch.api.routers import adapters, files, health, metrics, ui
from llm_batch.api.scale import batch_completions as scale_batch_completions
from llm_batch.api.state import MAX_JSON_BODY_BYTES, ApiState
from llm_batch.core import strict_json
from llm_batch.core.config import Settings, get_settings
from llm_batch.infra.jobstore import JobStore, get_job_store

_MULTIPART_OVERHEAD = 1024**2  # multipart framing on top of the largest accepted file


class BodyLimit:
    """413 for a body above the limit (multipart: the file limit), by Content-Length and by the
    bytes streamed. A streamed overflow is an ``HTTPException`` from ``receive``: FastAPI's body
    parsing passes that one (any other becomes a vague 400) to the error handlers."""

    def __init__(self, app: ASGIApp, json_limit: int, upload_limit: int):
        self.app, self.json_limit, self.upload_limit = app, json_limit, upload_limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        is_upload = headers.get(b"content-type", b"").startswith(b"multipart/")
        limit = self.upload_limit if is_upload else self.json_limit
        declared = headers.get(b"content-length")
        too_large = f"request body larger than the limit of {limit} bytes"
        if declared is not None and declared.isdigit() and int(declared) > limit:
            error = ApiError(413, too_large, code="body_too_large")
            await error_response(Request(scope), error)(scope, replay(), send)
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > limit:
                raise StarletteHTTPException(413, too_large)
            return message

        await self.app(scope, counted, send)


class StrictJsonBodies:
    """400 in the route's dialect for a JSON body Python admits but strict JSON does not (a lone
    surrogate, NaN, an integer past 64 bits, too deep: ``core.strict_json``); not JSON at all
    goes on to FastAPI's 422. Inside ``BodyLimit``, so what it buffers is bounded; the plugin
    puts it before Airflow's ``/api/v2/`` too, where run confs arrive."""

    def __init__(self, app: ASGIApp, prefixes: tuple[str, ...] = ("",)):
        self.app, self.prefixes = app, prefixes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(self.prefixes) or not _declares_json(scope):
            await self.app(scope, receive, send)
            return
        body = await read_body(receive)
        if body is None:  # the client left
            await self.app(scope, receive, send)
            return
        if body.strip():
            try:
                strict_json.check(body)
            except strict_json.NotStrictJson as exc:
                if not exc.syntax:
                    param = f"body.{exc.where}" if exc.where else "body"
                    error = ApiError(400, f"the request body is not strict JSON: {exc}", param=param, code="invalid_json")
                    await error_response(Request(scope), error)(scope, replay(), send)
                    return
        await self.app(scope, replay(body), send)


class UnroutablePaths:
    """A path under the mount with a control character (the mount's ``.*`` stops at it) would
    get Airflow's own 404: answered here as an unknown id, in the route's dialect."""

    def __init__(self, app: ASGIApp, prefix: str = "/batch"):
        self.app, self.prefix = app, prefix

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


async def read_body(receive: Receive) -> bytes | None:
    """The whole request body; None when the client left first."""
    chunks, more = [], True
    while more:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunks.append(message.get("body", b""))
        more = message.get("more_body", False)
    return b"".join(chunks)


def replay(body: bytes = b"") -> Receive:
    """A receive that hands on a body already read, then says the client left."""
    pending: list[Message] = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> Message:
        return pending.pop(0) if pending else {"type": "http.disconnect"}

    return receive


class ErrorBody(BaseModel):
    """An error of the Mistral, Scale and other routes (a 422's has the per-field list as its
    `detail`: ``ValidationErrorBody``)."""

    detail: str = Field(description="What went wrong, in a sentence (the same as `message`)")
    message: str = Field(description="What went wrong, in a sentence")
    param: str | None = Field(description="Where: the parameter or body field")
    code: str | None = Field(description="The reason for programs, e.g. invalid_api_key, not_found, limit_exceeded")


class FieldProblem(BaseModel):
    """One problem of a request that fails the schema (an item of FastAPI's list)."""

    loc: list[str | int] = Field(description="Where: `body`, `query`, `path` or `header`, then field names and list indexes")
    msg: str = Field(description="What is wrong, in a sentence")
    type: str = Field(description="The kind of problem (pydantic's error type), e.g. missing, string_too_long")


class ValidationErrorBody(BaseModel):
    """A 422 of the Mistral, Scale and other routes: ``ErrorBody`` with FastAPI's per-field list
    (clients parse it) as its `detail`, whether the request fails the schema or the API refuses
    it (a reused Idempotency-Key)."""

    detail: list[FieldProblem] = Field(description="Every problem, one item each (FastAPI's list)")
    message: str = Field(description="The first problem as a sentence naming its place (`requests[3].body: Field "
                         "required`), and how many more there are")
    param: str | None = Field(description="Where the first problem is, e.g. `requests[3].body`; `body` when the body "
                              "is not JSON")
    code: str | None = Field(description="The reason for programs: invalid_value (the schema), idempotency_key_reused")


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
_WWW_AUTHENTICATE = {"WWW-Authenticate": {
    "description": '`Bearer` without credentials, `Bearer error="invalid_token"` for unusable ones (RFC 6750)',
    "schema": {"type": "string"}}}
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
    if depends_on(route.dependant, idempotency_key):
        statuses |= {400, 422}  # a malformed key; a key used with another body or route
    return sorted(statuses)


def _error_response(status: int, openai: bool) -> dict[str, Any]:
    model = OpenAIErrorBody if openai else ValidationErrorBody if status == 422 else ErrorBody
    response: dict[str, Any] = {
        "description": _ERROR_DESCRIPTIONS[status],
        "content": {"application/json": {"schema": {"$ref": _REF + model.__name__}}},
    }
    if status == 401:
        response["headers"] = _WWW_AUTHENTICATE
    return response


def declare_error_responses(app: FastAPI) -> None:
    """Add each route's 4xx answers (``error_statuses``) in its dialect; a declared one is kept."""
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
                    for status in error_statuses(route):
                        if status not in route.responses and str(status) not in route.responses:
                            responses[str(status)] = _error_response(status, openai)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def serve_docs_offline(app: FastAPI) -> None:
    """``/docs`` with Swagger UI's assets from the ``swagger-ui-bundle`` package: FastAPI's
    default loads them from a CDN, which an offline Airflow cannot reach."""
    import swagger_ui_bundle  # optional

    app.mount("/docs/assets", StaticFiles(directory=swagger_ui_bundle.swagger_ui_path), name="swagger-assets")

    @app.get("/docs", include_in_schema=False)
    def docs(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "").rstrip("/")
        assets = f"{root}/docs/assets"
        return get_swagger_ui_html(
            openapi_url=f"{root}{app.openapi_url}", title=f"{app.title} - Swagger UI",
            swagger_js_url=f"{assets}/swagger-ui-bundle.js", swagger_css_url=f"{assets}/swagger-ui.css",
            swagger_favicon_url=f"{assets}/favicon-32x32.png", oauth2_redirect_url=f"{root}/docs/oauth2-redirect")

    @app.get("/docs/oauth2-redirect", include_in_schema=False)
    def oauth2_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()


def create_app(settings: Settings | None = None, store: JobStore | None = None) -> FastAPI:
    """The batch API app; `settings` and `store` default to the process-wide ones."""
    settings = settings or get_settings()
    app = FastAPI(title="llm-batch", version="0.1.0", docs_url=None, openapi_url="/openapi.json",  # docs: below
                  description="Batch LLM inference: OpenAI batches, Mistral batch jobs and Scale batch completions "
                  "over one job store, run by the batch_inference DAG.")
    app.state.llm_batch = ApiState(settings=settings, store=store or get_job_store(settings.database_url))
    install_error_handlers(app)
    for router in (health.router, files.router, adapters.router, openai_batches.router, mistral_jobs.router,
                   scale_batch_completions.router, usage.router, jobs.router, webhooks.router,
                   openai_webhooks.router, scale_batch_completions.v1_router, ui.router, metrics.router):
        app.include_router(router)
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
