"""A job's finished lines, readable while it runs.

What has finished is what storage already holds: the validation errors and the lines the
result cache answered (both written before any shard starts) and each shard's published
result parts (each part is whole, see
``infra.results``). Read here with the merge's own pairing and line builders, so a line
read early is the line the merged output and error files will hold, byte for byte once
serialised, under the same ``id``: the final files equal what partial reads showed plus
the rest, never a line twice. Requests never run are not finished lines: they appear only
in the final error file, once the job has ended.

Two orders:

- ``input``: input order up to the first line with no outcome yet (a reader that polls
  resumes with ``start`` = the number of lines it already has);
- ``finished``: every finished line, in input order, gaps left out (lines finish out of
  order across shards, so a poller of this order reads from the start each time).

Memory is constant and at most the merge's streams are open; nothing is written.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from enum import StrEnum
from operator import attrgetter
from typing import Any

from llm_batch.core.layout import JobLayout
from llm_batch.core.records import ResultRecord
from llm_batch.infra import storage
from llm_batch.pipeline.merge import Outcome, error_line, job_outcomes, output_line, shard_outcomes, validation_errors
from llm_batch.pipeline.result_cache import cached_results
from llm_batch.pipeline.sharding import read_manifest


class PartialOrder(StrEnum):
    """Which finished lines a partial read gives: in input order up to the first unfinished
    one (`input`), or all of them (`finished`)."""

    INPUT = "input"
    FINISHED = "finished"


def finished_outcomes(layout: JobLayout, order: PartialOrder = PartialOrder.INPUT) -> Iterator[Outcome]:
    """The job's finished outcomes in input order (see the module doc for ``order``)."""
    if not storage.exists(layout.shard_manifest):
        return  # not planned yet: the validation errors alone are not a prefix of anything
    manifest = read_manifest(layout)
    outcomes = heapq.merge(validation_errors(layout), cached_results(layout),
                           job_outcomes(manifest.shards, lambda plan: shard_outcomes(plan, None)),
                           key=attrgetter("index"))
    expected = 0
    for outcome in outcomes:
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
