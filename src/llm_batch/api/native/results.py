"""A job's finished lines while it runs: ``GET /v1/jobs/{id}/results`` (NDJSON; docs/api.md
"Results while a job runs"): the very lines its output and error files will hold when it ends."""

from __future__ import annotations

from itertools import chain
from typing import Annotated

import orjson
from fastapi import APIRouter, Query
from fastapi.responses import StreamingResponse

from llm_batch.api.auth import CallerDep
from llm_batch.api.cancellation import owned_job
from llm_batch.api.state import SettingsDep, StoreDep
from llm_batch.pipeline.partial import PartialOrder, partial_entries
from llm_batch.pipeline.steps import layout_of

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])

NDJSON = "application/x-ndjson"


@router.get("/{job_id}/results", response_class=StreamingResponse,
            responses={200: {"content": {NDJSON: {}}, "description": "One finished line per line, in input order"}},
            summary="Read a job's finished lines, while it runs or after (NDJSON)")
def get_results(
    job_id: str, caller: CallerDep, store: StoreDep, settings: SettingsDep,
    order: Annotated[PartialOrder, Query(
        description="`input`: input order up to the first line not finished yet; `finished`: every finished "
        "line, in input order, lines not finished yet left out")] = PartialOrder.INPUT,
    start: Annotated[int, Query(
        ge=0, le=10**9, description="Leave out the lines before this input index (a poller of `input` order "
        "passes the number of lines it already has)")] = 0,
) -> StreamingResponse:
    job = owned_job(store, job_id, caller.owner_filter, "job")
    entries = partial_entries(layout_of(settings, job.id), order, start)
    # The first entry is read here: storage failing is an error response, not a stream cut after its headers.
    first = next(entries, None)
    lines = (orjson.dumps(entry) + b"\n" for entry in chain([first] if first else [], entries))
    return StreamingResponse(lines, media_type=NDJSON, headers={
        "X-Job-Status": job.status.value, "X-Results-Complete": "true" if job.terminal else "false"})
