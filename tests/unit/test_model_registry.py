"""The model registry and resolve_model / prepare_model, without building real models.

Model directories here are stand-ins (a config.json and the ready marker): resolution only
looks at the files, it never loads a model. The real recipes are tested in
tests/integration/test_models_prepare.py.
"""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import pytest

from llm_batch.core import model_recipes
from llm_batch.core.config import Settings, settings_from_env
from llm_batch.core.model_config import InvalidModelConfig, ModelError, validate_model_config
from llm_batch.core.model_recipes import Recipe
from llm_batch.infra import model_cache
from llm_batch.infra.model_cache import READY_MARKER, model_status, prepare_model
from llm_batch.infra.model_registry import (
    CheckpointNotAllowed,
    CheckpointNotFound,
    ModelNotPrepared,
    UnknownModel,
    load_registry,
)
from llm_batch.infra.model_resolution import resolve_model


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(home=tmp_path / "home", enforce_eager=False)  # the default (the suite's environment sets it)


def make_model_dir(path: Path, marker: dict | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    if marker is not None:
        (path / READY_MARKER).write_text(json.dumps(marker))
    return path


def prepared(settings: Settings, name: str) -> Path:
    """A stand-in directory where the registry expects ``name``, marked ready."""
    return make_model_dir(Path(settings.model_cache) / name, {"model": name})


# --- the packaged registry --------------------------------------------------------------


def test_packaged_registry_has_the_default_models(settings):
    registry = load_registry(settings=settings)
    defaults = {"smollm2-135m-instruct", "all-minilm-l6-v2", "tiny-random-llama"}
    assert defaults <= set(registry.models)
    # The rest are tiny random models of the tests of other endpoints (fim, classify, ...).
    assert all(name.startswith("tiny-random-") for name in set(registry.models) - defaults)
    assert registry.default_chat_model == "smollm2-135m-instruct"
    assert registry.default_embedding_model == "all-minilm-l6-v2"
    assert registry.models["all-minilm-l6-v2"].task == "embed"
    assert registry.models["all-minilm-l6-v2"].engine_args["runner"] == "pooling"
    for name in ("smollm2-135m-instruct", "tiny-random-llama"):
        assert registry.models[name].task == "generate"
        assert registry.models[name].engine_args["enable_prefix_caching"] is True
    assert all(spec.prepare for spec in registry.models.values())


def test_registry_path_comes_from_settings(tmp_path, settings):
    custom = tmp_path / "registry.yaml"
    custom.write_text(
        "default_chat_model: mine\ndefault_embedding_model: mine\n"
        "models:\n  mine:\n    checkpoint: /somewhere/mine\n    task: generate\n"
    )
    registry = load_registry(settings=settings.model_copy(update={"model_registry": custom}))
    assert list(registry.models) == ["mine"]


@pytest.mark.parametrize(
    "text, expected",
    [
        ("models: [", "not valid YAML"),
        ("default_chat_model: a\ndefault_embedding_model: a\nmodels: {}\n", "default model 'a'"),
        (
            "default_chat_model: a\ndefault_embedding_model: a\n"
            "models:\n  a:\n    checkpoint: x\n    task: chat\n",
            "models.a.task",
        ),
    ],
)
def test_a_bad_registry_file_names_itself_and_the_problem(tmp_path, text, expected):
    path = tmp_path / "registry.yaml"
    path.write_text(text)
    with pytest.raises(InvalidModelConfig) as caught:
        load_registry(path)
    assert str(path) in str(caught.value)
    assert expected in str(caught.value)


# --- resolve_model ----------------------------------------------------------------------


def test_a_prepared_registered_model_resolves_to_its_directory_and_defaults(settings):
    path = prepared(settings, "smollm2-135m-instruct")
    resolved = resolve_model({"model": "smollm2-135m-instruct"}, settings=settings)
    assert resolved.name == "smollm2-135m-instruct"
    assert resolved.path == path
    assert resolved.task == "generate"
    assert resolved.response_role == "assistant"
    assert resolved.engine_args == {
        "model": str(path),
        "seed": 0,
        "enable_prefix_caching": True,
        "max_model_len": 8192,
        "dtype": "bfloat16",
    }


def test_scale_fields_map_to_engine_args_and_extra_args_merge_last(settings):
    prepared(settings, "smollm2-135m-instruct")
    resolved = resolve_model(
        {
            "model": "smollm2-135m-instruct",
            "num_shards": 2,
            "max_context_length": 2048,
            "seed": 7,
            "dtype": "float32",
            "response_role": "bot",
            "labels": {"team": "a"},
            "engine_args": {"enable_prefix_caching": False, "max_model_len": 1024, "max_num_seqs": 16},
        },
        settings=settings,
    )
    args = resolved.engine_args
    assert args["tensor_parallel_size"] == 2
    assert args["seed"] == 7 and args["dtype"] == "float32"
    assert args["max_model_len"] == 1024  # engine_args win over max_context_length
    assert args["enable_prefix_caching"] is False and args["max_num_seqs"] == 16
    assert resolved.response_role == "bot"
    assert "labels" not in args


def test_the_model_config_scales_v1_client_sends_is_accepted(settings):
    """llmengine's CreateBatchCompletionsModelConfig(...).dict(): every field, nulls included."""
    prepared(settings, "smollm2-135m-instruct")
    sent = {"model": "smollm2-135m-instruct", "checkpoint_path": None, "labels": {},
            "num_shards": 1, "quantize": None, "seed": None, "max_context_length": None}
    args = resolve_model(sent, settings=settings).engine_args
    assert args.get("tensor_parallel_size", 1) == 1  # num_shards 1 is the client's default: unset
    assert "quantization" not in args and args["max_model_len"] == 8192
    quantized = resolve_model({**sent, "quantize": "awq", "engine_args": None}, settings=settings)
    assert quantized.engine_args["quantization"] == "awq"


def test_the_embedding_model_resolves_as_a_pooling_model(settings):
    prepared(settings, "all-minilm-l6-v2")
    resolved = resolve_model({"model": "all-minilm-l6-v2"}, settings=settings)
    assert resolved.task == "embed"
    assert resolved.engine_args["runner"] == "pooling"


@pytest.mark.parametrize("value, expected", [("1", True), ("true", True), ("0", None), (None, None)])
def test_enforce_eager_follows_the_environment(settings, value, expected):
    if value is not None:  # LLM_BATCH_ENFORCE_EAGER's spelling, parsed as the settings read it
        settings = settings_from_env({"LLM_BATCH_HOME": str(settings.home), "LLM_BATCH_ENFORCE_EAGER": value})
    prepared(settings, "tiny-random-llama")
    resolved = resolve_model({"model": "tiny-random-llama"}, settings=settings)
    assert resolved.engine_args.get("enforce_eager") is expected


def test_an_unknown_model_lists_the_known_ones_before_anything_loads(settings, monkeypatch):
    monkeypatch.setattr(model_cache, "fetch_checkpoint", lambda *a, **k: pytest.fail("fetched"))
    with pytest.raises(UnknownModel) as caught:
        resolve_model({"model": "gpt-5"}, settings=settings)
    message = str(caught.value)
    assert "'gpt-5'" in message
    for known in ("smollm2-135m-instruct", "all-minilm-l6-v2", "tiny-random-llama"):
        assert known in message
    assert isinstance(caught.value, ModelError)


def test_a_registered_model_not_prepared_says_how_to_prepare_it(settings):
    with pytest.raises(ModelNotPrepared) as caught:
        resolve_model({"model": "all-minilm-l6-v2"}, settings=settings)
    assert "llm-batch models prepare all-minilm-l6-v2" in str(caught.value)


def test_a_directory_without_the_ready_marker_is_not_prepared(settings):
    make_model_dir(Path(settings.model_cache) / "tiny-random-llama")  # e.g. a crashed copy
    with pytest.raises(ModelNotPrepared):
        resolve_model({"model": "tiny-random-llama"}, settings=settings)


@pytest.mark.parametrize(
    "config, field",
    [
        ({"model": "tiny-random-llama", "num_shards": 0}, "model_config.num_shards"),
        ({"model": "tiny-random-llama", "max_context_length": -5}, "model_config.max_context_length"),
        ({"model": "tiny-random-llama", "quantise": "awq"}, "model_config.quantise: unknown field"),
        ({"model": "tiny-random-llama", "quantize": "gptq"}, "model_config.quantize"),
        ({"model": ""}, "model_config.model"),
        ({}, "model_config.model"),
        ({"model": "tiny-random-llama", "engine_args": {"model": "/x"}}, "use checkpoint_path"),
        (
            {"model": "tiny-random-llama", "engine_args": {"trust_remote_code": True, "tokenizer": "/etc"}},
            "model_config.engine_args: Value error, trust_remote_code may not be set by a job",
        ),
    ],
)
def test_an_invalid_model_config_names_the_field(settings, config, field):
    with pytest.raises(InvalidModelConfig) as caught:
        resolve_model(config, settings=settings)
    assert field in str(caught.value)


def test_validate_model_config_checks_fields_without_touching_files(settings):
    config = validate_model_config({"model": "anything", "checkpoint_path": "s3://b/m", "seed": 3})
    assert (config.model, config.checkpoint_path, config.seed) == ("anything", "s3://b/m", 3)
    with pytest.raises(InvalidModelConfig, match="model_config.num_shards"):
        validate_model_config({"model": "m", "num_shards": "two"})


def test_checkpoint_path_serves_an_unregistered_local_model(settings):
    local = make_model_dir(settings.local_roots[0] / "uploads" / "my-model")
    resolved = resolve_model({"model": "my-model", "checkpoint_path": str(local)}, settings=settings)
    assert resolved.path == local.resolve()
    assert resolved.task == "generate"
    assert resolved.engine_args["model"] == str(local.resolve())
    assert "enable_prefix_caching" not in resolved.engine_args  # no registry defaults


def test_checkpoint_path_with_a_pooling_runner_is_an_embedding_model(settings):
    local = make_model_dir(settings.local_roots[0] / "my-embedder")
    resolved = resolve_model(
        {"model": "my-embedder", "checkpoint_path": str(local), "engine_args": {"runner": "pooling"}},
        settings=settings,
    )
    assert resolved.task == "embed"


def test_checkpoint_path_overrides_a_registered_model_but_keeps_its_defaults(settings):
    local = make_model_dir(settings.local_roots[0] / "smollm2-finetune")
    resolved = resolve_model(
        {"model": "smollm2-135m-instruct", "checkpoint_path": str(local)}, settings=settings
    )
    assert resolved.path == local.resolve()
    assert resolved.engine_args["enable_prefix_caching"] is True  # not prepared: not needed


def test_checkpoint_path_relative_to_the_model_cache(settings):
    make_model_dir(Path(settings.model_cache) / "team" / "model-a")
    resolved = resolve_model({"model": "a", "checkpoint_path": "team/model-a"}, settings=settings)
    assert resolved.path == (Path(settings.model_cache) / "team" / "model-a").resolve()


def test_checkpoint_path_outside_the_local_roots_is_refused(settings, tmp_path):
    outside = make_model_dir(tmp_path / "elsewhere" / "model")
    with pytest.raises(CheckpointNotAllowed, match="outside the allowed local roots"):
        resolve_model({"model": "m", "checkpoint_path": str(outside)}, settings=settings)
    with pytest.raises(CheckpointNotAllowed):
        resolve_model({"model": "m", "checkpoint_path": "../../elsewhere/model"}, settings=settings)


def test_checkpoint_path_without_a_model_directory_is_an_error(settings):
    empty = settings.local_roots[0] / "empty"
    empty.mkdir(parents=True)
    with pytest.raises(CheckpointNotFound, match="config.json"):
        resolve_model({"model": "m", "checkpoint_path": str(empty)}, settings=settings)
    with pytest.raises(CheckpointNotFound, match="only local paths and s3://"):
        resolve_model({"model": "m", "checkpoint_path": "gs://bucket/model"}, settings=settings)


# --- s3:// checkpoints, with a local directory standing in for the bucket ----------------


@pytest.fixture
def fake_bucket(tmp_path, monkeypatch):
    """``storage.download_dir`` copying from tmp_path/bucket; records each call."""
    from llm_batch.infra import storage

    bucket = tmp_path / "bucket"
    make_model_dir(bucket / "models" / "llama")
    (bucket / "models" / "llama" / "model.safetensors").write_bytes(b"weights")
    calls: list[str] = []

    def download_dir(prefix: str, dest: Path) -> Path:
        calls.append(prefix)
        source = bucket / prefix.removeprefix("s3://bucket/").strip("/")
        if not source.is_dir():
            raise storage.ObjectNotFound(prefix, "no objects under this prefix")
        shutil.copytree(source, dest, dirs_exist_ok=True)
        return dest

    monkeypatch.setattr(storage, "download_dir", download_dir)
    return calls


def test_an_s3_checkpoint_is_fetched_once_into_the_model_cache(settings, fake_bucket):
    config = {"model": "llama", "checkpoint_path": "s3://bucket/models/llama"}
    first = resolve_model(config, settings=settings)
    second = resolve_model(config, settings=settings)
    assert first.path == second.path == Path(settings.model_cache) / "s3" / "bucket" / "models" / "llama"
    assert (first.path / "model.safetensors").read_bytes() == b"weights"
    assert json.loads((first.path / READY_MARKER).read_text())["source"] == config["checkpoint_path"]
    assert fake_bucket == ["s3://bucket/models/llama/"]


def test_concurrent_shards_fetch_an_s3_checkpoint_once(settings, fake_bucket):
    config = {"model": "llama", "checkpoint_path": "s3://bucket/models/llama"}
    paths, errors = [], []

    def shard() -> None:
        try:
            paths.append(resolve_model(config, settings=settings).path)
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=shard) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert len(set(paths)) == 1 and len(paths) == 6
    assert len(fake_bucket) == 1
    leftovers = [p.name for p in paths[0].parent.iterdir() if p.name.startswith(".tmp-")]
    assert leftovers == []


