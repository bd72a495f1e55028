"""Helpers shared by the data-plane tests (results, sharding, merge, invariants): build a
job's validated and validation-error files the way validation writes them."""

from __future__ import annotations

import uuid

from llm_batch.core.config import get_settings
from llm_batch.core.layout import JobLayout
from llm_batch.core.records import BatchRequest, ErrorRecord, RequestError, ResultRecord, dumps_line
from llm_batch.infra import storage


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


def engine_answer(request: BatchRequest, tokens: int = 3, model: str = "tiny-random-llama") -> ResultRecord:
    """The worker's result for a completion or chat request, its body built by
    llm_batch.runtime.engine.responses as the runner builds it, from a stand-in vLLM output of
    ``tokens`` tokens (with each token's logprob when the request asks for them)."""
    from vllm.logprobs import Logprob
    from vllm.outputs import CompletionOutput, RequestOutput

    from llm_batch.runtime.engine import responses

    body = request.body
    chat = "messages" in body
    asked = bool(body.get("logprobs"))
    top = (body.get("top_logprobs") or 0) if chat else int(body.get("logprobs") or 0)
    ids = list(range(100, 100 + tokens))
    words = [f" w{i}" for i in range(tokens)]
    logprobs = [{tid: Logprob(logprob=-0.5 * (i + 1), rank=1, decoded_token=word)}
                for i, (tid, word) in enumerate(zip(ids, words))] if asked else None
    completion = CompletionOutput(index=0, text="".join(words), token_ids=ids, cumulative_logprob=None,
                                  logprobs=logprobs, finish_reason="length")
    output = RequestOutput(f"r{request.index}", None, [1, 2, 3, 4, 5], None, [completion], finished=True)
    payload = (responses.chat_completion(output, model, "assistant", top) if chat
               else responses.text_completion(output, model, top))
    return ResultRecord(index=request.index, custom_id=request.custom_id, status_code=200, body=payload)


def run_scale_job(layout: JobLayout, source, fmt: str, endpoint: str, *, failing=(), shards: int = 1,
                  array_output_uri: str | None = None) -> list:
    """A Scale job's run without an engine: ``source`` validated as the job's validation
    reads it, every valid request answered with ``engine_answer`` (an engine error for the
    input indices in ``failing``), merged as the DAG merges (the array's elements by the
    input format); returns the array it wrote (at ``array_output_uri`` or the job's
    output.json)."""
    import orjson

    from llm_batch.core.scale_output import success_element
    from llm_batch.infra.results import ResultsWriter
    from llm_batch.infra.storage import stored_lines
    from llm_batch.pipeline.merge import merge_job
    from llm_batch.pipeline.sharding import plan_shards
    from llm_batch.pipeline.validation import validate_batch

    validate_batch(source, fmt=fmt, endpoint=endpoint, layout=layout)
    for plan in plan_shards(layout, shards, prefix_aware=False):
        with ResultsWriter.open(plan.results_uri) as writer:
            for line in stored_lines(plan.requests_uri):
                request = BatchRequest.model_validate_json(line)
                writer.write(engine_error(request) if request.index in failing else engine_answer(request))
    merge_job(layout, jsonl=False, json_array=True, array_output_uri=array_output_uri,
              array_element=success_element(fmt))
    return orjson.loads(storage.read_bytes(array_output_uri or layout.output_json))
