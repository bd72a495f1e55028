"""A small HTTP client of llm-batch's batch REST API (the plugin mounted at ``/batch``).

    client = BatchClient.from_env()
    job = client.submit(Path("batch.jsonl"), endpoint="/v1/chat/completions", model="m", shards=2)
    job = client.job(job.id)            # JobView: status, counts, output/error file ids
    for chunk in client.file_content(job.output_file): ...

Which route a submission takes (the API has three dialects; none carries everything):
- the Mistral route (upload the file to ``/v1/files``, then ``POST /v1/batch/jobs``) when
  the request fits it: a JSONL file, one shard, a deadline in whole hours, no engine
  settings (``model_config``). It keeps the
  file's custom_ids and takes any file size.
- the Scale route (``POST /v2/batch-completions`` with the requests as inline ``content``)
  otherwise: it alone carries ``data_parallelism`` (shards), a deadline in seconds,
  ``model_config`` and the Scale input formats. A JSONL file's bodies become Scale v2 items, so custom_ids become
  the requests' 0-based positions (as Scale defines them); Scale also needs an output path
  on the server (``output_data_path``), by default ``outputs/...`` in the caller's own folder there.
Jobs of both routes are read through the Mistral route (``GET /v1/batch/jobs/{id}``, which
serves any job of the caller), so every job looks the same to the CLI.

Errors: ``ApiError`` (the server's answer: status, message, param) and ``httpx.HTTPError``
(no answer). Configuration: ``LLM_BATCH_API_URL`` (default: the embedded stack's
``http://127.0.0.1:$LLM_BATCH_API_PORT/batch``) and ``LLM_BATCH_API_KEY`` (default: the key
``llm-batch up`` stored in ``$LLM_BATCH_HOME/api-key``).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import orjson
import tenacity

from llm_batch.core.config import Settings, get_settings
from llm_batch.core.input_formats import INPUT_FORMATS

# Mistral status words (the route every job is read through) -> is the job over.
TERMINAL_STATUSES = frozenset({"SUCCESS", "FAILED", "TIMEOUT_EXCEEDED", "CANCELLED"})
_HOUR = 3600


class ApiError(Exception):
    """The API answered with an error: ``status``, ``message`` and, if given, ``param``."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(f"HTTP {status}: {message}" + (f" (at {param})" if param else ""))
        self.status = status
        self.message = message
        self.param = param


class NoApiKey(Exception):
    """No API key is configured: neither LLM_BATCH_API_KEY nor the stored CLI key."""


@dataclass(frozen=True)
class JobView:
    """One job as the client shows it (built from the Mistral route's BatchJobOut)."""

    id: str
    status: str  # Mistral words: QUEUED, RUNNING, SUCCESS, FAILED, TIMEOUT_EXCEEDED, ...
    endpoint: str
    model: str | None
    total: int
    completed: int
    succeeded: int
    failed: int
    created_at: int
    started_at: int | None = None
    completed_at: int | None = None
    output_file: str | None = None
    error_file: str | None = None
    errors: list[str] = field(default_factory=list)

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL_STATUSES

    @classmethod
    def of(cls, body: dict[str, Any]) -> JobView:
        return cls(
            id=body["id"],
            status=body["status"],
            endpoint=body.get("endpoint", ""),
            model=body.get("model"),
            total=body.get("total_requests", 0),
            completed=body.get("completed_requests", 0),
            succeeded=body.get("succeeded_requests", 0),
            failed=body.get("failed_requests", 0),
            created_at=body.get("created_at", 0),
            started_at=body.get("started_at"),
            completed_at=body.get("completed_at"),
            output_file=body.get("output_file"),
            error_file=body.get("error_file"),
            errors=[str(e.get("message")) for e in body.get("errors") or []],
        )


def default_base_url() -> str:
    return os.environ.get("LLM_BATCH_API_URL") or (
        f"http://127.0.0.1:{os.environ.get('LLM_BATCH_API_PORT', '8080')}/batch"
    )


