"""Prefix-aware sharding: requests sharing a long prompt prefix land on one shard (balanced,
deterministic, a few integers per line in memory), the off switch gives today's plan, every
index is planned exactly once, merge restores input order, and the worker's engine loop
feeds a shard's prefix groups together while emitting results in input order."""

from __future__ import annotations

import random
import tracemalloc
from array import array
from types import SimpleNamespace

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_batch.core.config import get_settings
from llm_batch.core.records import BatchRequest
from llm_batch.infra import storage
from llm_batch.infra.results import ResultsWriter
from llm_batch.pipeline.merge import merge_job
from llm_batch.pipeline.sharding import _read_lines, estimate_prompt_tokens, plan_shards, prefix_key, read_manifest
from tests.fuzzing import examples
from tests.unit.data_plane_fixtures import engine_error, new_layout, ok_result, write_job

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron".split()


def document(d: int, chars: int = 2000) -> str:
    rng = random.Random(d)
    words: list[str] = [f"Document {d}."]
    while sum(len(w) + 1 for w in words) < chars:
        words.append(rng.choice(WORDS))
    return " ".join(words)


def doc_qa_texts(docs: int, questions: int, seed: int = 7, chars: int = 2000) -> tuple[list[str], list[int]]:
    """Shuffled document-QA prompts and each line's document."""
    pairs = [(d, q) for d in range(docs) for q in range(questions)]
    random.Random(seed).shuffle(pairs)
    texts = [f"{document(d, chars)}\n\nQuestion {q}: what does document {d} say about {WORDS[q]}?"
             for d, q in pairs]
    return texts, [d for d, _ in pairs]


def shard_indices(plan) -> list[int]:
    return [orjson.loads(line)["index"] for line in storage.read_bytes(plan.requests_uri).splitlines()]


def assert_every_index_once(layout, plans, expected: int) -> None:
    validated = [orjson.loads(x)["index"] for x in storage.read_bytes(layout.validated).splitlines()]
    seen: list[int] = []
    for k, plan in enumerate(plans):
        indices = shard_indices(plan)
        assert plan.index == k and plan.count == len(indices) > 0
        assert indices == sorted(indices)  # each shard file in input order
        assert (plan.first_index, plan.last_index) == (indices[0], indices[-1])
        seen += indices
    assert sorted(seen) == validated and len(set(seen)) == len(seen)
    assert len(plans) == expected
    assert plans[0].first_index == validated[0]  # shard 0 holds the first request


@pytest.mark.parametrize("num_shards", [2, 3, 4, 7])
@pytest.mark.parametrize("by", ["count", "tokens"])
def test_same_prefix_lines_land_on_one_shard(num_shards, by):
    layout = new_layout()
    texts, doc_of = doc_qa_texts(docs=24, questions=4)
    write_job(layout, [True] * len(texts), texts=texts)
    plans = plan_shards(layout, num_shards, by=by)
    manifest = read_manifest(layout)
    assert manifest.prefix_aware and manifest.prefix_groups == 24
    assert manifest.estimated_saved_tokens > 0
    assert_every_index_once(layout, plans, num_shards)
    shard_of_doc: dict[int, int] = {}
    for plan in plans:
        for index in shard_indices(plan):
            assert shard_of_doc.setdefault(doc_of[index], plan.index) == plan.index


@pytest.mark.parametrize("num_shards", [2, 4, 8])
def test_prefix_groups_are_balanced_by_tokens(num_shards):
    layout = new_layout()
    rng = random.Random(3)
    # documents of different lengths and question counts, plus short prompts without a prefix
    texts = []
    for d in range(40):
        doc = document(d, chars=rng.choice([1200, 3000, 6000]))
        texts += [f"{doc}\nQ{q}" for q in range(rng.randint(1, 6))]
    texts += [f"short prompt {i}" for i in range(60)]
    rng.shuffle(texts)
    write_job(layout, [True] * len(texts), texts=texts)
    plans = plan_shards(layout, num_shards, by="tokens")
    assert read_manifest(layout).prefix_aware
    assert_every_index_once(layout, plans, num_shards)
    weights = [p.weight for p in plans]
    tokens = [estimate_prompt_tokens({"messages": [{"role": "user", "content": t}]}) for t in texts]
    assert sum(weights) == sum(tokens)
    group_tokens: dict[str, int] = {}
    for text, t in zip(texts, tokens):
        group_tokens[text[:1024]] = group_tokens.get(text[:1024], 0) + t
    ideal, heaviest = sum(weights) / num_shards, max(group_tokens.values())
    assert max(weights) <= ideal + heaviest  # greedy, largest first: within one group
    assert max(weights) - min(weights) <= heaviest


