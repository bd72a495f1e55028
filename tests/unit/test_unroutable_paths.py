"""Paths under /batch that the mount cannot route (a control character in an id) get the
API's own 404 in the route's dialect, not Airflow's bare ``{"detail": "Not Found"}``."""

from __future__ import annotations

import asyncio
import json

import pytest
from starlette.responses import JSONResponse

from llm_batch.api.app import UnroutablePaths


async def _airflow(scope, receive, send):
    """Stands for Airflow's outer app: a bare 404 for what no mount matched."""
    await JSONResponse({"detail": "Not Found"}, status_code=404)(scope, receive, send)


def _get(path: str) -> tuple[int, dict]:
    """GET `path` as a server hands it over (decoded: clients cannot even send some of these)."""
    sent: list[dict] = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": path, "raw_path": path.encode(), "root_path": "",
             "query_string": b"", "headers": [], "scheme": "http", "server": ("t", 80), "http_version": "1.1"}
    asyncio.run(UnroutablePaths(_airflow)(scope, receive, send))
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], json.loads(body)


@pytest.mark.parametrize(("path", "openai"), [
    ("/batch/v1/jobs/a\nb", False), ("/batch/v1/batches/batch_1\r", True), ("/batch/v1/files/\x00x", True),
    ("/batch/v1/jobs/\x7f/results", False),
])
def test_a_control_character_in_a_path_is_the_apis_404(path, openai):
    status, body = _get(path)
    assert status == 404
    error = body["error"] if openai else body
    message = error["message"] if openai else error["detail"]
    assert error["code"] == "not_found" and "control character" in message
    assert "\\x" in message and not any(ord(c) < 32 for c in message)  # shown escaped


def test_other_paths_pass_through():
    assert _get("/batch/v1/jobs/job_1") == (404, {"detail": "Not Found"})
    assert _get("/api/v2/dags/a\nb") == (404, {"detail": "Not Found"})  # not ours