def test_a_missing_s3_prefix_is_checkpoint_not_found_and_leaves_nothing(settings, fake_bucket):
    with pytest.raises(CheckpointNotFound, match="s3://bucket/models/nope"):
        resolve_model({"model": "m", "checkpoint_path": "s3://bucket/models/nope"}, settings=settings)
    cache = Path(settings.model_cache) / "s3" / "bucket" / "models"
    assert not (cache / "nope").exists()
    assert [p for p in cache.iterdir() if p.name.startswith(".tmp-")] == []


def test_a_forbidden_s3_prefix_is_checkpoint_not_allowed(settings, monkeypatch):
    from llm_batch.infra import storage

    def denied(prefix: str, dest: Path) -> Path:
        raise storage.AccessDenied(prefix, "access denied")

    monkeypatch.setattr(storage, "download_dir", denied)
    with pytest.raises(CheckpointNotAllowed, match="s3://bucket/secret"):
        resolve_model({"model": "m", "checkpoint_path": "s3://bucket/secret"}, settings=settings)


def test_an_s3_prefix_without_a_model_is_refused(settings, fake_bucket, tmp_path):
    (tmp_path / "bucket" / "data").mkdir()
    (tmp_path / "bucket" / "data" / "file.txt").write_text("x")
    with pytest.raises(CheckpointNotFound, match="config.json"):
        resolve_model({"model": "m", "checkpoint_path": "s3://bucket/data"}, settings=settings)
    with pytest.raises(CheckpointNotFound):
        resolve_model({"model": "m", "checkpoint_path": "s3://bucket/../etc"}, settings=settings)


