"""The result cache through the pipeline's own steps (register, validate, plan, merge) on a
real SQLite job store and local storage, with a stand-in worker (the real engine's run is
tests/dags/test_result_cache_dag.py, kill -9 during cache writes on SeaweedFS
tests/integration/test_result_cache_s3.py):

which requests are cacheable and what their key depends on; a second job of the same owner
answered from the first's results (only its new lines planned, cached lines marked, counted,
identical to the first job's answers, in input order among the rest); another owner, an
opted-out job, a changed model configuration: misses; a torn or foreign object: a miss;
deleting the job that computed an entry removes it; expiry and the size bound.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import orjson
import pytest

from llm_batch.core import run_conf
from llm_batch.core.config import Settings
from llm_batch.core.records import BatchRequest, ResultRecord
from llm_batch.infra import storage
from llm_batch.infra.jobstore import JobStore
from llm_batch.infra.jobstore.result_cache import TOUCH_RESOLUTION
from llm_batch.infra.result_cache import CacheKeys, cacheable
from llm_batch.infra.results import ResultsWriter
from llm_batch.pipeline import housekeeping, result_cache, shard_task, steps

CHAT = "/v1/chat/completions"


@pytest.fixture
def settings() -> Settings:
    # A cache of its own per test, inside the test home (storage's allowed local areas).
    return Settings(result_cache=True, result_cache_uri=str(Settings().home / f"result-cache-{uuid.uuid4().hex[:8]}"))


@pytest.fixture
def store(sqlite_store_url: str) -> JobStore:
    store = JobStore(sqlite_store_url)
    yield store
    store.close()


def _line(i: int, custom_id: str | None = None, **sampling) -> bytes:
    body = {"messages": [{"role": "user", "content": f"question {i}"}], "max_tokens": 4, **sampling}
    return orjson.dumps({"custom_id": custom_id or f"q{i}", "body": body})


def _conf(settings: Settings, lines: list[bytes], owner: str = run_conf.DEFAULT_OWNER, **extra) -> dict:
    path = settings.local_roots[0] / owner / f"in-{uuid.uuid4().hex[:8]}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\n".join(lines) + b"\n")
    return {"input_uri": str(path), "model": "tiny-random-llama", "owner": owner, **extra}


def _answer(request: dict) -> dict:
    """The stand-in engine: an answer that names the job that computed it."""
    return {"object": "chat.completion", "model": "tiny-random-llama",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": f"answer to {request['custom_id']}"}}],
            "usage": {"prompt_tokens": 6, "completion_tokens": 3, "total_tokens": 9}}


def _run(store: JobStore, settings: Settings, conf: dict) -> tuple[str, list[int]]:
    """A whole job through the steps; returns its id and how many requests each shard ran."""
    job_id = steps.register(store, settings, conf, f"manual__{uuid.uuid4().hex}", trusted=True)
    steps.validate(store, settings, job_id)
    ran = []
    for task in steps.plan(store, settings, job_id):
        shard = shard_task.ShardTask.model_validate(task.model_dump())
        requests = [orjson.loads(line) for line in storage.read_bytes(shard.requests_uri).splitlines()]
        with ResultsWriter.open(shard.results_uri) as writer:
            for request in requests:
                writer.write(ResultRecord(index=request["index"], custom_id=request["custom_id"], status_code=200,
                                          body=_answer(request)))
        ran.append(len(requests))
    steps.merge(store, settings, job_id)
    steps.finalize(store, settings, job_id)
    return job_id, ran


def _outputs(settings: Settings, job_id: str) -> list[dict]:
    return [orjson.loads(line) for line in
            storage.read_bytes(steps.layout_of(settings, job_id).output_jsonl).splitlines()]


def test_what_is_cacheable_and_what_decides_the_key():
    def request(**body) -> BatchRequest:
        return BatchRequest(index=0, custom_id="a", body={"messages": [{"role": "user", "content": "hi"}], **body})

    assert cacheable(CHAT, request(temperature=0)) and cacheable(CHAT, request(seed=7))
    assert cacheable("/v1/completions", request(temperature=0.0))
    assert cacheable("/v1/embeddings", request())
    assert not cacheable(CHAT, request()) and not cacheable(CHAT, request(temperature=0.7))
    assert not cacheable(CHAT, request(seed=True)) and not cacheable(CHAT, request(temperature=False))
    assert not cacheable("/v1/audio/transcriptions", request(temperature=0))
    named_file = request(temperature=0).model_copy(update={"media": {"uri": "/x.wav"}})
    assert not cacheable(CHAT, named_file)

    identity = {"model": "m", "spec": None, "model_config": {}}

    def cache_key(identity, endpoint, request, *, lora, adapter_spec=None):
        return CacheKeys(identity, endpoint).of(request, lora=lora, adapter_spec=adapter_spec)

    base = cache_key(identity, CHAT, request(temperature=0, max_tokens=4), lora=False)
    assert base == cache_key(identity, CHAT, request(max_tokens=4, temperature=0), lora=False)  # key order is not content
    others = {
        cache_key(identity, CHAT, request(temperature=0, max_tokens=5), lora=False),
        cache_key({**identity, "model_config": {"dtype": "float32"}}, CHAT, request(temperature=0, max_tokens=4),
                  lora=False),
        cache_key(identity, "/v1/completions", request(temperature=0, max_tokens=4), lora=False),
        cache_key(identity, CHAT, request(temperature=0, max_tokens=4).model_copy(update={"adapter": "lora-a"}),
                  lora=False),
        cache_key(identity, CHAT, request(temperature=0, max_tokens=4), lora=True),  # an engine with LoRA on
        cache_key(identity, CHAT, request(temperature=0, max_tokens=4), lora=False, adapter_spec={"rank": 8}),
    }
    assert base not in others and len(others) == 6
    # Every key of one model, config and endpoint starts alike: a first run asks the index once.
    prefix = CacheKeys(identity, CHAT).prefix
    assert base.startswith(prefix) and len(base) == 64
    assert cache_key(identity, CHAT, request(temperature=0, max_tokens=5), lora=True).startswith(prefix)
    assert not cache_key(identity, "/v1/completions", request(temperature=0), lora=False).startswith(prefix)


def test_holds_cache_prefix_answers_per_owner_prefix_and_age(store):
    from llm_batch.infra.result_cache import Packed

    key = "0123456789abcdef" + "f" * 48
    store.put_cache_entries(owner="alice", job_id="job_a", uri="pack-a", packed=[Packed(key, 0, 10, 1, 1)])
    recent = datetime.now(UTC) - timedelta(hours=1)
    assert store.holds_cache_prefix("alice", key[:16], made_after=recent)
    assert store.holds_cache_prefix("alice", key[:4], made_after=recent)
    assert not store.holds_cache_prefix("alice", "0123456789abcdee", made_after=recent)  # a neighbour of it
    assert not store.holds_cache_prefix("alice", "0123456789abcdf0", made_after=recent)
    assert not store.holds_cache_prefix("bob", key[:16], made_after=recent)  # another owner's
    assert not store.holds_cache_prefix("alice", key[:16], made_after=datetime.now(UTC) + timedelta(hours=1))


def test_a_first_run_of_an_uncached_model_is_not_looked_up_line_by_line(store, settings, monkeypatch):
    """Nothing cached of the job's model, config and endpoint: the plan runs the validated file
    itself, no split written, and no line looked up (one indexed question instead)."""
    lines = [_line(i, temperature=0) for i in range(3)]
    _run(store, settings, _conf(settings, lines))  # the cache now holds this config's answers
    other = _conf(settings, lines, model_config={"dtype": "float32"})
    job_id = steps.register(store, settings, other, f"manual__{uuid.uuid4().hex}", trusted=True)
    steps.validate(store, settings, job_id)
    layout = steps.layout_of(settings, job_id)
    looked_up: list[list[str]] = []
    monkeypatch.setattr(store, "cached_answers", lambda owner, keys, **_: looked_up.append(list(keys)) or {})
    assert result_cache.answer_from_cache(store, settings, store.get_job(job_id), layout) == layout.validated
    assert not storage.exists(layout.cached_results) and not storage.exists(layout.uncached)
    assert looked_up == []


def test_two_jobs_differing_only_in_the_engine_s_lora_state_have_different_keys(store, settings):
    """Issue 43, finding 10: a greedy base line's answer from an engine with LoRA on (its
    shard had adapter lines) is not a base-only engine's; equal configurations share a key."""
    job_id = steps.register(store, settings, _conf(settings, [_line(0, temperature=0)]), f"manual__{uuid.uuid4().hex}",
                            trusted=True)
    keys = result_cache._Keys(settings, store.get_job(job_id))
    again = result_cache._Keys(settings, store.get_job(job_id))
    line = BatchRequest(index=0, custom_id="a", body={"messages": [{"role": "user", "content": "hi"}], "temperature": 0})
    assert keys.of(line, lora=False) == again.of(line, lora=False) == keys.of(line)  # a lookup: a base line, LoRA off
    assert keys.of(line, lora=True) == again.of(line, lora=True) != keys.of(line, lora=False)
    adapted = line.model_copy(update={"adapter": "tiny-lora-a", "body": {**line.body, "model": "tiny-lora-a"}})
    assert keys.of(adapted) == keys.of(adapted, lora=True)  # an adapter line's engine has LoRA on


