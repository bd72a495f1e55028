"""Merge a job: every input index ends as exactly one output or error line, in input order
(docs/data-plane.md, "the ordered merge").

A streaming ``heapq.merge`` by input index of the validation errors, the cached results and the
shards' outcomes. Contiguous shards are opened one after another, as the merge reaches them (no
S3 connection idles through a long merge). A plan that broke the ordering is refused
(``MergeError``), never misordered; ``<h>`` in a line's ids hashes the job id and index, so a
rerun writes the same bytes. A running job's finished lines (``partial_entries``) are read with
the same pairing and line builders, so a line read early is the final files' line, byte for byte."""

from __future__ import annotations

import hashlib
import heapq
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field
from enum import StrEnum
from itertools import chain
from operator import attrgetter
from typing import Any

import orjson

from llm_batch.core.layout import JobLayout
from llm_batch.core.output_check import INVALID_OUTPUT
from llm_batch.core.records import ErrorRecord, ResultRecord
from llm_batch.core.scale_output import ArrayElement, failed_element, success_element
from llm_batch.infra import storage
from llm_batch.infra.results import paired_results
from llm_batch.infra.storage import ChunkedWriter, stored_lines
from llm_batch.pipeline.result_cache import cached_results
from llm_batch.pipeline.sharding import ShardPlan, read_manifest

# Codes of requests that never ran; they count as failed (and as completed: they have an
# outcome), as OpenAI counts the requests of a cancelled or expired batch.
BATCH_CANCELLED = "batch_cancelled"
BATCH_EXPIRED = "batch_expired"
SHARD_FAILED = "shard_failed"
NOT_RUN_CODES = frozenset({BATCH_CANCELLED, BATCH_EXPIRED, SHARD_FAILED})
DEFAULT_NOT_RUN_MESSAGE = "the request was not run: its shard stopped before reaching it"

Outcome = ResultRecord | ErrorRecord


class MergeError(ValueError):
    """The merge inputs contradict each other (e.g. two records for one input index)."""


@dataclass(frozen=True)
class MergeCounts:
    """total = succeeded + failed; failed counts invalid lines, engine errors and not run. Tokens:
    sums of the output lines' ``usage``; cached prompt tokens None unless every line gives them."""

    total: int
    succeeded: int
    failed: int
    not_run: int
    invalid: int
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int | None = 0
    reasoning_tokens: int = 0
    # lines the result cache answered (part of succeeded) and their tokens
    result_cache_hits: int = 0
    result_cache_tokens: int = 0
    # lines whose last answer failed the job's check (part of failed), answers tried again, their tokens
    invalid_output: int = 0
    output_retries: int = 0
    retry_tokens: int = 0
    # per answering model (body.model) when the lines ran on several (base, LoRA adapters): their sums
    by_model: dict[str, dict[str, int]] = field(default_factory=dict)


class _UsageSum:
    """The sum of the output lines' usage (see MergeCounts for the details)."""

    def __init__(self) -> None:
        self.prompt = self.completion = self.reasoning = 0
        self.cached: int | None = 0
        self.by_model: dict[str, dict[str, int]] = {}

    def add(self, body: dict[str, Any] | None) -> int:
        """Add a line's usage; returns its prompt + completion tokens."""
        usage = (body or {}).get("usage") or {}
        # A /v1/responses Response names them input/output.
        prompt = int(_named(usage, "prompt_tokens", "input_tokens") or 0)
        completion = int(_named(usage, "completion_tokens", "output_tokens") or 0)
        self.prompt += prompt
        self.completion += completion
        if isinstance(model := (body or {}).get("model"), str):
            sums = self.by_model.setdefault(model, {"succeeded": 0, "prompt_tokens": 0, "completion_tokens": 0})
            sums["succeeded"] += 1
            sums["prompt_tokens"] += prompt
            sums["completion_tokens"] += completion
        cached = (_named(usage, "prompt_tokens_details", "input_tokens_details") or {}).get("cached_tokens")
        reasoning = (_named(usage, "completion_tokens_details", "output_tokens_details") or {}).get(
            "reasoning_tokens")
        self.cached = None if cached is None or self.cached is None else self.cached + int(cached)
        self.reasoning += int(reasoning or 0)
        return prompt + completion


def _named(usage: dict[str, Any], name: str, responses_name: str) -> Any:
    """The usage field under its chat name, else under its Responses API name."""
    value = usage.get(name)
    return usage.get(responses_name) if value is None else value


def stable_request_hash(job_id: str, index: int) -> str:
    return hashlib.blake2b(f"{job_id}:{index}".encode(), digest_size=12).hexdigest()


