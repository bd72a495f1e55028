"""Property: whatever the input, shard count and which requests ran, every input line ends
as exactly one output or error line, in input order, none lost, none duplicated."""

from __future__ import annotations

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_batch.infra import storage
from llm_batch.infra.results import ResultsWriter
from llm_batch.pipeline.merge import merge_job
from llm_batch.pipeline.sharding import plan_shards
from tests.fuzzing import examples
from tests.unit.data_plane_fixtures import engine_error, new_layout, ok_result, write_job

# Per input line: invalid, or valid with a fate once run: ok, engine error, never run.
LINE = st.sampled_from(["invalid", "ok", "error", "not_run"])


@settings(max_examples=examples(60), deadline=None)
@given(
    lines=st.lists(LINE, max_size=60),
    lengths=st.lists(st.integers(0, 500), min_size=60, max_size=60),
    num_shards=st.integers(1, 64),
    by=st.sampled_from(["count", "tokens"]),
    part_size=st.integers(1, 7),
)
def test_every_line_ends_exactly_once_in_order(lines, lengths, num_shards, by, part_size):
    layout = new_layout()
    requests = write_job(layout, [fate != "invalid" for fate in lines],
                         texts=["x" * n for n in lengths])
    plans = plan_shards(layout, num_shards, by=by)
    assert sum(p.count for p in plans) == len(requests)
    assert len(plans) == min(num_shards, len(requests))

    by_index = {r.index: r for r in requests}
    for plan in plans:
        with ResultsWriter.open(plan.results_uri, flush_every_records=part_size) as writer:
            for index in range(plan.first_index, plan.last_index + 1):
                fate = lines[index]
                if fate == "ok":
                    writer.write(ok_result(by_index[index]))
                elif fate == "error":
                    writer.write(engine_error(by_index[index]))

    counts = merge_job(layout, json_array=True, not_run_reason="cancelled")

    outputs = [orjson.loads(x) for x in storage.read_bytes(layout.output_jsonl).splitlines()]
    errors = [orjson.loads(x) for x in storage.read_bytes(layout.errors_jsonl).splitlines()]
    ok_indices = [int(o["custom_id"].removeprefix("req-")) for o in outputs]
    error_indices = [e["line"] - 1 for e in errors]
    assert ok_indices == sorted(ok_indices) and error_indices == sorted(error_indices)
    assert sorted(ok_indices + error_indices) == list(range(len(lines)))  # none lost or twice
    assert [lines[i] for i in ok_indices] == ["ok"] * len(ok_indices)
    expected_code = {"invalid": "invalid_json", "error": "context_length_exceeded",
                     "not_run": "shard_failed"}
    assert [e["error"]["code"] for e in errors] == [expected_code[lines[i]] for i in error_indices]

    scale = orjson.loads(storage.read_bytes(layout.output_json))
    assert len(scale) == len(lines)
    for index, element in enumerate(scale):
        if lines[index] == "ok":
            assert element["echo"] == f"req-{index}"
        else:
            assert element["line"] == index + 1 and element["error"]["code"] == expected_code[lines[index]]

    assert counts.total == counts.succeeded + counts.failed == len(lines)
    assert counts.succeeded == lines.count("ok")
    assert counts.not_run == lines.count("not_run")
    assert counts.invalid == lines.count("invalid")
