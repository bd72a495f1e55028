"""Where vLLM's engine core runs: in the worker's process on CPU, its own process on GPU,
LLM_BATCH_ENGINE_IN_PROCESS overriding; start_engine hands the choice to vLLM. (The real
engine in both layouts: tests/engine.)"""

from __future__ import annotations

import os

import pytest

from llm_batch.core.config import Settings
from llm_batch.infra.model_resolution import ResolvedModel


@pytest.fixture
def engine_runner():
    from llm_batch.runtime.engine import runner  # imports vLLM: when a test runs, not when collected

    return runner


def test_unset_means_in_process_exactly_on_cpu(monkeypatch, engine_runner):
    from vllm.platforms import current_platform

    unset = Settings(engine_in_process=None)
    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: True)
    assert engine_runner.engine_in_process(unset) is True
    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: False)
    assert engine_runner.engine_in_process(unset) is False


@pytest.mark.parametrize(("value", "expected"), [("false", False), ("0", False), ("true", True)])
def test_the_setting_wins(engine_runner, value, expected):
    # As LLM_BATCH_ENGINE_IN_PROCESS spells it: a string the settings parse.
    assert engine_runner.engine_in_process(Settings(engine_in_process=value)) is expected


@pytest.mark.parametrize(("in_process", "flag"), [(True, "0"), (False, "1")])
def test_start_engine_tells_vllm_before_building_the_engine(monkeypatch, engine_runner, in_process, flag):
    seen: dict[str, object] = {}

    def stand_in_llm(**engine_args):
        seen.update(flag=os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"], args=engine_args)
        return "llm"

    monkeypatch.setattr(engine_runner, "LLM", stand_in_llm)
    # start_engine writes vLLM's switch into this process's environment (where vLLM reads
    # it): monkeypatch puts the variable back after the test. Not a setting the test steers.
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "before")
    model = ResolvedModel("m", "/models/m", "generate", engine_args={"model": "/models/m"})
    assert engine_runner.start_engine(model, in_process=in_process) == "llm"
    # In this process, no multi-modal processor cache (its two sides drift apart here).
    cache = {"mm_processor_cache_gb": 0} if in_process else {}
    assert seen == {"flag": flag, "args": {"model": "/models/m", **cache}}
