"""``create_app()``: the FastAPI app the plugin mounts at ``/batch`` on ``airflow api-server``.

OpenAPI at ``/batch/openapi.json``, docs at ``/batch/docs`` (paths are relative to the
mount, so the SDKs use base URLs ``<airflow>/batch/v1`` (OpenAI), ``<airflow>/batch``
(Mistral), ``<airflow>/batch/`` (Scale's ``LLM_ENGINE_BASE_PATH``)).
"""

from __future__ import annotations

from fastapi import FastAPI
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llm_batch.config import Settings, get_settings
from llm_batch.jobstore import JobStore, get_job_store
from llm_batch_plugin.errors import install_error_handlers
from llm_batch_plugin.routers import files, health, mistral_jobs, openai_batches, scale_batch_completions
from llm_batch_plugin.state import MAX_JSON_BODY_BYTES, ApiState

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
            await _too_large(scope, send, limit)
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


async def _too_large(scope: Scope, send: Send, limit: int) -> None:
    from starlette.responses import JSONResponse

    message = too_large_message(limit)
    body = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": "body_too_large"}}
    await JSONResponse(body, status_code=413)(scope, _ignore_receive, send)


async def _ignore_receive() -> Message:
    return {"type": "http.disconnect"}


def create_app(settings: Settings | None = None, store: JobStore | None = None) -> FastAPI:
    """The batch API app; `settings` and `store` default to the process-wide ones."""
    settings = settings or get_settings()
    app = FastAPI(
        title="llm-batch",
        description="Batch LLM inference: OpenAI batches, Mistral batch jobs and Scale batch completions "
        "over one job store, run by the batch_inference DAG.",
        version="0.1.0",
        docs_url="/docs",
        openapi_url="/openapi.json",
    )
    app.state.llm_batch = ApiState(settings=settings, store=store or get_job_store(settings.database_url))
    install_error_handlers(app)
    for module in (health, files, openai_batches, mistral_jobs, scale_batch_completions):
        app.include_router(module.router)
    app.include_router(scale_batch_completions.v1_router)
    upload_limit = settings.max_input_bytes + _MULTIPART_OVERHEAD
    # Inline requests become an input file: no larger than an upload may be.
    app.add_middleware(BodyLimit, json_limit=min(MAX_JSON_BODY_BYTES, upload_limit), upload_limit=upload_limit)
    return app
