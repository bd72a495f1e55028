"""What a job may ask of the engine: the allow-list of engine arguments (llm_batch.core.engine_args).

The classification test fails when a vLLM upgrade adds an engine argument nobody classified
(or drops one we list); the rest attack the allow-list as a class: every argument vLLM knows,
with hostile values, through the same check the API and the worker use.
"""

from __future__ import annotations

import dataclasses
import typing

import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from llm_batch.core.config import Settings
from llm_batch.core.engine_args import JOB_ENGINE_ARGS, QUANTIZATION_METHODS, REGISTRY_ONLY_ENGINE_ARGS
from llm_batch.core.model_config import InvalidModelConfig, validate_model_config
from llm_batch.infra.model_registry import load_registry
from llm_batch.infra.model_resolution import job_engine_args
from tests.fuzzing import examples

MODEL = "tiny-random-llama"


@pytest.fixture(scope="module")
def vllm_engine_args() -> dict[str, typing.Any]:
    from vllm.engine.arg_utils import EngineArgs

    return {f.name: f.type for f in dataclasses.fields(EngineArgs)}


def test_every_engine_argument_of_the_installed_vllm_is_classified(vllm_engine_args):
    known = set(vllm_engine_args)
    unclassified = known - set(JOB_ENGINE_ARGS) - set(REGISTRY_ONLY_ENGINE_ARGS)
    assert not unclassified, (
        f"vLLM has engine arguments nobody classified: {sorted(unclassified)}; add each to "
        "JOB_ENGINE_ARGS (a plain value with bounds) or REGISTRY_ONLY_ENGINE_ARGS (src/llm_batch/core/engine_args.py)"
    )
    assert not set(JOB_ENGINE_ARGS) & set(REGISTRY_ONLY_ENGINE_ARGS)
    stale = (set(JOB_ENGINE_ARGS) | set(REGISTRY_ONLY_ENGINE_ARGS)) - known
    assert not stale, f"classified arguments this vLLM no longer has: {sorted(stale)}"


def _literal_values(hint: typing.Any) -> set[typing.Any]:
    """Every Literal value inside a (possibly Optional/Union/Annotated) hint."""
    if typing.get_origin(hint) is typing.Literal:
        return set(typing.get_args(hint))
    return set().union(*(_literal_values(arg) for arg in typing.get_args(hint))) if typing.get_args(hint) else set()


def test_each_allowed_enumeration_is_a_subset_of_what_vllm_takes(vllm_engine_args):
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS as VLLM_QUANTIZATION

    assert set(QUANTIZATION_METHODS) == set(VLLM_QUANTIZATION)
    for name, ours in JOB_ENGINE_ARGS.items():
        theirs = _literal_values(vllm_engine_args[name])
        if ours_values := _literal_values(ours):
            if theirs:
                assert ours_values <= theirs, f"{name}: {sorted(ours_values - theirs, key=str)} not in vLLM's {theirs}"


# The reproductions of the hostile probe: each imports code, loads a path or opens a URL.
@pytest.mark.parametrize("engine_args", [
    {"reasoning_parser_plugin": "/data/alice/evil.py"},
    {"scheduler_cls": "os.system"},
    {"compilation_config": {"backend": "evil_module.backend"}},
    {"logits_processors": ["evil.Processor"]},
    {"generation_config": "/etc"},
    {"otlp_traces_endpoint": "http://127.0.0.1:9/"},
    {"worker_extension_cls": "evil.Ext"},
    {"hf_overrides": {"architectures": ["Evil"]}},
    {"io_processor_plugin": "evil"},
    {"model_impl": "transformers"},
    {"speculative_config": {"model": "/etc"}},
    {"chat_template": "/etc/passwd"},
    {"max_num_seqs": 2, "additional_config": {}},
])
def test_engine_arguments_that_load_code_paths_or_urls_are_refused(engine_args):
    with pytest.raises(InvalidModelConfig, match="may not be set by a job"):
        validate_model_config({"model": MODEL, "engine_args": engine_args})


def test_the_deployments_eager_mode_wins_over_the_jobs(tmp_path):
    registry = load_registry()
    config = validate_model_config({"model": MODEL, "engine_args": {"enforce_eager": False},
                                    "enforce_eager": False})
    eager = Settings(home=tmp_path, enforce_eager=True)
    assert job_engine_args(config, registry, eager)["enforce_eager"] is True
    assert job_engine_args(config, registry, Settings(home=tmp_path, enforce_eager=False))["enforce_eager"] is False


_json = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70) | st.floats()
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)


@pytest.fixture(scope="module")
def every_name(vllm_engine_args) -> list[str]:
    return sorted(vllm_engine_args)


@hsettings(max_examples=examples(400), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_whatever_a_job_sends_only_allowed_plain_values_reach_the_engine(every_name, data):
    names = st.sampled_from(every_name) | st.text(max_size=12)
    engine_args = data.draw(st.dictionaries(names, _json, max_size=4))
    try:
        config = validate_model_config({"model": MODEL, "engine_args": engine_args})
    except InvalidModelConfig:
        return
    assert set(config.engine_args) <= set(JOB_ENGINE_ARGS)
    for value in config.engine_args.values():
        assert isinstance(value, (bool, int, float, str))
        assert not isinstance(value, float) or value == value  # no NaN