def test_a_mixed_job_s_base_lines_run_without_lora_and_are_served_to_base_lines(store, settings):
    """The fill keys each answer with its shard's LoRA state; a lookup asks for a base line as
    a base-only engine answers it. A job mixing base and adapter lines runs its base lines on a
    shard of their own (LoRA off), so their answers serve a base-only job."""
    adapter_line = orjson.dumps({"custom_id": "a1", "body": {"model": "tiny-lora-a", "temperature": 0, "max_tokens": 4,
                                                            "messages": [{"role": "user", "content": "question 1"}]}})
    mixed = [_line(0, temperature=0), adapter_line, _line(2, temperature=0)]
    first, ran = _run(store, settings, _conf(settings, mixed))
    assert ran == [2, 1]  # one shard asked: the base lines' shard, then the adapter's
    # The adapter's shard goes to a warm engine with LoRA on, the base lines' to one without.
    assert [steps.shard_task({"job_id": first, "shard": i}, settings, store).lora for i in (0, 1)] == [False, True]
    base_only, ran = _run(store, settings, _conf(settings, [_line(0, temperature=0), _line(2, temperature=0)]))
    assert sum(ran) == 0 and store.get_job(base_only).result_cache_hits == 2
    again, ran = _run(store, settings, _conf(settings, mixed))
    assert sum(ran) == 0 and store.get_job(again).result_cache_hits == 3


