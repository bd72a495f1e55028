"""One warm engine shared by shards at once (``llm_batch.runtime.warm_engines``: ``SharedEngine``,
``EngineView``, ``KeptEngine``), on a stand-in engine for speed; the real engine runs the
same paths in ``tests/engine/test_warm_engine.py``."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from llm_batch.runtime import warm_engines
from llm_batch.runtime.warm_engines import EngineView, KeptEngine, SharedEngine, WarmEngineError


@dataclass
class Output:
    request_id: str
    finished: bool


class FakeEngine:
    """Finishes one request per step, oldest first; reports the others unfinished."""

    def __init__(self) -> None:
        self.pending: list[str] = []
        self.steps = 0
        self.aborted: list[str] = []

    def add_request(self, request_id, prompt, params, lora_request=None):
        self.pending.append(request_id)

    def step(self):
        self.steps += 1
        if not self.pending:
            return []
        done, *rest = self.pending
        self.pending = rest
        return [Output(done, True), *(Output(r, False) for r in rest)]

    def abort_request(self, ids):
        self.aborted += ids
        self.pending = [r for r in self.pending if r not in ids]


def _shared() -> SharedEngine:
    return SharedEngine(SimpleNamespace(llm_engine=FakeEngine(), model_config="the model's"))


def test_a_step_by_one_shard_delivers_the_other_shards_finished_outputs():
    shared = _shared()
    a, b = shared.for_shard(), shared.for_shard()
    a.llm_engine.add_request("aaaa-0.0", "p", None)
    b.llm_engine.add_request("bbbb-0.0", "p", None)
    assert b.llm_engine.step() == []  # finished a's request: into a's box
    steps = shared.llm.llm_engine.steps
    assert [o.request_id for o in a.llm_engine.step()] == ["aaaa-0.0"]
    assert shared.llm.llm_engine.steps == steps, "a's outputs were waiting: no step needed"
    assert [o.request_id for o in b.llm_engine.step()] == ["bbbb-0.0"]
    # Everything else is the engine's and the model's.
    assert a.model_config == "the model's" and a.llm_engine.pending == []


def test_a_closed_shards_late_outputs_are_dropped_not_handed_to_another():
    shared = _shared()
    a, b = shared.for_shard(), shared.for_shard()
    a.llm_engine.add_request("aaaa-0.0", "p", None)
    b.llm_engine.add_request("bbbb-0.0", "p", None)
    a.llm_engine.close()
    assert b.llm_engine.step() == []
    assert [o.request_id for o in b.llm_engine.step()] == ["bbbb-0.0"]


def test_the_view_feeds_under_the_engines_lock():
    shared = _shared()
    view = shared.for_shard().llm_engine
    assert isinstance(view, EngineView) and view.submit_lock is shared.lock


@pytest.fixture
def engines(monkeypatch):
    started: list[dict] = []
    stopped: list[object] = []

    def start(model):
        started.append(model.engine_args)
        return SimpleNamespace(llm_engine=FakeEngine())

    monkeypatch.setattr("llm_batch.runtime.engine.runner.start_engine", start)
    monkeypatch.setattr("llm_batch.runtime.engine.runner.stop_engine", stopped.append)
    return started, stopped


def _model(**engine_args):
    return SimpleNamespace(name="m", engine_args=engine_args)


def test_shards_of_one_configuration_share_the_engine(engines):
    started, _ = engines
    kept = KeptEngine()
    first, second = kept.get(_model(seed=1)), kept.get(_model(seed=1))
    assert started == [{"seed": 1}]
    assert first.llm_engine is not second.llm_engine and first._llm is second._llm


def test_another_configuration_waits_until_the_running_shards_end(engines):
    started, stopped = engines
    kept = KeptEngine()
    running = kept.get(_model(seed=1))
    got: list = []
    other = threading.Thread(target=lambda: got.append(kept.get(_model(seed=2))))
    other.start()
    time.sleep(0.2)
    assert not got and started == [{"seed": 1}], "the engine was swapped under a running shard"
    kept.release(running, healthy=True)
    other.join(5)
    assert got and started == [{"seed": 1}, {"seed": 2}] and len(stopped) == 1


def test_a_failure_stops_the_engine_once_its_other_shards_end_and_takes_no_more(engines):
    _, stopped = engines
    kept = KeptEngine()
    failing, other = kept.get(_model()), kept.get(_model())
    kept.release(failing, healthy=False)
    assert kept.broken and stopped == [], "stopped under a running shard"
    with pytest.raises(WarmEngineError):
        kept.get(_model())
    kept.release(other, healthy=True)
    assert len(stopped) == 1


def test_seats_fill_idle_engines_before_second_seats(tmp_path):
    taken = [warm_engines._take_seat(tmp_path, "k", engines=2, seats=2) for _ in range(4)]
    for *_, fd in taken:
        os.close(fd)
    assert [(slot.index, seat) for slot, seat, _ in taken] == [(0, 0), (1, 0), (0, 1), (1, 1)]


def test_the_local_pool_has_a_slot_per_seat_of_each_engine_with_warm_engines():
    from llm_batch.airflow.lanes import pool_specs
    from llm_batch.core.config import Settings

    def local_slots(**settings) -> int:
        made = Settings(**settings)
        return next(p.slots for p in pool_specs(made) if p.name == made.local_pool)

    assert local_slots(local_pool_slots=2, warm_engines=False) == 2  # dedicated engines: one shard each
    assert local_slots(local_pool_slots=2, warm_engines=True) == 4  # two seats each by default
    assert local_slots(local_pool_slots=1, warm_engines=True, warm_engine_seats=1) == 1


def test_a_host_serves_only_shards_of_its_model_configuration_and_environment():
    """A changed setting (another object store, roots, KV-cache size) keys another host: the
    one started before the change serves none of the shards after it."""
    from llm_batch.runtime.warm_engines import engine_key

    config = {"model": "m", "engine_args": {"max_num_seqs": 2}}
    env = {"LLM_BATCH_LOCAL_ROOTS": "/a", "VLLM_CPU_KVCACHE_SPACE": "1", "PYTEST_CURRENT_TEST": "x", "PATH": "/bin"}
    key = engine_key(config, env)
    assert engine_key(dict(reversed(list(config.items()))), dict(env)) == key
    assert engine_key(config, {**env, "PYTEST_CURRENT_TEST": "y", "PATH": "/usr/bin"}) == key  # not the host's
    assert engine_key(config, dict(env), lora=True) != key  # a shard with adapters: a host with LoRA on
    for name, value in [("LLM_BATCH_LOCAL_ROOTS", "/b"), ("VLLM_CPU_KVCACHE_SPACE", "2"),
                        ("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:1"), ("HF_ENDPOINT", "http://mirror")]:
        assert engine_key(config, {**env, name: value}) != key, name
    assert engine_key({**config, "engine_args": {"max_num_seqs": 4}}, env) != key
    # What only a shard's results say (labels, the role and model name they carry) loads nothing.
    assert engine_key({**config, "labels": {"team": "a"}, "response_role": "bot", "served_model_name": "n"}, env) == key
    assert engine_key({**config, "chat_template": "chatml"}, env) != key


def test_an_engine_run_in_the_starting_process_keys_no_new_host_and_lends_it_no_ipc_names():
    """vLLM names each engine's IPC in the environment of the process it ran in (and model
    preparation turns the hubs offline): a task process that ran one still finds the host of
    its configuration, and a new host gets none of those names."""
    from llm_batch.runtime.warm_engines import engine_key, host_environment

    config = {"model": "m"}
    env = {"LLM_BATCH_LOCAL_ROOTS": "/a", "VLLM_CPU_KVCACHE_SPACE": "1"}
    after_an_engine = {**env, "VLLM_DIST_IDENT": "vllm_dist_1", "VLLM_OBJECT_STORAGE_SHM_BUFFER_NAME": "vllm_mm_1",
                       "VLLM_WORKER_MULTIPROC_METHOD": "spawn", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                       "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    assert engine_key(config, after_an_engine) == engine_key(config, env)
    assert host_environment(after_an_engine) == env