def shard_outcomes(plan: ShardPlan, not_run_code: str | None, not_run_message: str = "") -> Iterator[Outcome]:
    """Each request of the shard, in order, with its result or marked not run; with
    ``not_run_code`` None only the finished ones (a shard's results are a prefix of its requests)."""
    for request, result in paired_results(plan.requests_uri, plan.results_uri):
        line_number = request.get("line") or request["index"] + 1
        if result is not None:
            if result.line is None:
                result.line = line_number
            yield result
        elif not_run_code is None:
            return
        else:
            yield ErrorRecord(index=request["index"], line=line_number, custom_id=request["custom_id"],
                              code=not_run_code, message=not_run_message)


def job_outcomes(layout: JobLayout, outcomes_of: Callable[[ShardPlan], Iterator[Outcome]]) -> Iterator[Outcome]:
    """Every outcome of the job in input order: its validation errors, its cached results and
    its shards' outcomes (``outcomes_of`` each shard)."""
    plans = sorted(read_manifest(layout).shards, key=attrgetter("first_index"))
    # Contiguous: disjoint, ascending index ranges, read one after another.
    if all(earlier.last_index < later.first_index for earlier, later in zip(plans, plans[1:])):
        shards = chain.from_iterable(outcomes_of(p) for p in plans)
    else:  # a prefix-aware plan's shards interleave, each in index order: all open at once
        shards = heapq.merge(*(outcomes_of(p) for p in plans), key=attrgetter("index"))
    errors = (ErrorRecord.model_validate_json(line) for line in stored_lines(layout.validation_errors))
    return heapq.merge(errors, cached_results(layout), shards, key=attrgetter("index"))


def _error_body(result: ResultRecord) -> dict[str, Any]:
    """The OpenAI-style error body of an engine error (the engine's own, when it gave one)."""
    if result.body and isinstance(result.body.get("error"), dict):
        return result.body
    error = result.error
    kind = "invalid_request_error" if 400 <= result.status_code < 500 else "server_error"
    return {"error": {"message": error.message if error else "request failed",
                      "type": kind, "code": error.code if error else None}}


class _Outputs:
    """The open output files; writes one outcome to each that is wanted."""

    def __init__(self, job_id: str, jsonl: ChunkedWriter | None, errors: ChunkedWriter | None,
                 scale: ChunkedWriter | None, array_element: ArrayElement):
        self.job_id = job_id
        self.jsonl, self.errors, self.scale = jsonl, errors, scale
        self.array_element = array_element
        self._scale_items = 0
        if scale is not None:
            scale.write(b"[")

    def finish(self) -> None:
        """Close the Scale array and hand every buffered byte to storage."""
        if self.scale is not None:
            self.scale.write(b"]")
        for writer in (self.jsonl, self.errors, self.scale):
            if writer is not None:
                writer.flush()

    def _scale_element(self, element: Any) -> None:
        assert self.scale is not None
        self.scale.write((b"," if self._scale_items else b"") + orjson.dumps(element))
        self._scale_items += 1

    def success(self, result: ResultRecord) -> None:
        if self.jsonl is not None:
            self.jsonl.write(orjson.dumps(output_line(self.job_id, result)) + b"\n")
        if self.scale is not None:
            self._scale_element(self.array_element(result.body))

    def failure(self, outcome: Outcome) -> None:
        """An engine error, a validation error or a request never run."""
        line = error_line(self.job_id, outcome)
        if self.errors is not None:
            self.errors.write(orjson.dumps(line) + b"\n")
        if self.scale is not None:
            error = line["error"]
            self._scale_element(failed_element(error["code"], error["message"], line["custom_id"], line["line"]))


def output_line(job_id: str, result: ResultRecord) -> dict[str, Any]:
    h = stable_request_hash(job_id, result.index)
    response = {"status_code": result.status_code, "request_id": f"req_{h}", "body": result.body}
    if result.cached:  # answered from the result cache: an earlier job's answer, no engine time
        response["cached"] = True
    return {"id": f"batch_req_{h}", "custom_id": result.custom_id, "response": response, "error": None}


def error_line(job_id: str, outcome: Outcome) -> dict[str, Any]:
    """A failure's line of the error file: an engine error has the engine's response; a
    validation error or a request never run has none."""
    h = stable_request_hash(job_id, outcome.index)
    if isinstance(outcome, ErrorRecord):
        line, code, message, response = outcome.line, outcome.code, outcome.message, None
    else:
        error = outcome.error
        line = outcome.line or outcome.index + 1
        code = error.code if error else f"http_{outcome.status_code}"
        message = error.message if error else f"request failed with status {outcome.status_code}"
        # An answer that failed the job's check keeps the answer itself: the last one tried.
        answered = code == INVALID_OUTPUT and outcome.body is not None
        response = {"status_code": outcome.status_code, "request_id": f"req_{h}",
                    "body": outcome.body if answered else _error_body(outcome)}
    return {"id": f"batch_req_{h}", "custom_id": outcome.custom_id, "line": line,
            "response": response, "error": {"code": code, "message": message}}


