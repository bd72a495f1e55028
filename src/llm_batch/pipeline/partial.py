"""A job's finished lines, readable while it runs (docs/api.md, "Results while a job runs"): what storage
holds already, read with the merge's own pairing and line builders, so a line read early is byte
for byte the line the final files will hold. Nothing is written."""

from __future__ import annotations

from collections.abc import Iterator
from enum import StrEnum
from typing import Any

from llm_batch.core.layout import JobLayout
from llm_batch.core.records import ResultRecord
from llm_batch.infra import storage
from llm_batch.pipeline.merge import Outcome, error_line, job_outcomes, output_line, shard_outcomes


class PartialOrder(StrEnum):
    """Which finished lines a partial read gives (see the module docstring)."""

    INPUT = "input"
    FINISHED = "finished"


def finished_outcomes(layout: JobLayout, order: PartialOrder = PartialOrder.INPUT) -> Iterator[Outcome]:
    """The job's finished outcomes in input order (see the module doc for ``order``)."""
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
