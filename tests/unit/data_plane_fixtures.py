"""Helpers shared by the data-plane tests (results, sharding, merge, invariants): build a
job's validated and validation-error files the way validation writes them."""

from __future__ import annotations

import uuid

from llm_batch import storage
from llm_batch.config import get_settings
from llm_batch.layout import JobLayout
from llm_batch.records import BatchRequest, ErrorRecord, ResultRecord, RequestError, dumps_line


def new_layout() -> JobLayout:
    return JobLayout(get_settings().work_uri, f"job-{uuid.uuid4().hex[:12]}")


def chat_body(text: str = "hello") -> dict:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": 4}


def write_job(layout: JobLayout, valid: list[bool], texts: list[str] | None = None) -> list[BatchRequest]:
    """Input line i is valid or not; writes validated + validation errors, returns requests."""
    requests, errors = [], []
    for i, ok in enumerate(valid):
        if ok:
            text = texts[i] if texts else f"prompt {i}"
            requests.append(BatchRequest(index=i, custom_id=f"req-{i}", body=chat_body(text)))
        else:
            errors.append(ErrorRecord(index=i, line=i + 1, custom_id=None, code="invalid_json",
                                      message=f"line {i + 1}: not JSON"))
    storage.write_bytes(layout.validated, b"".join(dumps_line(r) for r in requests))
    storage.write_bytes(layout.validation_errors, b"".join(dumps_line(e) for e in errors))
    return requests


def ok_result(request: BatchRequest) -> ResultRecord:
    return ResultRecord(index=request.index, custom_id=request.custom_id, status_code=200,
                        body={"object": "chat.completion", "echo": request.custom_id})


def engine_error(request: BatchRequest) -> ResultRecord:
    return ResultRecord(index=request.index, custom_id=request.custom_id, status_code=400,
                        error=RequestError(code="context_length_exceeded",
                                           message="prompt is too long"))
