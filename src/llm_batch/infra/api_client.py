"""The HTTP client of llm-batch's batch REST API (the plugin mounted at ``/batch``): the one
the CLI, the dev stack and the Airflow provider's ``LLMBatchHook`` use.

    client = BatchClient.from_env()
    job = client.submit(Path("batch.jsonl"), endpoint="/v1/chat/completions", model="m", shards=2)
    job = client.job(job.id)            # JobView: status, counts, output/error file ids
    for chunk in client.file_content(job.output_file): ...

How a submission travels (whatever its options):
1. the file is uploaded to ``POST /v1/files`` as multipart, streamed from disk in chunks
   (the client never holds the file in memory; any size up to the server's upload limit);
   a Scale file (``scale-v2``, ``scale-v1``) is first converted to JSONL lines in a temporary
   file, streamed too (``scale_to_jsonl``);
2. the job is created with ``POST /v1/jobs`` (the native route) naming that file
   (``input_file_ids``) with the endpoint, model, shards (``data_parallelism``), deadline
   (``max_runtime_sec``), ``model_config``, ``labels`` and ``output_uri``.
A JSONL file's custom_ids are the job's; a Scale file's requests get their 0-based
positions ("0", "1", ...), as Scale numbers them.

Jobs are read, listed and cancelled through the same native route (``/v1/jobs``), so a job
shows the canonical status words (``llm_batch.core.jobs.JobStatus``: QUEUED, VALIDATING,
RUNNING, FINALIZING, CANCELLING, SUCCEEDED, FAILED, TIMEOUT_EXCEEDED, CANCELLED) whichever
route or Airflow run created it.

Errors: ``ApiError`` (the server's answer: status, message, param, code) and
``httpx.HTTPError`` (no answer). Reads (GET) are tried again on 5xx answers and transport
errors (``send_with_retries``). Configuration: ``LLM_BATCH_API_URL`` (default: the embedded
stack's ``http://127.0.0.1:$LLM_BATCH_API_PORT/batch``) and ``LLM_BATCH_API_KEY`` (default:
the key ``llm-batch up`` stored in ``$LLM_BATCH_HOME/api-key``).
"""

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
    """The API answered with an error: ``status``, ``message`` and, if given, ``param`` (the
    field it names) and ``code`` (a stable word, e.g. ``idempotency_key_reused``)."""

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
    """A partial read's answer: the job's status, whether it has ended, its finished lines."""

    status: str
    complete: bool
    lines: Iterator[bytes]


@dataclass(frozen=True)
class JobView:
    """One job as the client shows it (built from the native route's job, ``JobOut``)."""

    id: str
    status: str  # the canonical words (llm_batch.core.jobs.JobStatus): QUEUED, ..., SUCCEEDED, ...
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
    tokens_per_s: float = 0.0  # generated tokens per engine second (JobUsage.tokens_per_s)

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL_STATUSES

    @property
    def shown_status(self) -> str:
        """The status, or while the job waits for Airflow to start it its place: ``WAITING #2 in queue``."""
        return f"WAITING #{self.queue_position} in queue" if self.queue_position else self.status

    @classmethod
    def of(cls, body: dict[str, Any]) -> JobView:
        """A JobView of the native route's job (``GET /v1/jobs/{id}``)."""
        counts = body.get("counts") or {}
        reason = body.get("status_reason")
        return cls(
            id=body["id"],
            status=body["status"],
            endpoint=body.get("endpoint", ""),
            model=body.get("model"),
            total=counts.get("total", 0),
            completed=counts.get("completed", 0),
            succeeded=counts.get("succeeded", 0),
            failed=counts.get("failed", 0),
            created_at=body.get("created_at", 0),
            started_at=body.get("started_at"),
            ended_at=body.get("ended_at"),
            output_file=body.get("output_file_id"),
            error_file=body.get("error_file_id"),
            errors=[reason] if reason and body["status"] in ("FAILED", "TIMEOUT_EXCEEDED") else [],
            labels=dict(body.get("labels") or {}),
            queue_position=(body.get("queue") or {}).get("position"),
            waiting_for=(body.get("queue") or {}).get("waiting_for"),
            replayed=bool(body.get("replayed")),
            tokens_per_s=(body.get("usage") or {}).get("tokens_per_s") or 0.0,
        )


