"""Shard planning: contiguous, balanced, deterministic, no empty shard, streamed files."""

from __future__ import annotations

import orjson
import pytest

from llm_batch.core.records import ResultRecord
from llm_batch.infra import storage
from llm_batch.infra.results import ResultsWriter, count_results
from llm_batch.pipeline.sharding import ShardingError, estimate_prompt_tokens, plan_shards, read_manifest
from tests.unit.data_plane_fixtures import new_layout, write_job


def shard_indices(plan) -> list[int]:
    return [orjson.loads(line)["index"] for line in storage.read_bytes(plan.requests_uri).splitlines()]


def assert_partition(layout, plans) -> None:
    """Shards are numbered 0.. and concatenate to the validated file, byte for byte."""
    assert [p.index for p in plans] == list(range(len(plans)))
    assert all(p.count > 0 for p in plans)
    joined = b"".join(storage.read_bytes(p.requests_uri) for p in plans)
    assert joined == storage.read_bytes(layout.validated)
    position = 0
    for plan in plans:
        indices = shard_indices(plan)
        assert (plan.start, plan.count) == (position, len(indices))
        assert (plan.first_index, plan.last_index) == (indices[0], indices[-1])
        position += plan.count


@pytest.mark.parametrize("num_shards", [1, 2, 3, 7, 8, 64])
def test_count_balanced_shards_differ_by_at_most_one(num_shards):
    layout = new_layout()
    write_job(layout, [i % 5 != 2 for i in range(130)])  # 104 valid, indices with gaps
    plans = plan_shards(layout, num_shards)
    assert len(plans) == num_shards
    assert_partition(layout, plans)
    sizes = [p.count for p in plans]
    assert sum(sizes) == 104 and max(sizes) - min(sizes) <= 1
    assert read_manifest(layout).shards == plans


def test_more_shards_than_requests_plans_one_request_per_shard():
    layout = new_layout()
    write_job(layout, [True, False, True, True, False, True, True])
    plans = plan_shards(layout, 8)
    assert [p.count for p in plans] == [1] * 5
    assert [p.first_index for p in plans] == [0, 2, 3, 5, 6]
    manifest = read_manifest(layout)
    assert (manifest.num_shards, manifest.total_requests) == (8, 5)


def test_no_valid_request_plans_no_shard():
    layout = new_layout()
    write_job(layout, [False, False])
    assert plan_shards(layout, 4) == []
    assert read_manifest(layout).shards == []


def test_token_balanced_shards_even_out_prompt_sizes():
    layout = new_layout()
    lengths = [4000 if i % 10 == 0 else 40 for i in range(200)]
    write_job(layout, [True] * 200, texts=["x" * n for n in lengths])
    by_count = plan_shards(layout, 4)
    by_tokens = plan_shards(layout, 4, by="tokens")
    assert_partition(layout, by_tokens)
    weight = [sum(lengths[i] // 4 for i in shard_indices(p)) for p in by_tokens]
    ideal, heaviest = sum(weight) / 4, max(lengths) // 4
    assert all(abs(w - ideal) <= heaviest for w in weight)
    assert [p.weight for p in by_tokens] == weight
    assert [p.weight for p in by_count] == [50] * 4


def test_one_huge_request_still_leaves_no_shard_empty():
    layout = new_layout()
    write_job(layout, [True] * 6, texts=["x" * 100_000] + ["y"] * 5)
    plans = plan_shards(layout, 4, by="tokens")
    assert len(plans) == 4
    assert_partition(layout, plans)
    assert plans[0].count == 1  # the huge one alone


def test_planning_is_deterministic():
    layout = new_layout()
    write_job(layout, [True] * 50, texts=[str(i) * (i % 7 + 1) for i in range(50)])
    first = plan_shards(layout, 6, by="tokens")
    files = [storage.read_bytes(p.requests_uri) for p in first]
    manifest = storage.read_bytes(layout.shard_manifest)
    assert plan_shards(layout, 6, by="tokens") == first
    assert [storage.read_bytes(p.requests_uri) for p in first] == files
    assert storage.read_bytes(layout.shard_manifest) == manifest


def _checkpoint(plan) -> None:
    with ResultsWriter.open(plan.results_uri) as writer:
        writer.write(ResultRecord(index=plan.first_index, custom_id="x", status_code=200, body={}))


def test_same_replan_keeps_checkpoints_and_a_different_one_discards_them():
    layout = new_layout()
    write_job(layout, [True] * 12)
    plans = plan_shards(layout, 4)
    for plan in plans:
        _checkpoint(plan)
    assert [count_results(p.results_uri) for p in plan_shards(layout, 4)] == [1] * 4
    fewer = plan_shards(layout, 2)
    assert [count_results(p.results_uri) for p in fewer] == [0, 0]
    assert not storage.exists(plans[3].requests_uri)  # stale shard gone


@pytest.mark.parametrize("num_shards", [0, 65])
def test_shard_count_out_of_range_is_refused(num_shards):
    layout = new_layout()
    write_job(layout, [True])
    with pytest.raises(ShardingError, match="1..64"):
        plan_shards(layout, num_shards)


def test_unknown_balance_is_refused():
    layout = new_layout()
    write_job(layout, [True])
    with pytest.raises(ShardingError, match="'count' or 'tokens'"):
        plan_shards(layout, 2, by="bytes")


@pytest.mark.parametrize(("body", "tokens"), [
    ({"messages": [{"role": "user", "content": "a" * 40}]}, 10),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a" * 20},
                                                 {"type": "image_url", "image_url": {}}]}]}, 5),
    ({"prompt": "b" * 80}, 20),
    ({"prompt": [1, 2, 3, 4, 5]}, 5),
    ({"input": ["c" * 8, "d" * 8]}, 4),
    ({"messages": []}, 1),
])
def test_prompt_token_estimate(body, tokens):
    assert estimate_prompt_tokens(body) == tokens