def test_planning_is_deterministic():
    layout = new_layout()
    texts, _ = doc_qa_texts(docs=16, questions=3)
    write_job(layout, [True] * len(texts), texts=texts)
    first = plan_shards(layout, 5, by="tokens")
    files = [storage.read_bytes(p.requests_uri) for p in first]
    manifest = storage.read_bytes(layout.shard_manifest)
    assert plan_shards(layout, 5, by="tokens") == first
    assert [storage.read_bytes(p.requests_uri) for p in first] == files
    assert storage.read_bytes(layout.shard_manifest) == manifest
    other = new_layout()  # a second job with the same input: the same plan
    write_job(other, [True] * len(texts), texts=texts)
    assert [storage.read_bytes(p.requests_uri) for p in plan_shards(other, 5, by="tokens")] == files


def test_off_switch_gives_todays_contiguous_plan():
    texts, _ = doc_qa_texts(docs=12, questions=4)
    on, off, by_setting = new_layout(), new_layout(), new_layout()
    for layout in (on, off, by_setting):
        write_job(layout, [True] * len(texts), texts=texts)
    plan_shards(on, 3)
    assert read_manifest(on).prefix_aware
    off_plans = plan_shards(off, 3, prefix_aware=False)
    off_setting = get_settings().model_copy(update={"prefix_aware_sharding": False})
    setting_plans = plan_shards(by_setting, 3, settings=off_setting)
    for layout, plans in ((off, off_plans), (by_setting, setting_plans)):
        manifest = read_manifest(layout)
        assert not manifest.prefix_aware and manifest.prefix_groups == 0
        joined = b"".join(storage.read_bytes(p.requests_uri) for p in plans)
        assert joined == storage.read_bytes(layout.validated)  # contiguous slices, in order
        assert [p.count for p in plans] == [16, 16, 16]
        assert all(p.digest is None for p in plans)
    assert [p.model_dump(exclude={"requests_uri", "results_uri", "progress_uri"}) for p in off_plans] \
        == [p.model_dump(exclude={"requests_uri", "results_uri", "progress_uri"}) for p in setting_plans]


def test_small_saving_keeps_the_contiguous_plan():
    layout = new_layout()
    texts, _ = doc_qa_texts(docs=12, questions=4)
    write_job(layout, [True] * len(texts), texts=texts)
    plans = plan_shards(layout, 3, min_saving=0.99)
    assert not read_manifest(layout).prefix_aware
    assert b"".join(storage.read_bytes(p.requests_uri) for p in plans) == storage.read_bytes(layout.validated)


def test_no_shared_prefix_keeps_the_contiguous_plan():
    layout = new_layout()
    texts = [document(d, chars=3000) for d in range(40)]  # long, but all different
    write_job(layout, [True] * len(texts), texts=texts)
    plans = plan_shards(layout, 4)
    manifest = read_manifest(layout)
    assert not manifest.prefix_aware and manifest.prefix_groups == 40
    assert b"".join(storage.read_bytes(p.requests_uri) for p in plans) == storage.read_bytes(layout.validated)


def test_a_group_too_big_for_one_shard_splits_along_its_longer_prefixes():
    """A long system prompt shared by every request: one group, split by document."""
    system = "You answer questions about documents. " * 40  # > 1,024 characters
    layout = new_layout()
    pairs = [(d, q) for d in range(16) for q in range(4)]
    random.Random(1).shuffle(pairs)
    texts = [system + document(d, chars=5000) + f"\nQ{q}" for d, q in pairs]
    write_job(layout, [True] * len(texts), texts=texts)
    plans = plan_shards(layout, 4, by="tokens", min_saving=0)
    manifest = read_manifest(layout)
    assert manifest.prefix_aware and manifest.prefix_groups == 1
    assert_every_index_once(layout, plans, 4)
    shard_of_doc: dict[int, set[int]] = {}
    for plan in plans:
        for index in shard_indices(plan):
            shard_of_doc.setdefault(pairs[index][0], set()).add(plan.index)
    assert sum(len(s) for s in shard_of_doc.values()) <= 16 + 3  # at most one cut per boundary
    assert max(p.count for p in plans) - min(p.count for p in plans) <= 4