def merge_job(layout: JobLayout, *, jsonl: bool = True, json_array: bool = False, array_output_uri: str | None = None,
              not_run_reason: str | None = None, not_run_code: str = SHARD_FAILED,
              shard_not_run_reasons: Mapping[int, str] | None = None,
              array_element: ArrayElement | None = None) -> MergeCounts:
    """Write the job's merged outputs and return the counts; on error nothing is published.

    ``jsonl``: ``layout.output_jsonl`` and ``layout.errors_jsonl`` (both, the errors possibly
    empty). ``json_array`` (implied by ``array_output_uri``): the Scale array at
    ``array_output_uri`` or ``layout.output_json``, a success's element made by
    ``array_element`` (default: the body). A request with no result gets ``not_run_code`` and
    its shard's ``shard_not_run_reasons[k]``, else ``not_run_reason``, else a default message.
    """
    shard_reasons = shard_not_run_reasons or {}

    def outcomes_of(plan: ShardPlan) -> Iterator[Outcome]:
        return shard_outcomes(plan, not_run_code, shard_reasons.get(plan.index)
                              or not_run_reason or DEFAULT_NOT_RUN_MESSAGE)

    succeeded = failed = not_run = invalid = cache_hits = cache_tokens = invalid_output = retries = retry_tokens = 0
    usage = _UsageSum()
    with ExitStack() as stack:
        def sink(uri: str) -> ChunkedWriter:
            return ChunkedWriter(stack.enter_context(storage.open_write(uri)))

        outputs = _Outputs(
            layout.job_id,
            jsonl=sink(layout.output_jsonl) if jsonl else None,
            errors=sink(layout.errors_jsonl) if jsonl else None,
            scale=sink(array_output_uri or layout.output_json) if json_array or array_output_uri else None,
            array_element=array_element or success_element(None),
        )
        last_index = -1
        for outcome in job_outcomes(layout, outcomes_of):
            if outcome.index <= last_index:
                raise MergeError(f"job {layout.job_id}: input index {outcome.index} comes after index {last_index}: "
                                 "validation errors and shards overlap or are out of order")
            last_index = outcome.index
            if isinstance(outcome, ErrorRecord):
                failed += 1
                not_run += outcome.code in NOT_RUN_CODES
                invalid += outcome.code not in NOT_RUN_CODES
                outputs.failure(outcome)
                continue
            retries += outcome.retries or 0
            retry_tokens += outcome.retry_tokens or 0
            if outcome.ok:
                succeeded += 1
                tokens = usage.add(outcome.body)
                if outcome.cached:
                    cache_hits += 1
                    cache_tokens += tokens
                outputs.success(outcome)
            else:
                failed += 1
                invalid_output += outcome.error is not None and outcome.error.code == INVALID_OUTPUT
                outputs.failure(outcome)
        outputs.finish()
    return MergeCounts(total=succeeded + failed, succeeded=succeeded, failed=failed,
                       not_run=not_run, invalid=invalid, prompt_tokens=usage.prompt,
                       completion_tokens=usage.completion, cached_prompt_tokens=usage.cached,
                       reasoning_tokens=usage.reasoning, result_cache_hits=cache_hits,
                       result_cache_tokens=cache_tokens, invalid_output=invalid_output, output_retries=retries,
                       retry_tokens=retry_tokens,
                       by_model=usage.by_model if len(usage.by_model) > 1 else {})


class PartialOrder(StrEnum):
    """Which finished lines a partial read gives: those before the first unfinished one (INPUT), or
    all of them (FINISHED); in input order either way."""

    INPUT = "input"
    FINISHED = "finished"


def finished_outcomes(layout: JobLayout, order: PartialOrder = PartialOrder.INPUT) -> Iterator[Outcome]:
    """The job's finished outcomes in input order (``order``: as ``PartialOrder`` says)."""
    if not storage.exists(layout.shard_manifest):
        return  # not planned yet: the validation errors alone are not a prefix of anything
    expected = 0
    for outcome in job_outcomes(layout, lambda plan: shard_outcomes(plan, None)):
        if order is PartialOrder.INPUT and outcome.index != expected:
            return  # the line at `expected` has no outcome yet
        expected = outcome.index + 1
        yield outcome


def partial_entry(job_id: str, outcome: Outcome) -> dict[str, Any]:
    """One line of a partial read: where the line sits and its final output or error line."""
    if isinstance(outcome, ResultRecord) and outcome.ok:
        body = {"output": output_line(job_id, outcome)}
        line = outcome.line or outcome.index + 1
    else:
        body = {"error": error_line(job_id, outcome)}
        line = body["error"]["line"]
    return {"index": outcome.index, "line": line, "custom_id": outcome.custom_id, **body}


def partial_entries(layout: JobLayout, order: PartialOrder = PartialOrder.INPUT,
                    start: int = 0) -> Iterator[dict[str, Any]]:
    """``partial_entry`` of each finished outcome at input index ``start`` or later."""
    for outcome in finished_outcomes(layout, order):
        if outcome.index >= start:
            yield partial_entry(layout.job_id, outcome)
