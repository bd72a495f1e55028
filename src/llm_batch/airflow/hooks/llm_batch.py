"""``LLMBatchHook``: the llm-batch REST API (the native ``/batch/v1/jobs`` route) over HTTP,
for Airflow tasks and triggers.

The Airflow Connection (default ``llm_batch_default``; ``llm-batch up`` makes it for the
embedded stack): ``host`` = the api-server's base URL (e.g. ``http://127.0.0.1:8080``; a
bare host name gets ``schema`` (default http) and ``port``), ``password`` = an llm-batch API
key (``llm-batch api-key create USER``). Sync methods for the operator, ``aget_job`` for
the trigger. A refusal raises ``LLMBatchApiError`` with the API's message and field.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx

try:
    from airflow.sdk import BaseHook
except ImportError:  # pragma: no cover - Airflow 2 style import path
    from airflow.hooks.base import BaseHook  # type: ignore[no-redef]

TIMEOUT = httpx.Timeout(60.0, connect=10.0)


class LLMBatchApiError(Exception):
    """The API refused a call: ``status``, its ``message`` and the ``param`` it names."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(f"llm-batch API {status}: {message}" + (f" (field {param})" if param else ""))
        self.status = status
        self.message = message
        self.param = param
        self.code = code


def _raise_for(response: httpx.Response) -> None:
    if not response.is_error:
        return
    try:
        body = response.json()
    except ValueError:
        raise LLMBatchApiError(response.status_code, response.text[:500]) from None
    message = body.get("message") if isinstance(body.get("message"), str) else body.get("detail")
    if isinstance(body.get("error"), dict):  # the OpenAI-shaped routes
        message, body = body["error"].get("message"), body["error"]
    raise LLMBatchApiError(response.status_code, str(message), body.get("param"), body.get("code"))


def base_url_of(conn: Any) -> str:
    """``<api-server>/batch`` from a Connection's host (a URL, or a host with schema/port)."""
    host = (conn.host or "").rstrip("/")
    if not host:
        raise ValueError(f"connection {conn.conn_id!r} has no host: set it to the api-server's URL")
    if "://" not in host:
        host = f"{conn.schema or 'http'}://{host}" + (f":{conn.port}" if conn.port else "")
    return host if host.endswith("/batch") else f"{host}/batch"


def idempotency_key_for(job_id: str) -> str:
    """The ``Idempotency-Key`` of the create of the job `job_id` (the operator's deterministic id)."""
    return f"llm-batch-operator:{job_id}"[:255]


class LLMBatchHook(BaseHook):
    """Create, read and cancel llm-batch jobs through the REST API.

    :param llm_batch_conn_id: the Airflow Connection of the API (host = api-server URL,
        password = API key).
    """

    conn_name_attr = "llm_batch_conn_id"
    default_conn_name = "llm_batch_default"
    conn_type = "http"
    hook_name = "llm-batch"

    def __init__(self, llm_batch_conn_id: str = default_conn_name) -> None:
        super().__init__()
        self.llm_batch_conn_id = llm_batch_conn_id

    @staticmethod
    def _client_args(conn: Any) -> dict[str, Any]:
        headers = {"Authorization": f"Bearer {conn.password}"} if conn.password else {}
        return {"base_url": base_url_of(conn), "headers": headers, "timeout": TIMEOUT}

    def get_conn(self) -> httpx.Client:
        """A new ``httpx.Client`` on ``<api-server>/batch`` with the key (close it)."""
        return httpx.Client(**self._client_args(self.get_connection(self.llm_batch_conn_id)))

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        with self.get_conn() as client:
            response = client.request(method, path, **kwargs)
        _raise_for(response)
        return response.json()

    def create_job(self, body: dict[str, Any]) -> dict[str, Any]:
        """``POST /v1/jobs``: the job (with ``id``: the existing job of that id, if yours).

        With an ``id`` (the operator's deterministic job id) the create carries the
        ``Idempotency-Key`` ``idempotency_key_for(id)``: a retried task (or a timed-out call
        tried again) gets the first answer back. If that key was used with another body
        (the task's parameters changed, within the keys' 24 hours), the create is sent
        again without it and re-attaches to the job of that id as before."""
        job_id = body.get("id")
        if not job_id:
            return self._call("POST", "/v1/jobs", json=body)
        try:
            return self._call("POST", "/v1/jobs", json=body, headers={"Idempotency-Key": idempotency_key_for(job_id)})
        except LLMBatchApiError as exc:
            if exc.code != "idempotency_key_reused":
                raise
            return self._call("POST", "/v1/jobs", json=body)

    def get_job(self, job_id: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/jobs/{job_id}")

    def cancel_job(self, job_id: str) -> dict[str, Any]:
        """Request the cancel (idempotent; an ended job is answered as it is)."""
        return self._call("POST", f"/v1/jobs/{job_id}/cancel")

    def list_jobs(self, **params: Any) -> dict[str, Any]:
        return self._call("GET", "/v1/jobs", params={k: v for k, v in params.items() if v is not None})

    def get_file(self, file_id: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/files/{file_id}")

    def iter_file_lines(self, file_id: str) -> Iterator[bytes]:
        """The lines of a file (e.g. a job's ``output_file_id``), streamed."""
        with self.get_conn() as client, client.stream("GET", f"/v1/files/{file_id}/content") as response:
            if response.is_error:
                response.read()
                _raise_for(response)
            for line in response.iter_lines():
                if line.strip():
                    yield line.encode() if isinstance(line, str) else line

    def read_results(self, file_id: str) -> list[dict[str, Any]]:
        """A results (or errors) file as a list of its JSON lines, in file order."""
        import json

        return [json.loads(line) for line in self.iter_file_lines(file_id)]

    async def aget_job(self, job_id: str) -> dict[str, Any]:
        """``get_job`` for triggers (async; the connection is read once per call)."""
        conn = await self.aget_connection(self.llm_batch_conn_id)
        async with httpx.AsyncClient(**self._client_args(conn)) as client:
            response = await client.get(f"/v1/jobs/{job_id}")
        _raise_for(response)
        return response.json()
