"""``/health``: open (no credentials), says whether the job store answers."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from llm_batch_plugin.state import StoreDep

router = APIRouter(tags=["health"])


@router.get("/health", summary="Liveness and job-store reachability (no auth)")
def health(store: StoreDep) -> JSONResponse:
    try:
        store.list_jobs(limit=1)
    except Exception as exc:  # noqa: BLE001 - any failure means unhealthy, say which
        return JSONResponse({"status": "unhealthy", "job_store": f"{type(exc).__name__}: {exc}"}, status_code=503)
    return JSONResponse({"status": "healthy", "job_store": "ok"})
