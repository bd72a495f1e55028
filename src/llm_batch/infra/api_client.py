"""The HTTP client of llm-batch's batch REST API (the plugin mounted at ``/batch``): the one
the CLI, the dev stack and the Airflow provider's ``LLMBatchHook`` use. Jobs are made, read and
cancelled on the native route only, so every job shows the canonical status words whichever
route or Airflow run created it. Errors: ``ApiError`` (the server's answer), ``httpx.HTTPError``
(no answer)."""
from __future__ import annotations

import hashlib
import os
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import IO, Any

import httpx
import orjson
import tenacity

from llm_batch.core.config import API_KEY_FILE, Settings, get_settings
from llm_batch.core.endpoints import Endpoint
from llm_batch.core.input_formats import INPUT_FORMATS, InputFormat
from llm_batch.core.jobs import TERMINAL_STATUSES


class ApiError(Exception):
    """The API's error answer; ``param`` the field it names, ``code`` a stable word."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(f"HTTP {status}: {message}" + (f" (at {param})" if param else ""))
        self.status = status
        self.message = message
        self.param = param
        self.code = code


class NoApiKey(Exception):
    """No API key is configured: neither LLM_BATCH_API_KEY nor the stored CLI key."""


@dataclass(frozen=True)
class PartialRead:
    status: str
    complete: bool
    lines: Iterator[bytes]


@dataclass(frozen=True)
class JobView:
    """One job as the client shows it (from the native route's ``JobOut``)."""

    id: str
    status: str  # llm_batch.core.jobs.JobStatus
    endpoint: str
    model: str | None
    total: int
    completed: int
    succeeded: int
    failed: int
    created_at: int
    started_at: int | None = None
    ended_at: int | None = None
    output_file: str | None = None
    error_file: str | None = None
    errors: list[str] = field(default_factory=list)  # why it failed or timed out (status_reason)
    labels: dict[str, Any] = field(default_factory=dict)
    queue_position: int | None = None  # while it waits for Airflow to start it (JobOut.queue)
    waiting_for: str | None = None
    replayed: bool = False  # the answer to a create is an earlier create's job (its Idempotency-Key)
    tokens_per_s: float = 0.0

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL_STATUSES

    @property
    def shown_status(self) -> str:
        """The status, or while the job waits for Airflow its place: ``WAITING #2 in queue``."""
        return f"WAITING #{self.queue_position} in queue" if self.queue_position else self.status

    @classmethod
    def of(cls, body: dict[str, Any]) -> JobView:
        counts = body.get("counts") or {}
        queue = body.get("queue") or {}
        reason = body.get("status_reason")
        return cls(
            id=body["id"], status=body["status"], endpoint=body.get("endpoint", ""), model=body.get("model"),
            total=counts.get("total", 0), completed=counts.get("completed", 0),
            succeeded=counts.get("succeeded", 0), failed=counts.get("failed", 0),
            created_at=body.get("created_at", 0), started_at=body.get("started_at"), ended_at=body.get("ended_at"),
            output_file=body.get("output_file_id"), error_file=body.get("error_file_id"),
            errors=[reason] if reason and body["status"] in ("FAILED", "TIMEOUT_EXCEEDED") else [],
            labels=dict(body.get("labels") or {}),
            queue_position=queue.get("position"), waiting_for=queue.get("waiting_for"),
            replayed=bool(body.get("replayed")),
            tokens_per_s=(body.get("usage") or {}).get("tokens_per_s") or 0.0,
        )


def scale_to_jsonl(path: Path, input_format: str, endpoint: str, out: IO[bytes]) -> int:
    """Write a Scale file's requests to `out` as JSONL lines ``{"custom_id": "<position>",
    "body": ...}`` (Scale numbers requests from 0), streamed; returns their count. A scale-v2
    element that is not a request is written as it is, for validation to report. ValueError
    when the file is not its format, or its requests are not for `endpoint`."""
    from llm_batch.core import formats  # heavy

    where = f"{path}: "
    count = 0

    def write(body: Any) -> None:
        nonlocal count
        out.write(orjson.dumps({"custom_id": str(count), "body": body}) + b"\n")
        count += 1

    try:
        if input_format == InputFormat.SCALE_V1:
            with path.open("rb") as stream:
                params = formats.scan_scale_v1_params(stream, where)
            if endpoint != Endpoint.COMPLETIONS:
                raise ValueError(f"{where}scale-v1 content makes /v1/completions requests: its endpoint must be "
                                 f"/v1/completions, not {endpoint} (--endpoint)")
            with path.open("rb") as stream:
                for prompt in formats.scale_v1_prompts(stream, where):
                    write(params.completion_body(prompt))
            return count
        if input_format != InputFormat.SCALE_V2:
            raise ValueError(f"input format {input_format!r} is not a Scale format")
        with path.open("rb") as stream:
            for element in formats._array_elements(stream, where):
                if isinstance(element, dict):
                    if count == 0 and ("messages" in element) != ("prompt" in element):
                        implied = Endpoint.CHAT_COMPLETIONS if "messages" in element else Endpoint.COMPLETIONS
                        if implied != endpoint:
                            raise ValueError(f"{where}its requests are for {implied} (messages: chat, prompt: "
                                             f"completions): its endpoint must be {implied}, not {endpoint} "
                                             "(--endpoint)")
                    element = formats.scale_v2_body(element)
                write(element)
    except formats.InputUnreadable as exc:
        raise ValueError(str(exc)) from None
    return count


class BatchClient:
    """The batch REST API; `api_key` is sent as a Bearer token (none when empty)."""

    def __init__(self, base_url: str, api_key: str | None, *, timeout: float | httpx.Timeout = 120.0,
                 transport: httpx.BaseTransport | None = None):
        self.base_url = base_url.rstrip("/")
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout, transport=transport,
                                  headers={"Authorization": f"Bearer {api_key}"} if api_key else {})

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, *, settings: Settings | None = None) -> BatchClient:
        """The client ``environ`` (default: this process's) configures; NoApiKey without a key."""
        environ = os.environ if environ is None else environ
        url = environ.get("LLM_BATCH_API_URL") or f"http://127.0.0.1:{environ.get('LLM_BATCH_API_PORT', '8080')}/batch"
        key = environ.get("LLM_BATCH_API_KEY")
        if not key:
            path = (settings or get_settings()).home / API_KEY_FILE
            try:
                key = path.read_text().strip()
            except OSError:
                raise NoApiKey("no API key: set LLM_BATCH_API_KEY, or run `llm-batch up` "
                               f"(it stores one in {path})") from None
        return cls(url, key)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> BatchClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, url: str, **kwargs: Any) -> Any:
        if method == "GET":  # safe to repeat: ride out a busy server (SQLite locked: 500)
            response = send_with_retries(lambda: self._http.request(method, url, **kwargs))
        else:
            response = self._http.request(method, url, **kwargs)
        _raise_for(response)
        return response.json()

    @contextmanager
    def _stream(self, url: str, params: dict[str, Any] | None = None) -> Iterator[httpx.Response]:
        with self._http.stream("GET", url, params=params) as response:
            if response.is_error:
                response.read()
                _raise_for(response)
            yield response

    def upload(self, path: Path, idempotency_key: str | None = None) -> str:
        with path.open("rb") as data:
            return self.upload_stream(data, path.name, idempotency_key)

    def upload_stream(self, data: IO[bytes], filename: str, idempotency_key: str | None = None) -> str:
        return self._call("POST", "/v1/files", files={"file": (filename, data, "application/jsonl")},
                          data={"purpose": "batch"}, headers=_key_header(idempotency_key))["id"]

    def get_file(self, file_id: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/files/{file_id}")

    def file_content(self, file_id: str) -> Iterator[bytes]:
        with self._stream(f"/v1/files/{file_id}/content") as response:
            yield from response.iter_bytes()

    def file_lines(self, file_id: str) -> Iterator[bytes]:
        """A file's non-blank lines, streamed."""
        with self._stream(f"/v1/files/{file_id}/content") as response:
            yield from (line.encode() for line in response.iter_lines() if line.strip())

    @contextmanager
    def partial_results(self, job_id: str, order: str = "input", start: int = 0) -> Iterator[PartialRead]:
        """``GET /v1/jobs/{id}/results``: the job's finished lines so far, streamed."""
        with self._stream(f"/v1/jobs/{job_id}/results", params={"order": order, "start": start}) as response:
            yield PartialRead(
                status=response.headers.get("X-Job-Status", ""),
                complete=response.headers.get("X-Results-Complete") == "true",
                lines=(line.encode() for line in response.iter_lines() if line.strip()),
            )

    def create_job(self, body: dict[str, Any], idempotency_key: str | None = None) -> dict[str, Any]:
        """A replay of an earlier create with the same key answers that job now, ``"replayed": True``."""
        response = self._http.request("POST", "/v1/jobs", json=body, headers=_key_header(idempotency_key))
        _raise_for(response)
        if response.headers.get("Idempotent-Replayed") == "true":
            return {**self.get_job(response.json()["id"]), "replayed": True}
        return response.json()

    def get_job(self, job_id: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/jobs/{job_id}")

    def cancel_job(self, job_id: str) -> dict[str, Any]:
        return self._call("POST", f"/v1/jobs/{job_id}/cancel")

    def retry_job(self, job_id: str, idempotency_key: str | None = None) -> dict[str, Any]:
        """A new job of the ended job's failed and never-run lines; 409 when there are none."""
        return self._call("POST", f"/v1/jobs/{job_id}/retry", headers=_key_header(idempotency_key))

    def rerun_job(self, job_id: str, idempotency_key: str | None = None) -> dict[str, Any]:
        """A new job of the ended job's whole input."""
        return self._call("POST", f"/v1/jobs/{job_id}/rerun", headers=_key_header(idempotency_key))

    def list_jobs(self, **params: Any) -> dict[str, Any]:
        """A page ``{"data", "next_cursor", "has_more"}``, newest first."""
        return self._call("GET", "/v1/jobs", params=_given(params))

    def submit(self, path: Path, *, endpoint: str, model: str, shards: int = 1, input_format: str = "jsonl",
               max_runtime_sec: int | None = None, output_path: str | None = None,
               metadata: dict[str, str] | None = None, model_config: dict[str, Any] | None = None,
               idempotency_key: str | None = None, new: bool = False, output_check: dict[str, Any] | None = None,
               result_cache: bool = True, priority: str | int | None = None,
               spec: dict[str, Any] | None = None) -> JobView:
        """Upload the file and create one job of it (``spec``: more JobSpec fields, sent as given).
        Retry-safe: the upload and the create carry `idempotency_key`, else ``submit_key`` of the
        file's content and these arguments, so the same submit answers the same job; ``new=True`` sends none."""
        if input_format not in INPUT_FORMATS:
            raise ValueError(f"input format {input_format!r} is unknown; use one of {', '.join(INPUT_FORMATS)}")
        key = None if new else idempotency_key or submit_key(
            path, endpoint=endpoint, model=model, shards=shards, input_format=input_format,
            max_runtime_sec=max_runtime_sec, output_path=output_path, metadata=metadata, model_config=model_config,
            # only when given: the key of a submit without them stays what it was
            **_given({"output_check": output_check, "result_cache": None if result_cache else False,
                      "priority": priority or None, "spec": spec or None}),
        )
        upload_key = f"{key}:upload"[:255] if key else None
        if input_format == InputFormat.JSONL:
            file_id = self.upload(path, idempotency_key=upload_key)
        else:
            with tempfile.TemporaryFile(prefix="llm-batch-", suffix=".jsonl") as converted:
                scale_to_jsonl(path, input_format, endpoint, converted)
                converted.flush()
                file_id = self.upload_stream(converted, f"{path.stem}.jsonl", idempotency_key=upload_key)
        body = {**(spec or {}), **_job_body(
            file_id, endpoint, model, shards, max_runtime_sec=max_runtime_sec, model_config=model_config or None,
            output_uri=output_path, labels=metadata or None,
            output_check=output_check,  # an empty check too: the server says what it lacks
            result_cache=None if result_cache else False, priority=priority or None)}
        return JobView.of(self.create_job(body, idempotency_key=key))

    def job(self, job_id: str) -> JobView:
        return JobView.of(self.get_job(job_id))

    def jobs(self, limit: int = 20, search: str | None = None) -> list[JobView]:
        """The caller's newest jobs; with `search`, those whose id, input file or labels match it."""
        return [JobView.of(body) for body in self.list_jobs(limit=limit, q=search)["data"]]

    def cancel(self, job_id: str) -> JobView:
        return JobView.of(self.cancel_job(job_id))

    def wait(self, job_id: str, *, poll: float = 2.0, timeout: float | None = None, on_update=None) -> JobView:
        """Poll until the job is over (TimeoutError after `timeout` s), ``on_update(job)`` after each poll."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            job = self.job(job_id)
            if on_update is not None:
                on_update(job)
            if job.terminal:
                return job
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {job.status} after {timeout:.0f}s")
            time.sleep(poll)

    def usage(self, by: str | None = None, since: datetime | None = None) -> dict[str, Any]:
        params = {"by": by, "since": since.isoformat() if since is not None else None}
        return self._call("GET", "/v1/usage", params=_given(params))

    def create_webhook(self, url: str, events: list[str] | None = None, description: str = "") -> dict[str, Any]:
        """A new endpoint for the caller's job-end events; the answer's ``secret`` is shown only now."""
        return self._call("POST", "/v1/webhooks", json=_given({"url": url, "description": description,
                                                                "events": events or None}))

    def webhooks(self) -> list[dict[str, Any]]:
        return self._call("GET", "/v1/webhooks")["data"]

    def delete_webhook(self, endpoint_id: str) -> dict[str, Any]:
        return self._call("DELETE", f"/v1/webhooks/{endpoint_id}")

    def test_webhook(self, endpoint_id: str, event_type: str = "batch.completed") -> dict[str, Any]:
        """Send one signed test event now; what the receiver answered."""
        return self._call("POST", f"/v1/webhooks/{endpoint_id}/test", json={"event_type": event_type})

    def webhook_attempts(self, endpoint_id: str, limit: int = 20) -> list[dict[str, Any]]:
        """The endpoint's delivery attempts, newest first."""
        return self._call("GET", f"/v1/webhooks/{endpoint_id}/attempts", params={"limit": limit})["data"]

    def estimate(self, path: Path, *, model: str, endpoint: str = "/v1/chat/completions", shards: int = 1,
                 model_config: dict[str, Any] | None = None) -> dict[str, Any]:
        """The dry run of submitting the JSONL file `path` (uploaded for the server to validate, then deleted)."""
        file_id = self.upload(path)
        try:
            body = _job_body(file_id, endpoint, model, shards, dry_run=True, model_config=model_config or None)
            return self._call("POST", "/v1/jobs", json=body)
        finally:
            self._call("DELETE", f"/v1/files/{file_id}")


def submit_key(path: Path, **arguments: Any) -> str:
    """The ``Idempotency-Key`` of submitting `path` with `arguments`: one per command and file content."""
    with path.open("rb") as data:
        content = hashlib.file_digest(data, "sha256")
    given = orjson.dumps(arguments, option=orjson.OPT_SORT_KEYS)
    return f"llm-batch-cli:{hashlib.sha256(content.hexdigest().encode() + b':' + given).hexdigest()}"


def _key_header(idempotency_key: str | None) -> dict[str, str]:
    return {"Idempotency-Key": idempotency_key} if idempotency_key else {}


def _given(params: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in params.items() if v is not None}


def _job_body(file_id: str, endpoint: str, model: str, shards: int, **optional: Any) -> dict[str, Any]:
    return {"input_file_ids": [file_id], "endpoint": endpoint, "model": model, "data_parallelism": shards,
            **_given(optional)}


def send_with_retries(send: Callable[[], httpx.Response]) -> httpx.Response:
    """`send()` again (up to 4 tries, backing off) on 5xx answers and transport errors; the
    last answer as it was (Airflow on SQLite answers 500 "database is locked" while busy)."""
    transient = tenacity.retry_if_result(lambda response: response.status_code in (500, 502, 503, 504))
    retry = tenacity.Retrying(
        stop=tenacity.stop_after_attempt(4), wait=tenacity.wait_exponential(multiplier=0.5, max=4),
        retry=tenacity.retry_if_exception_type(httpx.TransportError) | transient,
        retry_error_callback=lambda state: state.outcome.result(),
        reraise=True)
    return retry(send)


def _raise_for(response: httpx.Response) -> None:
    """ApiError of an error answer: the OpenAI shape ``{"error": {...}}``, or the others'
    ``{"detail", "message", "param", "code"}`` (Airflow's bare ``{"detail"}`` too)."""
    if not response.is_error:
        return
    try:
        body = response.json()
    except ValueError:
        raise ApiError(response.status_code, response.text[:500] or response.reason_phrase) from None
    if not isinstance(body, dict):
        raise ApiError(response.status_code, orjson.dumps(body).decode()[:500])
    if isinstance(body.get("error"), dict):  # the OpenAI shape
        error = body["error"]
        raise ApiError(response.status_code, str(error.get("message")), error.get("param"), error.get("code"))
    detail = body.get("message") if isinstance(body.get("message"), str) else body.get("detail")
    raise ApiError(response.status_code, detail if isinstance(detail, str) else orjson.dumps(detail).decode(),
                   body.get("param"), body.get("code"))