def default_base_url(environ: Mapping[str, str] | None = None) -> str:
    """LLM_BATCH_API_URL of ``environ`` (default: this process's environment), else the
    embedded stack's URL on its LLM_BATCH_API_PORT."""
    environ = os.environ if environ is None else environ
    return environ.get("LLM_BATCH_API_URL") or (
        f"http://127.0.0.1:{environ.get('LLM_BATCH_API_PORT', '8080')}/batch"
    )


def default_api_key(settings: Settings | None = None, environ: Mapping[str, str] | None = None) -> str:
    """LLM_BATCH_API_KEY of ``environ`` (default: this process's environment), else the key
    ``llm-batch up`` stored; raises NoApiKey."""
    key = (os.environ if environ is None else environ).get("LLM_BATCH_API_KEY")
    if key:
        return key
    path = (settings or get_settings()).home / API_KEY_FILE
    try:
        return path.read_text().strip()
    except OSError:
        raise NoApiKey(
            f"no API key: set LLM_BATCH_API_KEY, or run `llm-batch up` (it stores one in {path})"
        ) from None


def scale_to_jsonl(path: Path, input_format: str, endpoint: str, out: IO[bytes]) -> int:
    """Write a Scale file's requests to `out` as JSONL lines ``{"custom_id": "<position>",
    "body": ...}``, streamed (ijson: one request in memory at a time); returns their count.

    ``scale-v2`` (a JSON array of ``prompt`` or ``messages`` requests): each element's body as
    the pipeline reads it (``llm_batch.core.formats.scale_v2_body``); an element that is not
    a request is written as it is, for the job's validation to report as that request's
    error. ``scale-v1`` (``{"prompts": [...], shared fields}``): one /v1/completions body per
    prompt. Raises ValueError when the file cannot be read as its format, or its requests
    are not for `endpoint` (scale-v1: /v1/completions; scale-v2: its first request's kind,
    messages: chat, prompt: completions)."""
    from llm_batch.core.formats import (  # heavy
        InputUnreadable,
        _array_elements,
        scale_v1_prompts,
        scale_v2_body,
        scan_scale_v1_params,
    )

    where = f"{path}: "
    count = 0

    def write(body: Any) -> None:
        nonlocal count
        out.write(orjson.dumps({"custom_id": str(count), "body": body}) + b"\n")
        count += 1

    try:
        if input_format == InputFormat.SCALE_V1:
            with path.open("rb") as stream:
                params = scan_scale_v1_params(stream, where)
            if endpoint != Endpoint.COMPLETIONS:
                raise ValueError(f"{where}scale-v1 content makes /v1/completions requests: its endpoint must be "
                                 f"/v1/completions, not {endpoint} (--endpoint)")
            with path.open("rb") as stream:
                for prompt in scale_v1_prompts(stream, where):
                    write(params.completion_body(prompt))
            return count
        if input_format != InputFormat.SCALE_V2:
            raise ValueError(f"input format {input_format!r} is not a Scale format")
        with path.open("rb") as stream:
            for element in _array_elements(stream, where):
                if isinstance(element, dict):
                    if count == 0 and ("messages" in element) != ("prompt" in element):
                        implied = Endpoint.CHAT_COMPLETIONS if "messages" in element else Endpoint.COMPLETIONS
                        if implied != endpoint:
                            raise ValueError(f"{where}its requests are for {implied} (messages: chat, prompt: "
                                             f"completions): its endpoint must be {implied}, not {endpoint} "
                                             "(--endpoint)")
                    element = scale_v2_body(element)
                write(element)
    except InputUnreadable as exc:
        raise ValueError(str(exc)) from None
    return count