def default_api_key(settings: Settings | None = None) -> str:
    """LLM_BATCH_API_KEY, else the key ``llm-batch up`` stored; raises NoApiKey."""
    from llm_batch.core.config import API_KEY_FILE

    key = os.environ.get("LLM_BATCH_API_KEY")
    if key:
        return key
    path = (settings or get_settings()).home / API_KEY_FILE
    try:
        return path.read_text().strip()
    except OSError:
        raise NoApiKey(
            f"no API key: set LLM_BATCH_API_KEY, or run `llm-batch up` (it stores one in {path})"
        ) from None


def uses_mistral_route(
    input_format: str, shards: int, max_runtime_sec: int | None, model_config: dict[str, Any] | None = None
) -> bool:
    """Whether a submission fits the Mistral route (see the module docstring)."""
    whole_hours = max_runtime_sec is None or max_runtime_sec % _HOUR == 0
    return input_format == "jsonl" and shards == 1 and whole_hours and not model_config


def scale_content(path: Path, input_format: str) -> list[dict[str, Any]] | dict[str, Any]:
    """A file's requests as Scale ``content``: scale-v1/v2 files as they are, JSONL lines'
    bodies as Scale v2 items. Raises ValueError naming the line that cannot be sent."""
    if input_format != "jsonl":
        try:
            return orjson.loads(path.read_bytes())
        except orjson.JSONDecodeError as exc:
            raise ValueError(f"{path}: not a JSON document ({input_format}): {exc}") from None
    items = []
    with path.open("rb") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                body = orjson.loads(line).get("body")
            except (orjson.JSONDecodeError, AttributeError):
                raise ValueError(f"{path}:{number}: not a JSON object") from None
            if not isinstance(body, dict):
                raise ValueError(f"{path}:{number}: no 'body' object")
            items.append(body)
    return items