def test_a_second_job_is_answered_from_the_first(store, settings):
    first, ran = _run(store, settings, _conf(settings, [_line(i, temperature=0) for i in range(10)],
                                             data_parallelism=2))
    assert sum(ran) == 10
    assert store.get_job(first).result_cache_hits == 0
    # Filled in bulk: one pack object per shard, whatever the number of answers.
    assert len([p for p in Path(settings.result_cache_uri).rglob("*") if p.is_file()]) == len(ran) == 2
    # Nothing cached yet: planned from the validated file itself, no copy of it written.
    assert not storage.exists(steps.layout_of(settings, first).uncached)

    # 9 of the 10 again (one changed), a sampled line, and two new ones, interleaved.
    lines = [_line(i, temperature=0) for i in range(9)] + [_line(99, temperature=0), _line(5, "sampled")]
    lines.insert(4, _line(50, temperature=0))
    second, ran = _run(store, settings, _conf(settings, lines, data_parallelism=2))
    assert sum(ran) == 3, "only the new and the sampled lines run on the engine"
    job = store.get_job(second)
    assert (job.status.value, job.total, job.succeeded) == ("SUCCEEDED", 12, 12)
    assert (job.result_cache_hits, job.result_cache_tokens) == (9, 9 * 9)
    assert job.prompt_tokens == 12 * 6  # the cached lines' usage counts as theirs

    outputs = _outputs(settings, second)
    assert [o["custom_id"] for o in outputs] == [orjson.loads(line)["custom_id"] for line in lines]
    cached = [o["custom_id"] for o in outputs if o["response"].get("cached")]
    assert cached == [f"q{i}" for i in range(9)]
    earlier = {o["custom_id"]: o["response"]["body"] for o in _outputs(settings, first)}
    assert all(o["response"]["body"] == earlier[o["custom_id"]] for o in outputs if o["response"].get("cached"))

    # The same owner's third run is all cached: no shard at all, every line answered.
    third, ran = _run(store, settings, _conf(settings, [_line(i, temperature=0) for i in range(3)]))
    assert ran == [] and store.get_job(third).result_cache_hits == 3
    assert store.get_job(third).status.value == "SUCCEEDED"


