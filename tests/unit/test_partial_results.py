"""Partial reads of a running job: what they show is what the merged files hold, once each."""

from __future__ import annotations

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_batch.infra import storage
from llm_batch.infra.results import ResultsWriter
from llm_batch.pipeline.merge import PartialOrder, merge_job, partial_entries, stable_request_hash
from llm_batch.pipeline.sharding import plan_shards
from tests.fuzzing import examples
from tests.unit.data_plane_fixtures import engine_error, new_layout, ok_result, write_job


def _final_lines(layout) -> dict[str, dict]:
    """The merged output and error files' lines by id; no id twice across both."""
    lines = [orjson.loads(line) for uri in (layout.output_jsonl, layout.errors_jsonl)
             for line in storage.read_bytes(uri).splitlines()]
    by_id = {line["id"]: line for line in lines}
    assert len(by_id) == len(lines)
    return by_id


def test_nothing_before_the_job_is_planned():
    layout = new_layout()
    write_job(layout, [True, False, True])
    assert list(partial_entries(layout)) == []


@settings(max_examples=examples(40), deadline=None)
@given(
    valid=st.lists(st.booleans(), min_size=1, max_size=24),
    shards=st.integers(1, 4),
    steps=st.lists(st.integers(0, 3), min_size=1, max_size=8),
    failing=st.sets(st.integers(0, 23), max_size=4),
)
def test_partial_reads_are_prefixes_of_the_final_files(valid, shards, steps, failing):
    """Shards publish results a part at a time (``steps``: which shard advances by one
    part); after each step both orders are read; at the end (some shards unfinished) the
    merge's files hold every line once, and every line a partial read showed, unchanged."""
    layout = new_layout()
    requests = write_job(layout, valid)
    if not requests:
        return
    plans = plan_shards(layout, shards)
    by_index = {r.index: r for r in requests}
    done = {plan.index: 0 for plan in plans}
    held = {plan.index: [orjson.loads(line)["index"] for line in storage.read_bytes(plan.requests_uri).splitlines()]
            for plan in plans}
    shown: dict[str, dict] = {}
    for step in steps:
        plan = plans[step % len(plans)]
        indices = held[plan.index][done[plan.index]:done[plan.index] + 2]
        if indices:
            with ResultsWriter.open(plan.results_uri) as writer:
                for index in indices:
                    record = by_index[index]
                    writer.write(engine_error(record) if index in failing else ok_result(record))
            done[plan.index] += len(indices)

        ordered = list(partial_entries(layout, PartialOrder.INPUT))
        finished = list(partial_entries(layout, PartialOrder.FINISHED))
        assert [e["index"] for e in ordered] == list(range(len(ordered)))
        assert ordered == finished[:len(ordered)]
        assert [e["index"] for e in finished] == sorted({e["index"] for e in finished})
        finished_indices = {e["index"] for e in finished}
        first_gap = next(i for i in range(len(valid) + 1) if i not in finished_indices)
        assert len(ordered) == first_gap  # input order stops exactly at the first unfinished line
        resumed = list(partial_entries(layout, PartialOrder.INPUT, start=len(ordered) // 2))
        assert resumed == ordered[len(ordered) // 2:]
        for entry in finished:
            line = entry.get("output") or entry["error"]
            assert line["id"] == f"batch_req_{stable_request_hash(layout.job_id, entry['index'])}"
            assert shown.setdefault(line["id"], line) == line  # a line never changes between reads
        # Invalid lines are finished from the start; a line finished by a shard is one it ran.
        ran = {i for plan in plans for i in held[plan.index][:done[plan.index]]}
        assert {e["index"] for e in finished} == ran | {i for i, ok in enumerate(valid) if not ok}

    counts = merge_job(layout)
    final = _final_lines(layout)
    assert counts.total == len(valid) == len(final)
    for line_id, line in shown.items():
        assert final[line_id] == line

