"""An engine that dies mid-shard: the worker exits FAILED with the finished prefix kept, and
the rerun resumes after it. A stand-in engine (real vLLM output objects, no model) keeps this
fast; the real engine's kill -9 and resume is tests/engine/test_worker_process.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from llm_batch.core import exit_codes
from llm_batch.core.layout import JobLayout
from llm_batch.core.records import BatchRequest, dumps_line
from llm_batch.infra.progress import ShardState, read_progress
from llm_batch.infra.results import read_results
from llm_batch.runtime.worker import parse_config, run_worker


class StandInEngine:
    """Finishes one request a step, pairwise out of order (1, 0, 3, 2, ...); dies after ``die_after`` steps."""

    def __init__(self, die_after: int | None = None):
        self.vllm_config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=2))
        self.waiting: list[str] = []
        self.steps = 0
        self.die_after = die_after

    def add_request(self, request_id, prompt, params, lora_request=None):
        self.waiting.append(request_id)

    def abort_request(self, ids):
        self.waiting = [r for r in self.waiting if r not in ids]

    def step(self):
        from vllm.outputs import CompletionOutput, RequestOutput  # vLLM: imported when a test runs

        self.steps += 1
        if self.die_after is not None and self.steps > self.die_after:
            raise RuntimeError("EngineCore died")
        request_id = self.waiting.pop(1 if self.steps % 2 and len(self.waiting) > 1 else 0)
        completion = CompletionOutput(index=0, text="ok", token_ids=[1, 2], cumulative_logprob=None,
                                      logprobs=None, finish_reason="stop")
        return [RequestOutput(request_id, "p", [1, 2, 3], None, [completion], finished=True)]


class StandInLLM:
    def __init__(self, engine: StandInEngine):
        self.llm_engine = engine

    def _preprocess_chat_one(self, messages):
        return {"prompt_token_ids": [1, 2, 3]}


@pytest.fixture
def shard(llm_batch_home, tiny_model_dir):
    layout = JobLayout(str(llm_batch_home / "work"), "engine-dies")
    path = llm_batch_home / "work" / "engine-dies" / "shards" / "00000" / "requests.jsonl"
    path.parent.mkdir(parents=True)
    path.write_bytes(b"".join(
        dumps_line(BatchRequest(index=10 + i, custom_id=f"c{i}", body={"messages": [{"role": "user", "content": "x"}]}))
        for i in range(12)))
    return layout


def _run(layout, monkeypatch, engine) -> int:
    from llm_batch.runtime.engine import runner as engine_runner  # vLLM: imported when a test runs

    monkeypatch.setattr(engine_runner, "start_engine", lambda model: StandInLLM(engine))
    config = parse_config(job_id=layout.job_id, shard=0, requests=None, results=None,
                          endpoint="/v1/chat/completions", model_config={"model": "tiny-random-llama"},
                          work_uri=layout.work_uri, flush_every_records=1)
    return run_worker(config)


def test_engine_crash_fails_the_attempt_and_the_rerun_resumes(shard, monkeypatch):
    assert _run(shard, monkeypatch, StandInEngine(die_after=7)) == exit_codes.FAILED
    kept = [r.index for r in read_results(shard.shard(0).results)]
    assert kept and kept == list(range(10, 10 + len(kept))) and len(kept) < 12
    assert read_progress(shard.shard(0).progress).state == ShardState.FAILED

    assert _run(shard, monkeypatch, StandInEngine()) == exit_codes.DONE
    records = list(read_results(shard.shard(0).results))
    assert [r.index for r in records] == list(range(10, 22))
    progress = read_progress(shard.shard(0).progress)
    # The earlier attempt's successes count too: live counts never go back on a resume.
    assert (progress.state, progress.done, progress.resumed, progress.succeeded) == (
        ShardState.DONE, 12, len(kept), 12)
