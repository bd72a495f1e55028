"""``/health``: open (no credentials), says whether the job store can be read and written
through a new connection (``JobStore.check_health``), not just through the app's pool."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from llm_batch.api.state import StoreDep
from llm_batch.infra.jobstore.errors import JobStoreUnhealthy

router = APIRouter(tags=["health"])


@router.get(
    "/health",
    summary="Liveness and job-store health: a new connection reads and writes (no auth)",
    responses={503: {"description": '{"status": "unhealthy", "job_store": "<store URL>: <step> failed: <error>"}'}},
)
def health(store: StoreDep) -> JSONResponse:  # sync: FastAPI runs it in its threadpool
    try:
        store.check_health()
    except JobStoreUnhealthy as exc:
        return JSONResponse({"status": "unhealthy", "job_store": str(exc)}, status_code=503)
    return JSONResponse({"status": "healthy", "job_store": "ok"})