def test_other_owners_opted_out_jobs_and_other_configurations_miss(store, settings):
    lines = [_line(i, temperature=0) for i in range(4)]
    _run(store, settings, _conf(settings, lines))
    _, ran = _run(store, settings, _conf(settings, lines, owner="bob"))
    assert ran == [4]
    _, ran = _run(store, settings, _conf(settings, lines, result_cache=False))
    assert ran == [4]
    _, ran = _run(store, settings, _conf(settings, lines, model_config={"max_model_len": 256}))
    assert ran == [4]
    _, ran = _run(store, settings, _conf(settings, lines))
    assert ran == []
    off = settings.model_copy(update={"result_cache": False})
    _, ran = _run(store, off, _conf(off, lines))
    assert ran == [4]
    # One tenant: the deployment's setting makes one cache of every owner's answers.
    shared = settings.model_copy(update={"result_cache_shared": True})
    _, ran = _run(store, shared, _conf(shared, lines, owner="carol"))
    assert ran == [4]  # the shared cache starts empty
    _, ran = _run(store, shared, _conf(shared, lines, owner="dave"))
    assert ran == []


def test_an_opted_out_job_fills_nothing(store, settings):
    lines = [_line(i, seed=3) for i in range(3)]
    _run(store, settings, _conf(settings, lines, result_cache=False))
    _, ran = _run(store, settings, _conf(settings, lines))
    assert ran == [3]


def test_a_torn_or_foreign_answer_is_a_miss(store, settings):
    lines = [_line(i, temperature=0) for i in range(3)]
    first, _ = _run(store, settings, _conf(settings, lines))
    recent = datetime.now(UTC) - timedelta(days=1)
    entries = sorted(store.cached_answers(run_conf.DEFAULT_OWNER, _keys(store, settings, first),
                                         made_after=recent).values(), key=lambda e: e.at_byte)
    assert len({e.uri for e in entries}) == 1  # one pack for the shard's answers
    pack = Path(entries[0].uri)
    data = bytearray(pack.read_bytes())

    def replace(entry, line: bytes) -> None:  # in place: the other answers keep their ranges
        data[entry.at_byte:entry.at_byte + entry.bytes] = line.ljust(entry.bytes - 1) + b"\n"

    replace(entries[0], b'{"key": "')  # torn
    replace(entries[1], orjson.dumps({"key": "0" * 64, "body": {"object": "x"}}))  # another key's
    pack.write_bytes(bytes(data))
    _, ran = _run(store, settings, _conf(settings, lines))
    assert ran == [2]


def test_deleting_the_job_that_filled_entries_removes_them(store, settings):
    lines = [_line(i, temperature=0) for i in range(3)]
    first, _ = _run(store, settings, _conf(settings, lines))
    uris = [e.uri for e in store.cached_answers(run_conf.DEFAULT_OWNER, _keys(store, settings, first),
                                               made_after=datetime.now(UTC) - timedelta(days=1)).values()]
    assert len(uris) == 3 and all(storage.exists(u) for u in uris)
    housekeeping.delete_job(store, settings, store.get_job(first))
    assert not any(storage.exists(u) for u in uris)
    _, ran = _run(store, settings, _conf(settings, lines))
    assert ran == [3]


