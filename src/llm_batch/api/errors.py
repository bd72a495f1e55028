"""API errors: one exception type, one shape per dialect whoever refuses (a route, FastAPI's
validation, a middleware): OpenAI's ``{"error": {...}}`` on its routes, elsewhere ``{"detail",
"message", "param", "code"}`` with FastAPI's ``detail`` (a 422's per-field list, which clients parse).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException

from llm_batch.core.jobs import Refused
from llm_batch.infra import storage
from llm_batch.infra.jobstore import InvalidCursor

# Route prefixes whose clients (the openai SDK) expect OpenAI's error shape.
OPENAI_PREFIXES = ("/v1/batches", "/v1/files", "/v1/webhook_endpoints", "/v1/webhook_event_types")

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 405: "invalid_request_error", 409: "conflict_error",
                413: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error"}


class ApiError(Refused):
    """An error answered as-is: `message` says what, `param` where (`location`: a 422's `loc`)."""

    def __init__(self, status_code: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None, location: str = "body"):
        super().__init__(status_code, message, param=param, code=code, headers=headers)
        self.location = location


def not_found(kind: str, object_id: str) -> ApiError:
    """The one answer for a missing id and for someone else's id (no existence leak)."""
    return ApiError(404, f"No {kind} found with id {object_id!r}.", param="id", code="not_found")


def _wants_openai_shape(request: Request) -> bool:
    return request.scope.get("path", "").removeprefix(request.scope.get("root_path", "")).startswith(OPENAI_PREFIXES)


def error_response(request: Request, error: Refused) -> JSONResponse:
    if _wants_openai_shape(request):
        kind = _ERROR_TYPES.get(error.status_code, "api_error")
        body: dict[str, Any] = {"error": {"message": error.message, "type": kind, "param": error.param,
                                          "code": error.code}}
    else:
        detail: Any = error.message
        if error.status_code == 422:  # as FastAPI's own 422: the per-field list
            location = getattr(error, "location", "body")  # an admission's Refused: the body's
            detail = [{"loc": [location, error.param] if error.param else [location],
                       "msg": error.message, "type": error.code or "invalid_value"}]
        body = {"detail": detail, "message": error.message, "param": error.param, "code": error.code}
    return JSONResponse(body, status_code=error.status_code, headers=error.headers)


def _location(loc: tuple[Any, ...]) -> str:
    """``("body", "requests", 3, "body")`` -> ``requests[3].body``."""
    parts = [p for p in loc if p not in ("body", "query", "path", "header", "form")] or list(loc)
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    where = _location(tuple(first.get("loc", ())))
    if body_problem := _body_problem(request, first):
        message, where = body_problem, "body"
    else:
        message = f"{where}: {first.get('msg')}" if where else str(first.get("msg"))
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    if _wants_openai_shape(request):
        return error_response(request, ApiError(422, message, param=where or None, code="invalid_value"))
    # FastAPI's per-field list, every problem: clients that parse it still can.
    body = {"detail": [_jsonable(e) for e in errors], "message": message, "param": where or None,
            "code": "invalid_value"}
    return JSONResponse(body, status_code=422)


def _body_problem(request: Request, error: dict[str, Any]) -> str | None:
    """A plain sentence for a body that is not JSON at all (FastAPI's words are obscure there)."""
    loc = tuple(error.get("loc", ()))
    if error.get("type") == "json_invalid":
        reason = (error.get("ctx") or {}).get("error", "invalid JSON")
        return f"the request body is not valid JSON: {reason} at character {loc[-1]}"
    content_type = request.headers.get("content-type", "")
    if loc == ("body",) and error.get("type") == "model_attributes_type" and "json" not in content_type:
        shown = content_type or "none"
        return f"the request body must be a JSON object sent as Content-Type: application/json (got {shown!r})"
    return None


def _jsonable(error: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in error.items() if k in ("loc", "msg", "type")}
    out["loc"] = [p if isinstance(p, (str, int)) else str(p) for p in out.get("loc", ())]
    return out


def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    # Raised by Airflow's security dependencies (401/403), by routing (404/405), by the
    # body limit (413) and by FastAPI's body parsing (400).
    message, code = str(exc.detail), _HTTP_CODES.get(exc.status_code)
    headers = getattr(exc, "headers", None)
    where = f"{request.method} {request.url.path}"
    if exc.status_code == 404 and message == "Not Found":
        message = f"no such route: {where} (the routes are listed at /batch/docs)"
    elif exc.status_code == 405:
        allowed = (headers or {}).get("Allow", "")
        message = f"method not allowed: {where}" + (f"; allowed: {allowed}" if allowed else "")
    elif exc.status_code == 400 and exc.__cause__ is not None:
        # FastAPI's body parsing failed (e.g. not UTF-8): say why.
        message, code = f"{message}: {type(exc.__cause__).__name__}: {exc.__cause__}", "invalid_body"
        return error_response(request, ApiError(400, message, param="body", code=code, headers=headers))
    return error_response(request, ApiError(exc.status_code, message, code=code, headers=headers))


_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}


def _storage_error(request: Request, exc: Exception) -> JSONResponse:
    """Storage failures that escaped a route: say which object and that it is ours."""
    if isinstance(exc, storage.PathNotAllowed):
        # User paths are refused before any storage call: this is one of our own areas.
        error = ApiError(503, "server configuration: llm-batch's own storage is outside the allowed roots or buckets "
                         f"(LLM_BATCH_LOCAL_ROOTS / LLM_BATCH_ALLOWED_BUCKETS must include the work and files areas): "
                         f"{exc}", code="storage_misconfigured")
    elif isinstance(exc, storage.ObjectNotFound):
        error = ApiError(404, str(exc), code="object_missing")
    else:
        error = ApiError(503, f"storage unavailable: {exc}", code="storage_unavailable")
    return error_response(request, error)


def _database_error(request: Request, exc: Exception) -> JSONResponse:
    return error_response(request, ApiError(503, f"job store unavailable: {type(exc).__name__}", code="store_unavailable"))


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(Refused, lambda request, exc: error_response(request, exc))
    # Every list route names its cursor `after`.
    app.add_exception_handler(InvalidCursor, lambda request, exc: error_response(
        request, ApiError(400, str(exc), param="after", code="invalid_cursor")))
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(storage.StorageError, _storage_error)
    app.add_exception_handler(OperationalError, _database_error)