def test_more_shards_than_requests_and_tiny_jobs():
    texts, _ = doc_qa_texts(docs=2, questions=2)
    layout = new_layout()
    write_job(layout, [True, False, True, True, True], texts=texts[:1] + ["x"] + texts[1:])
    plans = plan_shards(layout, 8, min_saving=0)
    assert_every_index_once(layout, plans, 4)
    layout = new_layout()
    write_job(layout, [False])
    assert plan_shards(layout, 4, min_saving=0) == []


def test_pass_one_holds_a_few_integers_per_line_not_the_lines():
    layout = new_layout()
    texts, _ = doc_qa_texts(docs=500, questions=4, chars=1500)
    write_job(layout, [True] * len(texts), texts=texts)
    size = len(storage.read_bytes(layout.validated))
    lines = _read_lines(layout.validated, "tokens", 1024)
    per_line = [lines.weight, lines.group, lines.long_key]
    assert all(isinstance(a, array) and len(a) == 2000 for a in per_line)
    assert len(lines.g_weight) == 500
    tracemalloc.start()
    try:
        plan_shards(layout, 8, by="tokens")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert read_manifest(layout).prefix_aware
    assert size > 3_000_000 and peak < 1_500_000, (size, peak)  # far below the input's size


def test_prefix_key():
    long = "d" * 1500
    chat = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": long}]}
    assert prefix_key(chat, 1024) == prefix_key({**chat, "max_tokens": 5}, 1024)
    assert prefix_key(chat, 1024)[1] == 0  # shorter than 4 x 1,024 characters
    assert prefix_key({"messages": [{"role": "user", "content": "short"}]}, 1024) is None
    assistant = {"messages": [{"role": "assistant", "content": long}]}
    assert prefix_key(assistant, 1024) != prefix_key({"messages": [{"role": "user", "content": long}]}, 1024)
    tools = {**chat, "tools": [{"type": "function", "function": {"name": "f"}}]}
    assert prefix_key(tools, 1024) != prefix_key(chat, 1024)  # templates render tools first
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": long}]}]}
    assert prefix_key(parts, 1024) == prefix_key({"messages": [{"role": "user", "content": long}]}, 1024)
    assert prefix_key({"prompt": long + "a"}, 1024) == prefix_key({"prompt": long + "b"}, 1024)
    assert prefix_key({"prompt": list(range(600))}, 1024) is not None


# -- invariants with the prefix-aware plan on ---------------------------------------------

LINE = st.sampled_from(["invalid", "ok", "error", "not_run"])


@settings(max_examples=examples(60), deadline=None)
@given(
    lines=st.lists(LINE, max_size=60),
    docs=st.lists(st.integers(0, 6), min_size=60, max_size=60),
    num_shards=st.integers(1, 64),
    by=st.sampled_from(["count", "tokens"]),
    part_size=st.integers(1, 7),
)
def test_every_line_ends_exactly_once_in_order_with_prefix_groups(lines, docs, num_shards, by, part_size):
    layout = new_layout()
    texts = [document(d, 1100) + f" Q{i}" if d else f"short {i}" for i, d in enumerate(docs)]
    requests = write_job(layout, [fate != "invalid" for fate in lines], texts=texts)
    plans = plan_shards(layout, num_shards, by=by, min_saving=0)
    assert sum(p.count for p in plans) == len(requests)
    assert len(plans) == min(num_shards, len(requests))
    if plans:
        assert_every_index_once(layout, plans, len(plans))

    by_index = {r.index: r for r in requests}
    for plan in plans:
        with ResultsWriter.open(plan.results_uri, flush_every_records=part_size) as writer:
            for index in shard_indices(plan):
                fate = lines[index]
                if fate == "ok":
                    writer.write(ok_result(by_index[index]))
                elif fate == "error":
                    writer.write(engine_error(by_index[index]))
                else:  # the shard stopped here: what follows never ran
                    break

    counts = merge_job(layout, json_array=True, not_run_reason="cancelled")
    outputs = [orjson.loads(x) for x in storage.read_bytes(layout.output_jsonl).splitlines()]
    errors = [orjson.loads(x) for x in storage.read_bytes(layout.errors_jsonl).splitlines()]
    ok_indices = [int(o["custom_id"].removeprefix("req-")) for o in outputs]
    error_indices = [e["line"] - 1 for e in errors]
    assert ok_indices == sorted(ok_indices) and error_indices == sorted(error_indices)
    assert sorted(ok_indices + error_indices) == list(range(len(lines)))  # none lost or twice
    scale = orjson.loads(storage.read_bytes(layout.output_json))
    assert len(scale) == len(lines)
    assert counts.total == len(lines) == counts.succeeded + counts.failed
    assert counts.invalid == lines.count("invalid")
    assert counts.succeeded == len(outputs)