def test_a_registered_s3_model_is_fetched_on_first_use(tmp_path, settings, fake_bucket):
    registry_file = tmp_path / "registry.yaml"
    registry_file.write_text(
        "default_chat_model: llama\ndefault_embedding_model: llama\n"
        "models:\n  llama:\n    checkpoint: s3://bucket/models/llama\n    task: generate\n"
        "    engine_args: {max_model_len: 4096}\n"
    )
    settings = settings.model_copy(update={"model_registry": registry_file})
    spec = load_registry(settings=settings).models["llama"]
    assert model_status("llama", spec, settings) == "remote"
    resolved = resolve_model({"model": "llama"}, settings=settings)
    assert resolved.engine_args["max_model_len"] == 4096
    assert model_status("llama", spec, settings) == "ready"


# --- prepare_model (with a stand-in recipe) ---------------------------------------------


@pytest.fixture
def counting_recipe(monkeypatch):
    """Replace the tiny-random-llama recipe by one that counts builds and can fail."""
    state = {"builds": 0, "source": "v1", "fail": False}

    def build(dest: Path) -> None:
        state["builds"] += 1
        make_model_dir(dest)
        (dest / "weights").write_text(state["source"])
        if state["fail"]:
            raise RuntimeError("recipe failed")

    monkeypatch.setitem(model_recipes.RECIPES, "tiny-random-llama", Recipe(lambda: state["source"], build))
    monkeypatch.setitem(model_cache.RECIPES, "tiny-random-llama", model_recipes.RECIPES["tiny-random-llama"])
    return state