class BatchClient:
    """The batch REST API, authenticated with an API key (``Authorization: Bearer``; none
    sent when `api_key` is empty)."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None,
        *,
        timeout: float | httpx.Timeout = 120.0,
        transport: httpx.BaseTransport | None = None,
    ):
        self.base_url = base_url.rstrip("/")
        self._http = httpx.Client(
            base_url=self.base_url, headers={"Authorization": f"Bearer {api_key}"} if api_key else {},
            timeout=timeout, transport=transport,
        )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, *, settings: Settings | None = None) -> BatchClient:
        """The client the variables of ``environ`` (default: this process's environment)
        configure, with the key ``llm-batch up`` stored in ``settings``' home when they name none."""
        return cls(default_base_url(environ), default_api_key(settings, environ))

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

    @contextmanager
    def _stream(self, url: str, params: dict[str, Any] | None = None) -> Iterator[httpx.Response]:
        with self._http.stream("GET", url, params=params) as response:
            if response.is_error:
                response.read()
                _raise_for(response)
            yield response

    # -- files ----------------------------------------------------------------------------

    def upload(self, path: Path, idempotency_key: str | None = None) -> str:
        """Upload a JSONL input file, streamed from disk; returns its file id. With
        `idempotency_key` (sent as ``Idempotency-Key``) uploading the same content again
        answers the same file."""
        with path.open("rb") as data:
            return self.upload_stream(data, path.name, idempotency_key)

    def upload_stream(self, data: IO[bytes], filename: str, idempotency_key: str | None = None) -> str:
        """Upload an open binary file (read from its start in chunks, never whole)."""
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        body = self._call("POST", "/v1/files", files={"file": (filename, data, "application/jsonl")},
                          data={"purpose": "batch"}, headers=headers)
        return body["id"]

    def get_file(self, file_id: str) -> dict[str, Any]:
        """``GET /v1/files/{id}``: the file object."""
        return self._call("GET", f"/v1/files/{file_id}")

    def file_content(self, file_id: str) -> Iterator[bytes]:
        """A file's content, streamed."""
        with self._stream(f"/v1/files/{file_id}/content") as response:
            yield from response.iter_bytes()

    def file_lines(self, file_id: str) -> Iterator[bytes]:
        """A file's non-blank lines (e.g. a job's results, one JSON object each), streamed."""
        with self._stream(f"/v1/files/{file_id}/content") as response:
            for line in response.iter_lines():
                if line.strip():
                    yield line.encode()

    @contextmanager
    def partial_results(self, job_id: str, order: str = "input", start: int = 0) -> Iterator[PartialRead]:
        """``GET /v1/jobs/{id}/results``: the job's finished lines so far, streamed."""
        with self._stream(f"/v1/jobs/{job_id}/results", params={"order": order, "start": start}) as response:
            yield PartialRead(
                status=response.headers.get("X-Job-Status", ""),
                complete=response.headers.get("X-Results-Complete") == "true",
                lines=(line.encode() for line in response.iter_lines() if line.strip()),
            )

    # -- jobs: the native route (/v1/jobs), answers as the API gives them -------------------

    def create_job(self, body: dict[str, Any], idempotency_key: str | None = None) -> dict[str, Any]:
        """``POST /v1/jobs`` with `body` (``llm_batch.api.native.models.CreateJob``): the job.
        A replay of an earlier create with the same key (``Idempotent-Replayed``) answers
        that job as it is now, with ``"replayed": True``."""
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        response = self._http.request("POST", "/v1/jobs", json=body, headers=headers)
        _raise_for(response)
        if response.headers.get("Idempotent-Replayed") == "true":
            return {**self.get_job(response.json()["id"]), "replayed": True}
        return response.json()

    def get_job(self, job_id: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/jobs/{job_id}")

    def cancel_job(self, job_id: str) -> dict[str, Any]:
        """Request the cancel (idempotent; an ended job is answered as it is)."""
        return self._call("POST", f"/v1/jobs/{job_id}/cancel")

    def retry_job(self, job_id: str, idempotency_key: str | None = None) -> dict[str, Any]:
        """``POST /v1/jobs/{id}/retry``: a new job of the ended job's failed and never-run
        lines (its ``derived_from`` names the source); 409 when there are none."""
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        return self._call("POST", f"/v1/jobs/{job_id}/retry", headers=headers)

    def rerun_job(self, job_id: str, idempotency_key: str | None = None) -> dict[str, Any]:
        """``POST /v1/jobs/{id}/rerun``: a new job of the ended job's whole input."""
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        return self._call("POST", f"/v1/jobs/{job_id}/rerun", headers=headers)

    def list_jobs(self, **params: Any) -> dict[str, Any]:
        """``GET /v1/jobs`` (filters: status, model, label, owner, q (search), after, limit):
        a page ``{"data", "next_cursor", "has_more"}``, newest first."""
        return self._call("GET", "/v1/jobs", params={k: v for k, v in params.items() if v is not None})

    # -- jobs as JobViews (the CLI's) -------------------------------------------------------

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
        output_check: dict[str, Any] | None = None,
        result_cache: bool = True,
        priority: str | int | None = None,
        spec: dict[str, Any] | None = None,
    ) -> JobView:
        """Submit the file as one job: upload it (streamed), then ``POST /v1/jobs`` naming it
        (see the module docstring); returns the job.

        ``shards``: ``data_parallelism``; ``max_runtime_sec``: the deadline in seconds after
        creation; ``output_path``: ``output_uri``, a server path (or ``s3://``) the results
        are also written to as JSONL; ``metadata``: the job's ``labels``; ``model_config``:
        engine settings (``engine_args``, ``max_model_len``, ``seed``, ...); ``output_check``:
        how the answers must look (``core.output_check.OutputCheck``); ``result_cache`` False:
        every line runs on the engine; ``priority``: the job's band (``low``, ``normal``,
        ``high``); ``spec``: more fields of the job's spec (``llm_batch.core.job_spec.JobSpec``),
        sent as given. ``JobView.replayed``: the answer is an earlier submit's job.

        Retry-safe by default: the create (and the upload) carry an ``Idempotency-Key``,
        `idempotency_key` or else ``submit_key(...)`` of the file's content and these
        arguments, so submitting the same file with the same arguments again (within the
        server's 24 hours) answers the same job. ``new=True`` sends no key: always a new job."""
        if input_format not in INPUT_FORMATS:
            raise ValueError(f"input format {input_format!r} is unknown; use one of {', '.join(INPUT_FORMATS)}")
        key = None if new else idempotency_key or submit_key(
            path, endpoint=endpoint, model=model, shards=shards, input_format=input_format,
            max_runtime_sec=max_runtime_sec, output_path=output_path, metadata=metadata, model_config=model_config,
            # only when given: the key of a submit without them stays what it was
            **({"output_check": output_check} if output_check is not None else {}),
            **({} if result_cache else {"result_cache": False}),
            **({"priority": priority} if priority else {}),
            **({"spec": spec} if spec else {}),
        )
        upload_key = f"{key}:upload"[:255] if key else None
        if input_format == InputFormat.JSONL:
            file_id = self.upload(path, idempotency_key=upload_key)
        else:
            with tempfile.TemporaryFile(prefix="llm-batch-", suffix=".jsonl") as converted:
                scale_to_jsonl(path, input_format, endpoint, converted)
                converted.flush()
                file_id = self.upload_stream(converted, f"{path.stem}.jsonl", idempotency_key=upload_key)
        body: dict[str, Any] = {**(spec or {}), "input_file_ids": [file_id], "endpoint": endpoint, "model": model,
                                "data_parallelism": shards}
        if max_runtime_sec is not None:
            body["max_runtime_sec"] = max_runtime_sec
        if model_config:
            body["model_config"] = model_config
        if output_path is not None:
            body["output_uri"] = output_path
        if metadata:
            body["labels"] = metadata
        if output_check is not None:  # an empty check too: the server says what it lacks
            body["output_check"] = output_check
        if not result_cache:
            body["result_cache"] = False
        if priority:
            body["priority"] = priority
        return JobView.of(self.create_job(body, idempotency_key=key))

    def job(self, job_id: str) -> JobView:
        return JobView.of(self.get_job(job_id))

    def jobs(self, limit: int = 20, search: str | None = None) -> list[JobView]:
        """The caller's newest jobs, newest first: every route's and every Airflow run's;
        with `search`, those whose id, input file name or path, or labels match it."""
        return [JobView.of(body) for body in self.list_jobs(limit=limit, q=search)["data"]]

    def cancel(self, job_id: str) -> JobView:
        return JobView.of(self.cancel_job(job_id))

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

    # -- usage (/v1/usage) ----------------------------------------------------------------

    def usage(self, by: str | None = None, since: datetime | None = None) -> dict[str, Any]:
        """``GET /v1/usage`` (a non-admin's own jobs; admins every owner's): ``{"object": "list",
        "by", "since", "owner", "data": [...]}``,
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

    def delete_webhook(self, endpoint_id: str) -> dict[str, Any]:
        return self._call("DELETE", f"/v1/webhooks/{endpoint_id}")

    def test_webhook(self, endpoint_id: str, event_type: str = "batch.completed") -> dict[str, Any]:
        """Send one signed test event now; what the receiver answered."""
        return self._call("POST", f"/v1/webhooks/{endpoint_id}/test", json={"event_type": event_type})

    def webhook_attempts(self, endpoint_id: str, limit: int = 20) -> list[dict[str, Any]]:
        """The endpoint's delivery attempts, newest first."""
        return self._call("GET", f"/v1/webhooks/{endpoint_id}/attempts", params={"limit": limit})["data"]

    # -- estimates (POST /v1/jobs with dry_run; docs/api.md "Estimates (dry run)") ---------

    def estimate(self, path: Path, *, model: str, endpoint: str = "/v1/chat/completions", shards: int = 1,
                 model_config: dict[str, Any] | None = None) -> dict[str, Any]:
        """The estimate of submitting the JSONL file `path` (``EstimateOut``): the file is uploaded
        (streamed, so the server validates exactly what a job would read), estimated by a dry
        run, and deleted again; nothing else is created."""
        file_id = self.upload(path)
        try:
            body: dict[str, Any] = {"input_file_ids": [file_id], "endpoint": endpoint, "model": model,
                                    "data_parallelism": shards, "dry_run": True}
            if model_config:
                body["model_config"] = model_config
            return self._call("POST", "/v1/jobs", json=body)
        finally:
            self._call("DELETE", f"/v1/files/{file_id}")


def submit_key(path: Path, **arguments: Any) -> str:
    """The ``Idempotency-Key`` of submitting `path` with `arguments` (BatchClient.submit's):
    ``llm-batch-cli:`` + sha256 of the file's sha256 and the arguments, so the same command
    on the same file content names the same job."""
    content = hashlib.sha256()
    with path.open("rb") as data:
        while chunk := data.read(1 << 20):
            content.update(chunk)
    given = orjson.dumps(arguments, option=orjson.OPT_SORT_KEYS)
    return f"llm-batch-cli:{hashlib.sha256(content.hexdigest().encode() + b':' + given).hexdigest()}"


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
    """ApiError from an error answer: the OpenAI shape ``{"error": {"message", "param",
    "code"}}`` or the others' ``{"detail", "message", "param", "code"}`` (a bare FastAPI
    ``{"detail"}``, as Airflow answers around the API, too)."""
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