# -- the engine loop's feed order -----------------------------------------------------------


class RecordingEngine:
    """Finishes the most recently added request first (a worst case for the reorder)."""

    def __init__(self):
        self.vllm_config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=2))
        self.waiting: list[str] = []
        self.added: list[str] = []

    def add_request(self, request_id, prompt, params, lora_request=None):
        self.waiting.append(request_id)
        self.added.append(request_id)

    def abort_request(self, ids):
        self.waiting = [r for r in self.waiting if r not in ids]

    def step(self):
        from vllm.outputs import CompletionOutput, RequestOutput

        request_id = self.waiting.pop()
        completion = CompletionOutput(index=0, text="ok", token_ids=[1], cumulative_logprob=None,
                                      logprobs=None, finish_reason="stop")
        return [RequestOutput(request_id, "p", [1, 2], None, [completion], finished=True)]


class RecordingLLM:
    def __init__(self, engine):
        self.llm_engine = engine

    def _preprocess_chat_one(self, messages):
        return {"prompt_token_ids": [1, 2, 3]}


def _run_feed(order: str, window: int = 16):
    pytest.importorskip("vllm")
    from llm_batch.core.endpoints import Endpoint
    from llm_batch.runtime.engine.runner import EngineRunner

    texts, doc_of = doc_qa_texts(docs=4, questions=3, seed=5, chars=1100)
    texts.insert(3, "no long prefix")
    doc_of.insert(3, -1)
    requests = [BatchRequest(index=100 + i, custom_id=f"c{i}",
                             body={"messages": [{"role": "user", "content": t}], "max_tokens": 1})
                for i, t in enumerate(texts)]
    engine = RecordingEngine()
    runner = EngineRunner(RecordingLLM(engine), Endpoint.CHAT_COMPLETIONS, "m", window=window,
                          feed_order=order)
    emitted: list[int] = []
    assert runner.run(requests, lambda record, usage: emitted.append(record.index)) is None
    fed = [int(r.rsplit("-", 1)[-1].split(".")[0]) for r in engine.added]  # ids: "<run>-<position>.<part>"
    return fed, emitted, doc_of, requests


def test_feed_order_grouped_keeps_prefix_groups_together_and_emits_in_order():
    fed, emitted, doc_of, requests = _run_feed("grouped")
    assert emitted == [r.index for r in requests]
    assert sorted(fed) == list(range(len(requests)))
    runs = [doc_of[p] for p in fed]
    changes = sum(1 for a, b in zip(runs, runs[1:]) if a != b)
    assert changes == 4  # 4 documents + the one prompt without a prefix: 5 runs
    assert fed[0] == 0  # groups in the order of their first request


def test_feed_order_leaders_first_and_file_order():
    fed, emitted, doc_of, requests = _run_feed("leaders_first")
    assert emitted == [r.index for r in requests]
    leaders = [doc_of[p] for p in fed[:5]]
    assert sorted(leaders) == [-1, 0, 1, 2, 3]  # one request of every group first
    fed, emitted, _, requests = _run_feed("file")
    assert fed == list(range(len(requests))) and emitted == [r.index for r in requests]


def test_feed_order_respects_the_window():
    fed, emitted, doc_of, requests = _run_feed("grouped", window=4)
    assert emitted == [r.index for r in requests]
    # batches of at least half the window are reordered within themselves only
    assert sorted(fed[:4]) == [0, 1, 2, 3]


def test_replanning_keeps_checkpoints_only_for_the_same_requests():
    from llm_batch.core.records import ResultRecord
    from llm_batch.infra.results import count_results

    layout = new_layout()
    texts, _ = doc_qa_texts(docs=12, questions=4)
    write_job(layout, [True] * len(texts), texts=texts)
    plans = plan_shards(layout, 3)
    assert read_manifest(layout).prefix_aware and all(p.digest for p in plans)
    for plan in plans:
        with ResultsWriter.open(plan.results_uri) as writer:
            writer.write(ResultRecord(index=plan.first_index, custom_id="x", status_code=200, body={}))
    assert [count_results(p.results_uri) for p in plan_shards(layout, 3)] == [1, 1, 1]
    # the contiguous plan of the same job holds other requests: results discarded
    assert [count_results(p.results_uri) for p in plan_shards(layout, 3, prefix_aware=False)] == [0, 0, 0]