def test_prepare_is_idempotent_and_marks_the_source(settings, counting_recipe):
    spec = load_registry(settings=settings).models["tiny-random-llama"]
    assert model_status("tiny-random-llama", spec, settings) == "not prepared"
    path = prepare_model("tiny-random-llama", settings=settings)
    again = prepare_model("tiny-random-llama", settings=settings)
    assert path == again == Path(settings.model_cache) / "tiny-random-llama"
    assert counting_recipe["builds"] == 1
    assert json.loads((path / READY_MARKER).read_text()) == {
        "model": "tiny-random-llama", "recipe": "tiny-random-llama", "source": "v1",
    }
    assert model_status("tiny-random-llama", spec, settings) == "ready"
    assert resolve_model({"model": "tiny-random-llama"}, settings=settings).path == path
    for item in [path, *path.iterdir()]:  # a shared cache: other users read it
        assert item.stat().st_mode & 0o444 == 0o444


def test_a_new_source_or_force_rebuilds(settings, counting_recipe):
    spec = load_registry(settings=settings).models["tiny-random-llama"]
    path = prepare_model("tiny-random-llama", settings=settings)
    counting_recipe["source"] = "v2"
    assert model_status("tiny-random-llama", spec, settings) == "stale"
    prepare_model("tiny-random-llama", settings=settings)
    assert (path / "weights").read_text() == "v2"
    prepare_model("tiny-random-llama", force=True, settings=settings)
    assert counting_recipe["builds"] == 3