class BatchClient:
    """The batch REST API, authenticated with an API key (``Authorization: Bearer``)."""

    def __init__(
        self, base_url: str, api_key: str, *, timeout: float = 120.0, transport: httpx.BaseTransport | None = None
    ):
        self.base_url = base_url.rstrip("/")
        self._http = httpx.Client(
            base_url=self.base_url, headers={"Authorization": f"Bearer {api_key}"}, timeout=timeout,
            transport=transport,
        )

    @classmethod
    def from_env(cls) -> BatchClient:
        return cls(default_base_url(), default_api_key())

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> BatchClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- requests -------------------------------------------------------------------------

    def _call(self, method: str, url: str, **kwargs: Any) -> Any:
        if method == "GET":  # safe to repeat: ride out a busy server (SQLite locked: 500)
            response = send_with_retries(lambda: self._http.request(method, url, **kwargs))
        else:
            response = self._http.request(method, url, **kwargs)
        _raise_for(response)
        return response.json()

    def upload(self, path: Path, idempotency_key: str | None = None) -> str:
        """Upload a JSONL input file; returns its file id. With `idempotency_key` (sent as
        ``Idempotency-Key``) uploading the same content again answers the same file."""
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        with path.open("rb") as data:
            body = self._call("POST", "/v1/files", files={"file": (path.name, data)}, data={"purpose": "batch"},
                              headers=headers)
        return body["id"]

    def submit(
        self,
        path: Path,
        *,
        endpoint: str,
        model: str,
        shards: int = 1,
        input_format: str = "jsonl",
        max_runtime_sec: int | None = None,
        output_path: str | None = None,
        metadata: dict[str, str] | None = None,
        model_config: dict[str, Any] | None = None,
        idempotency_key: str | None = None,
        new: bool = False,
    ) -> JobView:
        """Submit the file as one job (route: see the module docstring); returns the job.

        ``model_config``: Scale's fields beside the model (``engine_args``, ``seed``,
        ``max_context_length``, ...); only the Scale route carries it.

        Retry-safe by default: the create (and the upload) carry an ``Idempotency-Key``,
        `idempotency_key` or else ``submit_key(...)`` of the file's content and these
        arguments, so submitting the same file with the same arguments again (within the
        server's 24 hours) answers the same job. ``new=True`` sends no key: always a new job."""
        if input_format not in INPUT_FORMATS:
            raise ValueError(f"input format {input_format!r} is unknown; use one of {', '.join(INPUT_FORMATS)}")
        key = None if new else idempotency_key or submit_key(
            path, endpoint=endpoint, model=model, shards=shards, input_format=input_format,
            max_runtime_sec=max_runtime_sec, output_path=output_path, metadata=metadata, model_config=model_config,
        )
        headers = {"Idempotency-Key": key} if key else {}
        if uses_mistral_route(input_format, shards, max_runtime_sec, model_config):
            file_id = self.upload(path, idempotency_key=f"{key}:upload"[:255] if key else None)
            body: dict[str, Any] = {"input_files": [file_id], "endpoint": endpoint, "model": model}
            if max_runtime_sec is not None:
                body["timeout_hours"] = max(1, math.ceil(max_runtime_sec / _HOUR))
            if metadata:
                body["metadata"] = metadata
            return JobView.of(self._call("POST", "/v1/batch/jobs", json=body, headers=headers))
        content = scale_content(path, input_format)
        # With a key the default output path follows it (a retry must send the same body).
        default_output = default_output_path(path) if key is None else f"outputs/{path.stem}-{_digest(key)[:16]}.json"
        body = {
            "content": content,
            "output_data_path": output_path or default_output,
            "model_config": {**(model_config or {}), "model": model},
            "data_parallelism": shards,
            "labels": metadata or {},
        }
        if max_runtime_sec is not None:
            body["max_runtime_sec"] = max_runtime_sec
        created = self._call("POST", "/v2/batch-completions", json=body, headers=headers)
        job = self.job(created["job_id"])
        if job.endpoint != endpoint:
            # Scale infers the endpoint from the items (messages: chat; prompt: completions).
            raise ValueError(
                f"job {job.id} runs {job.endpoint}, not {endpoint}: with --shards the endpoint "
                "follows the requests (messages: chat, prompt: completions)"
            )
        return job

    # The native route's canonical status -> the words JobView shows (Mistral's).
    _SHOWN_STATUS = {"VALIDATING": "RUNNING", "FINALIZING": "RUNNING", "CANCELLING": "CANCELLATION_REQUESTED",
                     "SUCCEEDED": "SUCCESS"}

    @classmethod
    def _view(cls, body: dict[str, Any]) -> JobView:
        """A JobView of the native route's job (``GET /v1/jobs/{id}``)."""
        counts = body.get("counts") or {}
        errors = [body["status_reason"]] if body.get("status_reason") and body["status"] in ("FAILED", "TIMEOUT_EXCEEDED") else []
        return JobView(
            id=body["id"],
            status=cls._SHOWN_STATUS.get(body["status"], body["status"]),
            endpoint=body.get("endpoint", ""),
            model=body.get("model"),
            total=counts.get("total", 0),
            completed=counts.get("completed", 0),
            succeeded=counts.get("succeeded", 0),
            failed=counts.get("failed", 0),
            created_at=body.get("created_at", 0),
            started_at=body.get("started_at"),
            completed_at=body.get("ended_at"),
            output_file=body.get("output_file_id"),
            error_file=body.get("error_file_id"),
            errors=errors,
        )

    def job(self, job_id: str) -> JobView:
        return self._view(self._call("GET", f"/v1/jobs/{job_id}"))

    def jobs(self, limit: int = 20) -> list[JobView]:
        """The caller's newest jobs, newest first: every route's and every Airflow run's
        (the native route lists them all)."""
        return [self._view(body) for body in self._call("GET", "/v1/jobs", params={"limit": limit})["data"]]

    def cancel(self, job_id: str) -> JobView:
        return JobView.of(self._call("POST", f"/v1/batch/jobs/{job_id}/cancel"))

    def usage(self, by: str | None = None, since: datetime | None = None) -> dict[str, Any]:
        """``GET /v1/usage`` (admins only): ``{"object": "list", "by", "since", "data": [...]}``,
        one entry per group (owner, model, label ``key=value``; one ``(all)`` without `by`)."""
        params = {"by": by, "since": since.isoformat() if since is not None else None}
        return self._call("GET", "/v1/usage", params={k: v for k, v in params.items() if v is not None})

    # -- webhooks (/v1/webhooks; docs/api.md "Webhooks") ------------------------------

    def create_webhook(self, url: str, events: list[str] | None = None, description: str = "") -> dict[str, Any]:
        """A new endpoint for the caller's job-end events; the answer's ``secret`` is shown only now."""
        body: dict[str, Any] = {"url": url, "description": description}
        if events:
            body["events"] = events
        return self._call("POST", "/v1/webhooks", json=body)

    def webhooks(self) -> list[dict[str, Any]]:
        return self._call("GET", "/v1/webhooks")["data"]

    def webhook(self, endpoint_id: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/webhooks/{endpoint_id}")

    def delete_webhook(self, endpoint_id: str) -> dict[str, Any]:
        return self._call("DELETE", f"/v1/webhooks/{endpoint_id}")

    def test_webhook(self, endpoint_id: str, event_type: str = "batch.completed") -> dict[str, Any]:
        """Send one signed test event now; what the receiver answered."""
        return self._call("POST", f"/v1/webhooks/{endpoint_id}/test", json={"event_type": event_type})

    def webhook_attempts(self, endpoint_id: str, limit: int = 20) -> list[dict[str, Any]]:
        """The endpoint's delivery attempts, newest first."""
        return self._call("GET", f"/v1/webhooks/{endpoint_id}/attempts", params={"limit": limit})["data"]

    def file_content(self, file_id: str) -> Iterator[bytes]:
        """A file's content, streamed."""
        with self._http.stream("GET", f"/v1/files/{file_id}/content") as response:
            if response.is_error:
                response.read()
                _raise_for(response)
            yield from response.iter_bytes()

    def wait(self, job_id: str, *, poll: float = 2.0, timeout: float | None = None, on_update=None) -> JobView:
        """Poll until the job is over (or `timeout` s pass: TimeoutError); ``on_update(job)``
        is called after every poll."""
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


def _digest(text: str) -> str:
    import hashlib

    return hashlib.sha256(text.encode()).hexdigest()


def submit_key(path: Path, **arguments: Any) -> str:
    """The ``Idempotency-Key`` of submitting `path` with `arguments` (BatchClient.submit's):
    ``llm-batch-cli:`` + sha256 of the file's sha256 and the arguments, so the same command
    on the same file content names the same job."""
    import hashlib

    content = hashlib.sha256()
    with path.open("rb") as data:
        while chunk := data.read(1 << 20):
            content.update(chunk)
    given = orjson.dumps(arguments, option=orjson.OPT_SORT_KEYS)
    return f"llm-batch-cli:{_digest(content.hexdigest() + ':' + given.decode())}"


def default_output_path(path: Path) -> str:
    """Where a Scale-route job writes its JSON results on the server when none is given:
    ``outputs/<file stem>-<UTC time>.json``, relative, so in the caller's own folder of the
    server's first local root (llm_batch.infra.user_paths)."""
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S%f")
    return f"outputs/{path.stem}-{stamp}.json"


def _transient(outcome: Any) -> bool:
    return isinstance(outcome, httpx.Response) and outcome.status_code in (500, 502, 503, 504)


def send_with_retries(send: Callable[[], httpx.Response]) -> httpx.Response:
    """`send()` again (up to 4 tries, backing off) on 5xx answers and transport errors; the
    last answer is returned as it was. (Airflow on SQLite answers 500 "database is locked"
    while its scheduler writes: the CLI and ``llm-batch up`` try again.)"""
    retry = tenacity.Retrying(
        stop=tenacity.stop_after_attempt(4),
        wait=tenacity.wait_exponential(multiplier=0.5, max=4),
        retry=tenacity.retry_if_exception_type(httpx.TransportError) | tenacity.retry_if_result(_transient),
        retry_error_callback=lambda state: state.outcome.result(),  # the last answer, as it was
        reraise=True,
    )
    return retry(send)


def _raise_for(response: httpx.Response) -> None:
    if not response.is_error:
        return
    try:
        body = response.json()
    except ValueError:
        raise ApiError(response.status_code, response.text[:500] or response.reason_phrase) from None
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):  # the OpenAI shape
        raise ApiError(response.status_code, str(error.get("message")), error.get("param"))
    detail = body.get("detail") if isinstance(body, dict) else body
    param = body.get("param") if isinstance(body, dict) else None
    raise ApiError(response.status_code, detail if isinstance(detail, str) else orjson.dumps(detail).decode(), param)
