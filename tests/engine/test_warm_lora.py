"""LoRA adapters on a warm engine (``llm_batch.runtime.warm_engines``): two jobs' shards, in
turn on one ``llm-batch engine-host`` with the real engine and the tiny model's random
adapters, the first naming adapters a and b, the second b, a and the base. The second runs
on the same engine, each line is answered by the model it named, and each model answers a
prompt the same in both jobs: the adapters stayed loaded and kept apart across jobs. Its
host is a fresh interpreter (``warm_engine_starter`` off), the other warm-engine modules'
are forked by a host starter.
"""

from __future__ import annotations

import os

import orjson
import psutil
import pytest

from llm_batch.core import exit_codes
from llm_batch.core.config import get_settings
from llm_batch.core.layout import JobLayout
from llm_batch.core.records import BatchRequest, dumps_line
from llm_batch.infra import storage
from llm_batch.infra.results import read_results
from llm_batch.runtime.warm_engines import start_shard, starters_dir

pytestmark = pytest.mark.engine

BASE = "tiny-random-llama"
MODEL_CONFIG = {"model": BASE, "max_context_length": 512}
PROMPTS = ["The quick brown fox", "Once upon a time"]


@pytest.fixture(scope="module")
def settings(tiny_adapters, hosts_home):
    # The module's one host starts as a fresh interpreter (no host starter): that path keeps a
    # test through the real engine, at no cost here (a starter pays off from a home's second host).
    return get_settings().model_copy(update={"home": hosts_home, "local_pool_slots": 1, "warm_engine_seats": 1,
                                             "warm_engine_idle_seconds": 600, "warm_engine_starter": False})


def _job(name: str, models: list[str | None]) -> JobLayout:
    """A one-shard job: each of PROMPTS on each model (None: the base), greedy."""
    layout = JobLayout(str(get_settings().home / "work"), name)
    requests = [BatchRequest(index=i, custom_id=f"{model or 'base'}:{p}", adapter=model, body={
        "model": model or BASE, "messages": [{"role": "user", "content": prompt}], "max_tokens": 6,
        "temperature": 0}) for i, (model, (p, prompt)) in enumerate(
            (m, pp) for m in models for pp in enumerate(PROMPTS))]
    storage.write_bytes(layout.shard(0).requests, b"".join(dumps_line(r) for r in requests))
    return layout


def _run(settings, layout: JobLayout):
    argv = ["worker", "--job-id", layout.job_id, "--shard", "0", "--work-uri", layout.work_uri,
            "--endpoint", "/v1/chat/completions", "--model-config", orjson.dumps(MODEL_CONFIG).decode()]
    return start_shard(settings, MODEL_CONFIG, argv, lambda line: None)


def _answers(layout: JobLayout) -> dict[str, tuple[str, str]]:
    """custom_id -> (the model that answered, its text)."""
    return {r.custom_id: (r.body["model"], r.body["choices"][0]["message"]["content"])
            for r in read_results(layout.shard(0).results)}


def test_adapters_stay_loaded_and_apart_across_jobs(settings):
    first, second = _job("warm-lora-1", ["tiny-lora-a", "tiny-lora-b"]), _job("warm-lora-2",
                                                                             ["tiny-lora-b", "tiny-lora-a", None])
    one = _run(settings, first)
    assert one.wait(240) == exit_codes.DONE
    two = _run(settings, second)
    assert two.wait(240) == exit_codes.DONE
    assert two.pid == one.pid, "the second job's shard went to another engine"
    assert psutil.Process(one.pid).ppid() == os.getpid()  # a fresh interpreter, started by this process
    assert not list(starters_dir(settings.home).glob("*.pid"))

    before, after = _answers(first), _answers(second)
    assert len(before) == 4 and len(after) == 6
    for custom_id, (model, _) in {**before, **after}.items():
        assert model == (BASE if custom_id.startswith("base:") else custom_id.split(":")[0])
    assert all(after[cid] == answer for cid, answer in before.items()), "an adapter answered differently"
    for p in range(len(PROMPTS)):
        texts = {after[f"{m}:{p}"][1] for m in ("tiny-lora-a", "tiny-lora-b", "base")}
        assert len(texts) == 3, "two models answered a prompt alike"
