"""``LLMBatchHook``: the llm-batch REST API (native ``/batch/v1/jobs`` route) for Airflow tasks and
triggers, through ``BatchClient``; its Connection: docs/orchestration.md. A refusal raises
``LLMBatchApiError``."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
from airflow.sdk import BaseHook

from llm_batch.infra.api_client import ApiError, BatchClient

TIMEOUT = httpx.Timeout(60.0, connect=10.0)


class LLMBatchApiError(ApiError):
    """The API refused a call: ``status``, its ``message``, the ``param`` it names and its ``code``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(status, message, param, code)
        Exception.__init__(self, f"llm-batch API {status}: {message}" + (f" (field {param})" if param else ""))


@contextmanager
def _refusals() -> Iterator[None]:
    """BatchClient's ApiError as the hook's LLMBatchApiError."""
    try:
        yield
    except ApiError as exc:
        raise LLMBatchApiError(exc.status, exc.message, exc.param, exc.code) from None


def base_url_of(conn: Any) -> str:
    """``<api-server>/batch`` from a Connection's host."""
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
    def _client_of(conn: Any) -> BatchClient:
        return BatchClient(base_url_of(conn), conn.password or None, timeout=TIMEOUT)

    def get_conn(self) -> BatchClient:
        """A new ``BatchClient`` on ``<api-server>/batch`` with the connection's key (close it)."""
        return self._client_of(self.get_connection(self.llm_batch_conn_id))

    def job_id_secret(self) -> str:
        """What makes the operator's job ids unguessable to other owners: the connection's key."""
        return self.get_connection(self.llm_batch_conn_id).password or ""

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """``BatchClient.<method>(*args, **kwargs)`` on a new client."""
        with self.get_conn() as client, _refusals():
            return getattr(client, method)(*args, **kwargs)

    def create_job(self, body: dict[str, Any]) -> dict[str, Any]:
        """``POST /v1/jobs``: the job (with ``id``: the existing job of that id, if yours).

        With an ``id`` the create carries the ``Idempotency-Key`` ``idempotency_key_for(id)``, so a
        retried task gets the first answer back; if that key was used with another body (the task's
        parameters changed), the create is sent again without it and re-attaches to the job.
        """
        job_id = body.get("id")
        if not job_id:
            return self._call("create_job", body)
        try:
            return self._call("create_job", body, idempotency_key=idempotency_key_for(job_id))
        except LLMBatchApiError as exc:
            if exc.code != "idempotency_key_reused":
                raise
            return self._call("create_job", body)

    def get_job(self, job_id: str) -> dict[str, Any]:
        return self._call("get_job", job_id)

    def cancel_job(self, job_id: str) -> dict[str, Any]:
        """Request the cancel (idempotent; an ended job is answered as it is)."""
        return self._call("cancel_job", job_id)

    def list_jobs(self, **params: Any) -> dict[str, Any]:
        return self._call("list_jobs", **params)

    def get_file(self, file_id: str) -> dict[str, Any]:
        return self._call("get_file", file_id)

    def iter_file_lines(self, file_id: str) -> Iterator[bytes]:
        """The lines of a file (e.g. a job's ``output_file_id``), streamed."""
        with self.get_conn() as client, _refusals():
            yield from client.file_lines(file_id)

    def read_results(self, file_id: str) -> list[dict[str, Any]]:
        """A results (or errors) file as a list of its JSON lines, in file order."""
        return [json.loads(line) for line in self.iter_file_lines(file_id)]

    async def aget_job(self, job_id: str) -> dict[str, Any]:
        """``get_job`` for triggers: the request runs in a thread, off the triggerer's event loop."""
        conn = await self.aget_connection(self.llm_batch_conn_id)

        def get() -> dict[str, Any]:
            with self._client_of(conn) as client, _refusals():
                return client.get_job(job_id)

        return await asyncio.to_thread(get)