def _keys(store: JobStore, settings: Settings, job_id: str) -> list[str]:
    job = store.get_job(job_id)
    keys = result_cache._Keys(settings, job)
    layout = steps.layout_of(settings, job_id)
    return [keys.of(BatchRequest.model_validate_json(line)) for line in storage.read_bytes(layout.validated).splitlines()]


def test_expiry_and_the_size_bound(store, settings):
    lines = [_line(i, temperature=0) for i in range(6)]
    first, _ = _run(store, settings, _conf(settings, lines))
    keys = _keys(store, settings, first)
    recent = datetime.now(UTC) - timedelta(days=1)
    size = sum(e.bytes for e in store.cached_answers(run_conf.DEFAULT_OWNER, keys, made_after=recent).values())
    later = datetime.now(UTC) + TOUCH_RESOLUTION  # a touch within it changes nothing
    store.touch_cache_entries(run_conf.DEFAULT_OWNER, keys[3:], now=later)  # the last three used last
    # The first three used within the resolution of their fill: not marked again (a rerun writes nothing).
    store.touch_cache_entries(run_conf.DEFAULT_OWNER, keys[:3], now=datetime.now(UTC) + TOUCH_RESOLUTION / 2)

    bounded = settings.model_copy(update={"result_cache_max_bytes": size // 2 + 1})
    assert result_cache.evict(store, bounded) == 3
    left = store.cached_answers(run_conf.DEFAULT_OWNER, keys, made_after=recent)
    assert set(left) == set(keys[3:])
    assert all(Path(e.uri).is_file() for e in left.values())  # their pack stays while any answer in it does
    assert result_cache.evict(store, settings, now=datetime.now(UTC) + timedelta(hours=settings.result_cache_ttl_hours + 1)) == 3
    assert store.cached_answers(run_conf.DEFAULT_OWNER, keys, made_after=recent) == {}
    assert not any(Path(p).is_file() for p in Path(settings.result_cache_uri).rglob("*.jsonl"))  # packs freed


def test_the_batch_steps_manifest_carries_the_cached_count():
    pytest.importorskip("airflow.sdk")
    from llm_batch.airflow.operators.batch_step import manifest_of

    job = {"id": "j", "status": "SUCCEEDED", "counts": {"total": 5, "succeeded": 5, "failed": 0},
           "usage": {"cached_requests": 3, "cached_tokens": 27}}
    manifest = manifest_of(job)
    assert (manifest["succeeded"], manifest["cached"], manifest["missing"]) == (5, 3, 0)
    assert manifest_of({**job, "usage": {}})["cached"] == 0


def test_an_engine_is_started_early_only_when_the_cache_cannot_answer(store, settings):
    """The prepare step starts the shards' engine while it plans (``steps.engine_to_warm``),
    unless the cache holds answers of the job's model, config and endpoint for its owner."""
    lines = [_line(i, temperature=0) for i in range(3)]

    def registered(conf: dict) -> str:
        job_id = steps.register(store, settings, conf, f"manual__{uuid.uuid4().hex}", trusted=True)
        steps.validate(store, settings, job_id)
        return job_id

    first = registered(_conf(settings, lines))
    assert steps.engine_to_warm(store, settings, first) == ({"model": "tiny-random-llama"}, False)
    _run(store, settings, _conf(settings, lines))  # the cache now holds this configuration's answers
    again = registered(_conf(settings, lines))
    assert steps.engine_to_warm(store, settings, again) is None
    assert steps.engine_to_warm(store, settings.model_copy(update={"result_cache": False}), again) is not None
    bob = registered(_conf(settings, lines, owner="bob"))  # another owner's cache is empty
    assert steps.engine_to_warm(store, settings, bob) == ({"model": "tiny-random-llama"}, False)
    # A job of an adapter loads its base with LoRA on, in the one engine of every adapter of that base.
    adapter_job = registered(_conf(settings, lines, model="tiny-lora-a"))
    assert steps.engine_to_warm(store, settings, adapter_job) == ({"model": "tiny-random-llama"}, True)
