"""MODEL_CONFIG_FIELDS, the one table of what each model_config field does: honoured as a
vLLM engine argument, checked, or refused by name; no engine is started here.

The bodies Scale's clients really send are the fixtures of tests/api/scale_v2_bodies/.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from llm_batch.core.config import Settings
from llm_batch.core.model_config import (
    BUILTIN_CHAT_TEMPLATES,
    MODEL_CONFIG_FIELDS,
    InvalidModelConfig,
    ModelConfig,
    job_model_config,
    validate_model_config,
)
from llm_batch.infra.model_cache import READY_MARKER
from llm_batch.infra.model_registry import CheckpointNotAllowed, Registry, load_registry
from llm_batch.infra.model_resolution import check_model_config, job_engine_args, resolve_model

BODIES = Path(__file__).parents[1] / "api" / "scale_v2_bodies"
MODEL = "smollm2-135m-instruct"  # packaged registry: prefix caching, max_model_len 8192, bf16
DOCS = Path(__file__).parents[2] / "docs" / "api.md"


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(home=tmp_path / "home", enforce_eager=False)  # the default (the suite's environment sets it)


@pytest.fixture(scope="module")
def registry() -> Registry:
    return load_registry(Path(__file__).parents[2] / "src" / "llm_batch" / "models.yaml")


def engine_args(registry: Registry, **fields) -> dict:
    return job_engine_args(validate_model_config({"model": MODEL, **fields}), registry)


def refusal(config: dict, registry: Registry | None = None, gpus: int | None = None,
            nodes: int | None = None) -> InvalidModelConfig:
    with pytest.raises(InvalidModelConfig) as caught:
        parsed = validate_model_config(config)
        if registry is not None:
            check_model_config(parsed, registry, gpus=gpus, nodes=nodes)
    return caught.value


def sent_model_configs() -> dict[str, dict]:
    return {path.stem: json.loads(path.read_text())["body"]["model_config"] for path in sorted(BODIES.glob("*.json"))}


# --- the table covers what the clients send ----------------------------------------------


def test_every_field_scales_clients_send_is_in_the_table():
    sent = sent_model_configs()
    assert {"b45-v2", "b45-v1", "b36-v1"} <= set(sent)
    for name, config in sent.items():
        assert set(config) <= set(MODEL_CONFIG_FIELDS), (name, set(config) - set(MODEL_CONFIG_FIELDS))
    # 0.0.0b45's model config is vLLM's engine configuration: 40-odd fields, all known.
    assert len(sent["b45-v2"]) >= 40 and {"trust_remote_code", "tokenizer", "chat_template"} <= set(sent["b45-v2"])
    assert set(ModelConfig.model_fields) == set(MODEL_CONFIG_FIELDS)


def test_what_a_client_sends_when_nothing_is_set_stores_only_the_model(registry):
    for name, config in sent_model_configs().items():
        if name.endswith("tuned"):
            continue
        assert job_model_config(config) == {"model": MODEL}, name
        check_model_config(validate_model_config(config), registry, gpus=4)  # gpus alone: no rule


@pytest.mark.parametrize("name", sorted(MODEL_CONFIG_FIELDS))
def test_a_field_at_null_or_its_default_is_never_an_error_and_never_used(name, registry):
    if name == "model":
        return
    rule = MODEL_CONFIG_FIELDS[name]
    for value in {None, json.dumps(rule.default)}:
        config = {"model": MODEL, name: None if value is None else json.loads(value)}
        assert job_model_config(config) == {"model": MODEL}
        check_model_config(validate_model_config(config), registry, gpus=2)
        assert engine_args(registry, **{name: config[name]}) == engine_args(registry)


# --- honoured: the engine argument each field becomes ------------------------------------

HONOURED = [
    ("max_model_len", 512, {"max_model_len": 512}),
    ("max_context_length", 512, {"max_model_len": 512}),
    ("max_num_seqs", 8, {"max_num_seqs": 8}),
    ("max_num_batched_tokens", 1024, {"max_num_batched_tokens": 1024}),
    ("enforce_eager", True, {"enforce_eager": True}),
    ("tensor_parallel_size", 2, {"tensor_parallel_size": 2}),
    ("pipeline_parallel_size", 2, {"pipeline_parallel_size": 2}),
    ("num_shards", 2, {"tensor_parallel_size": 2}),
    ("gpu_memory_utilization", 0.5, {"gpu_memory_utilization": 0.5}),
    ("block_size", 32, {"block_size": 32}),
    ("num_gpu_blocks_override", 100, {"num_gpu_blocks_override": 100}),
    ("enable_prefix_caching", False, {"enable_prefix_caching": False}),
    ("disable_sliding_window", True, {"disable_sliding_window": True}),
    ("max_seq_len_to_capture", 4096, {"compilation_config": {"max_cudagraph_capture_size": 4096}}),
    ("dtype", "float32", {"dtype": "float32"}),
    ("quantization", "fp8", {"quantization": "fp8"}),
    ("quantize", "awq", {"quantization": "awq"}),
    ("cache_dtype", "fp8", {"kv_cache_dtype": "fp8"}),
    ("load_format", "safetensors", {"load_format": "safetensors"}),
    ("config_format", "hf", {"config_format": "hf"}),
    ("tokenizer_mode", "hf", {"tokenizer_mode": "hf"}),
    ("rope_scaling", {"rope_type": "yarn", "factor": 2.0}, {"hf_overrides": {"rope_parameters": {"rope_type": "yarn", "factor": 2.0}}}),
    ("limit_mm_per_prompt", '{"image": 2}', {"limit_mm_per_prompt": {"image": 2}}),
    ("limit_mm_per_prompt", {"image": 0}, {"limit_mm_per_prompt": {"image": 0}}),
    ("mm_processor_kwargs", {"num_crops": 4}, {"mm_processor_kwargs": {"num_crops": 4}}),
    ("seed", 7, {"seed": 7}),
    ("chat_template", "chatml", {"chat_template": BUILTIN_CHAT_TEMPLATES["chatml"]}),
    ("chat_template", "{{ messages[0]['content'] }}", {"chat_template": "{{ messages[0]['content'] }}"}),
    ("tokenizer", "tokenizers/mine", {"tokenizer": "tokenizers/mine"}),
]


@pytest.mark.parametrize("name, value, expected", HONOURED)
def test_an_honoured_field_becomes_its_engine_argument(registry, name, value, expected):
    args = engine_args(registry, **{name: value})
    assert {key: args[key] for key in expected} == expected
    assert job_model_config({"model": MODEL, name: value}) == {"model": MODEL, name: value}  # stored as sent


def test_every_field_with_an_engine_argument_has_a_case():
    with_arg = {name for name, rule in MODEL_CONFIG_FIELDS.items() if rule.engine_arg and rule.allowed != frozenset()}
    assert with_arg - {"trust_remote_code"} == {name for name, _, _ in HONOURED}


def test_the_registry_defaults_stay_unless_a_field_overrides_them(registry):
    assert engine_args(registry) == {"seed": 0, "enable_prefix_caching": True, "max_model_len": 8192, "dtype": "bfloat16"}
    args = engine_args(registry, max_model_len=512, engine_args={"max_model_len": 256})
    assert args["max_model_len"] == 256  # the job's engine_args win over the fields
    assert args["enable_prefix_caching"] is True and args["dtype"] == "bfloat16"


def test_num_shards_is_a_suggestion_the_registry_and_tensor_parallel_size_override():
    registry = Registry.model_validate({
        "default_chat_model": "big", "default_embedding_model": "big",
        "models": {"big": {"checkpoint": "big", "task": "generate", "engine_args": {"tensor_parallel_size": 4}}},
    })
    args = job_engine_args(validate_model_config({"model": "big", "num_shards": 2}), registry)
    assert args["tensor_parallel_size"] == 4
    args = job_engine_args(validate_model_config({"model": "big", "tensor_parallel_size": 2}), registry)
    assert args["tensor_parallel_size"] == 2


def test_enforce_eager_from_the_settings_still_wins(registry, settings):
    forced = settings.model_copy(update={"enforce_eager": True})
    config = validate_model_config({"model": MODEL, "enforce_eager": False})
    assert job_engine_args(config, registry, forced)["enforce_eager"] is True


def test_disable_log_requests_is_accepted_and_changes_nothing(registry):
    assert engine_args(registry, disable_log_requests=True) == engine_args(registry)


# --- refused: the field is named, and why ------------------------------------------------

REFUSED = [
    ("revision", "main", "hub"),
    ("code_revision", "abc123", "hub"),
    ("tokenizer_revision", "v2", "hub"),
    ("quantization_param_path", "/data/scales.json", "names a file"),
    ("override_neuron_config", {"x": 1}, "Neuron"),
    ("tool_call_parser", "hermes", "no tools"),
    ("enable_auto_tool_choice", True, "no tools"),
    ("skip_tokenizer_init", True, "needs the tokenizer"),
    ("swap_space", 4, "no CPU swap space"),
    ("load_format", "dummy", "only auto and safetensors"),
    ("load_format", "pt", "only auto and safetensors"),
    ("tokenizer", "s3://bucket/tok", "only a local directory"),
    ("chat_template", "/etc/passwd", "files are not read"),
    ("chat_template", "{% if messages %}unclosed", "not valid Jinja"),
    ("limit_mm_per_prompt", "image=2", "a JSON object"),
    ("tokenizer_mode", "slow", "tokenizer_mode"),
    ("dtype", "int3", "dtype"),
]


@pytest.mark.parametrize("name, value, why", REFUSED)
def test_a_refused_value_names_its_field_and_why(name, value, why):
    error = refusal({"model": MODEL, name: value})
    assert f"model_config.{name}" in str(error) and why in str(error)
    assert error.fields == (name,)


def test_every_refusing_rule_has_a_case():
    refusing = {name for name, rule in MODEL_CONFIG_FIELDS.items() if rule.allowed is not None}
    assert refusing <= {name for name, _, _ in REFUSED}


def test_an_allowed_value_of_a_refusing_rule_is_accepted(registry):
    for name, value in [("swap_space", 0), ("skip_tokenizer_init", False), ("enable_auto_tool_choice", False),
                        ("load_format", "auto"), ("trust_remote_code", False)]:
        check_model_config(validate_model_config({"model": MODEL, name: value}), registry)


@pytest.mark.parametrize("one, other", [
    ({"max_context_length": 512}, {"max_model_len": 1024}),
    ({"quantize": "awq"}, {"quantization": "fp8"}),
    ({"num_shards": 2}, {"tensor_parallel_size": 4}),
])
def test_two_fields_that_set_one_engine_argument_differently_are_refused(one, other):
    error = refusal({"model": MODEL, **one, **other})
    assert "disagrees" in str(error) and set(error.fields) <= set(one) | set(other)
    same = {next(iter(other)): next(iter(one.values()))}
    validate_model_config({"model": MODEL, **one, **same})  # the same value twice is fine


def test_engine_args_may_not_name_a_chat_template_file():
    error = refusal({"model": MODEL, "engine_args": {"chat_template": "/etc/passwd"}})
    assert "chat_template may not be set by a job" in str(error) and "model_config.chat_template" in str(error)


def test_trust_remote_code_needs_the_registrys_leave_and_never_comes_with_a_checkpoint_path(registry):
    error = refusal({"model": MODEL, "trust_remote_code": True}, registry)
    assert error.fields == ("trust_remote_code",) and "does not allow it" in str(error)

    trusting = Registry.model_validate({
        "default_chat_model": "remote", "default_embedding_model": "remote",
        "models": {"remote": {"checkpoint": "remote", "task": "generate", "engine_args": {"trust_remote_code": True}}},
    })
    allowed = validate_model_config({"model": "remote", "trust_remote_code": True})
    check_model_config(allowed, trusting)
    assert job_engine_args(allowed, trusting)["trust_remote_code"] is True

    mine = {"model": "remote", "checkpoint_path": "/data/alice/mine"}
    error = refusal({**mine, "trust_remote_code": True}, trusting)
    assert "checkpoint_path" in str(error)
    # The registry vouches for its own checkpoint's code, not for one the job names.
    assert "trust_remote_code" not in job_engine_args(validate_model_config(mine), trusting)


def test_a_chat_template_name_must_be_one_the_registry_knows(registry):
    error = refusal({"model": MODEL, "chat_template": "llama-3"}, registry)
    assert error.fields == ("chat_template",) and "chatml" in str(error)
    own = Registry.model_validate({**registry.model_dump(), "chat_templates": {"llama-3": "{{ 'x' }}"}})
    config = validate_model_config({"model": MODEL, "chat_template": "llama-3"})
    check_model_config(config, own)
    assert job_engine_args(config, own)["chat_template"] == "{{ 'x' }}"


def test_a_registry_chat_template_name_must_be_a_plain_name(registry):
    with pytest.raises(ValueError, match="plain names"):
        Registry.model_validate({**registry.model_dump(), "chat_templates": {"{{ x }}": "y"}})


# --- tensor / pipeline parallel sizes against the job's gpus -----------------------------


@pytest.mark.parametrize("fields, gpus", [
    ({"tensor_parallel_size": 2}, 2),
    ({"tensor_parallel_size": 2, "pipeline_parallel_size": 2}, 4),
    ({"pipeline_parallel_size": 2}, 2),
    ({"num_shards": 4}, 4),
    ({}, 8),  # gpus alone sets no parallel size
    ({"tensor_parallel_size": 2}, None),
])
def test_parallel_sizes_that_fit_the_gpus(registry, fields, gpus):
    check_model_config(validate_model_config({"model": MODEL, **fields}), registry, gpus=gpus)


@pytest.mark.parametrize("fields, gpus, field", [
    ({"tensor_parallel_size": 2}, 4, "tensor_parallel_size"),
    ({"tensor_parallel_size": 2, "pipeline_parallel_size": 2}, 2, "tensor_parallel_size"),
    ({"pipeline_parallel_size": 3}, 2, "pipeline_parallel_size"),
    ({"num_shards": 2}, 1, "num_shards"),
])
def test_parallel_sizes_that_do_not_fit_the_gpus_are_refused(registry, fields, gpus, field):
    error = refusal({"model": MODEL, **fields}, registry, gpus=gpus)
    assert error.fields == (field,) and f"gpus={gpus}" in str(error) and "must be equal" in str(error)


def test_a_multi_node_worker_fills_gpus_times_nodes(registry):
    """Tensor parallel over a node's gpus and pipeline parallel over the nodes by default;
    sizes the job gives must fill gpus x nodes."""
    for fields in ({}, {"tensor_parallel_size": 4}, {"pipeline_parallel_size": 2},
                   {"tensor_parallel_size": 8, "pipeline_parallel_size": 1}):
        check_model_config(validate_model_config({"model": MODEL, **fields}), registry, gpus=4, nodes=2)
    error = refusal({"model": MODEL, "tensor_parallel_size": 2}, registry, gpus=4, nodes=2)
    assert error.fields == ("tensor_parallel_size",)
    assert "tensor_parallel_size 2 x pipeline_parallel_size 2 = 4 GPUs" in str(error)
    assert "gpus=4 x nodes_per_worker=2 = 8 GPUs" in str(error)


def test_a_registry_parallel_size_is_checked_against_the_gpus_too():
    registry = Registry.model_validate({
        "default_chat_model": "big", "default_embedding_model": "big",
        "models": {"big": {"checkpoint": "big", "task": "generate", "engine_args": {"tensor_parallel_size": 4}}},
    })
    error = refusal({"model": "big"}, registry, gpus=2)
    assert error.fields == ("gpus",) and "registry entry of 'big'" in str(error)


# --- the worker: resolve_model uses the same table --------------------------------------


def _prepared(settings: Settings, name: str = MODEL) -> Path:
    path = Path(settings.model_cache) / name
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text("{}")
    (path / READY_MARKER).write_text(json.dumps({"model": name}))
    return path


def test_resolve_model_writes_the_chat_template_to_a_file_named_by_its_content(settings):
    path = _prepared(settings)
    inline = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    first = resolve_model({"model": MODEL, "chat_template": inline}, settings=settings)
    template = Path(first.engine_args["chat_template"])
    assert template.read_text() == inline and template.is_relative_to(settings.model_cache)
    again = resolve_model({"model": MODEL, "chat_template": inline}, settings=settings)
    assert again.engine_args["chat_template"] == str(template)
    named = resolve_model({"model": MODEL, "chat_template": "chatml"}, settings=settings)
    assert Path(named.engine_args["chat_template"]).read_text() == BUILTIN_CHAT_TEMPLATES["chatml"]
    assert named.engine_args["model"] == str(path)


def test_resolve_model_takes_the_tokenizer_from_the_roots_or_the_model_cache_only(settings, tmp_path):
    _prepared(settings)
    (Path(settings.model_cache) / "tokenizers" / "mine").mkdir(parents=True)
    resolved = resolve_model({"model": MODEL, "tokenizer": "tokenizers/mine"}, settings=settings)
    assert resolved.engine_args["tokenizer"] == str((Path(settings.model_cache) / "tokenizers" / "mine").resolve())
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    with pytest.raises(CheckpointNotAllowed, match="tokenizer"):
        resolve_model({"model": MODEL, "tokenizer": str(outside)}, settings=settings)


def test_resolve_model_names_results_and_answers_as_the_config_says(settings):
    _prepared(settings)
    resolved = resolve_model({"model": MODEL, "served_model_name": "my-model", "response_role": "bot",
                              "max_num_seqs": 4}, settings=settings)
    assert (resolved.name, resolved.response_role) == ("my-model", "bot")
    assert resolved.engine_args["max_num_seqs"] == 4


def test_resolve_model_refuses_what_the_api_refuses(settings):
    _prepared(settings)
    with pytest.raises(InvalidModelConfig, match="model_config.trust_remote_code"):
        resolve_model({"model": MODEL, "trust_remote_code": True}, settings=settings)


# --- the table agrees with vLLM and with the docs ----------------------------------------


def test_every_engine_argument_is_one_vllm_takes():
    arg_utils = pytest.importorskip("vllm.engine.arg_utils")
    import dataclasses
    import inspect
    import typing

    from vllm import LLM
    from vllm.config import CompilationConfig
    from vllm.config.cache import CacheDType
    from vllm.config.model import ModelDType, TokenizerMode
    from vllm.transformers_utils.config import ConfigFormat

    engine = {f.name for f in dataclasses.fields(arg_utils.EngineArgs)} | set(inspect.signature(LLM).parameters)
    for name, rule in MODEL_CONFIG_FIELDS.items():
        if rule.engine_arg:
            outer, _, inner = rule.engine_arg.partition(".")
            assert outer in engine, name
    assert "max_cudagraph_capture_size" in {f.name for f in dataclasses.fields(CompilationConfig)}
    for field, vllm_literal in [("dtype", ModelDType), ("cache_dtype", CacheDType),
                                ("tokenizer_mode", TokenizerMode), ("config_format", ConfigFormat)]:
        ours = set(typing.get_args(MODEL_CONFIG_FIELDS[field].type))
        assert ours <= set(typing.get_args(vllm_literal)), field


def test_the_docs_table_lists_every_field():
    text = DOCS.read_text()
    section = text.split("## Scale model_config fields", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"^\| `([a-z_]+)`", section, flags=re.M))
    assert documented == set(MODEL_CONFIG_FIELDS)