def test_a_failed_build_keeps_the_previous_directory_and_no_temp(settings, counting_recipe):
    path = prepare_model("tiny-random-llama", settings=settings)
    counting_recipe.update(source="v2", fail=True)
    with pytest.raises(RuntimeError, match="recipe failed"):
        prepare_model("tiny-random-llama", settings=settings)
    assert (path / "weights").read_text() == "v1"
    assert sorted(p.name for p in path.parent.iterdir()) == [".tiny-random-llama.lock", "tiny-random-llama"]


def test_prepare_refuses_unknown_models_and_missing_sources(settings, monkeypatch):
    with pytest.raises(UnknownModel, match="known models are"):
        prepare_model("nope", settings=settings)

    def missing(dest: Path) -> None:
        raise model_recipes.MissingSource("the PyPI package x is not installed")

    monkeypatch.setitem(model_cache.RECIPES, "minilm-package", Recipe(lambda: "v", missing))
    with pytest.raises(ModelError, match="cannot be prepared: the PyPI package x"):
        prepare_model("all-minilm-l6-v2", settings=settings)


def test_models_command_prepares_and_lists(settings, counting_recipe, monkeypatch, capsys):
    import argparse

    from llm_batch.cli import models as command

    monkeypatch.setattr(model_cache, "get_settings", lambda: settings)
    monkeypatch.setattr("llm_batch.core.config.get_settings", lambda: settings)
    parser = argparse.ArgumentParser()
    command.register(parser.add_subparsers())

    def run(*argv: str) -> int:
        args = parser.parse_args(["models", *argv])
        return args.func(args)

    assert run("prepare", "tiny-random-llama") == 0
    assert run("prepare", "tiny-random-llama", "nope") == 2  # names checked before building
    assert counting_recipe["builds"] == 1
    assert run("list") == 0
    out, err = capsys.readouterr()
    assert "unknown model 'nope'" in err
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith(("tiny", "all", "smol"))}
    assert rows["tiny-random-llama"][2] == "ready"
    assert rows["all-minilm-l6-v2"][2:4] == ["not", "prepared"]
