"""LoRA adapters without an engine: what ``check_adapter_dir`` admits (an allow-list: the
two files, a plain LoRA of bounded rank on the decoder's linear layers, tensors shaped as the
base's), what ``unpack_adapter`` takes from an uploaded archive, the registry's adapter entries, the names a job's lines may give, the adapter-grouped
shard plan, and the engine arguments a shard's adapters ask for."""

from __future__ import annotations

import io
import json
import tarfile
import zipfile
from pathlib import Path
from typing import Any

import orjson
import pytest

from llm_batch.core.layout import JobLayout
from llm_batch.core.model_choice import ModelChoice, ModelRefused
from llm_batch.core.records import BatchRequest
from llm_batch.infra import storage
from llm_batch.infra.adapters import (
    MAX_ARCHIVE_MEMBERS,
    AdapterRefused,
    ResolvedAdapter,
    adapter_int_id,
    check_adapter_dir,
    engine_rank,
    model_choice,
    unpack_adapter,
)
from llm_batch.infra.model_registry import Registry, UnknownModel, load_registry
from tests.unit.data_plane_fixtures import new_layout, ok_result


@pytest.fixture(scope="module", autouse=True)
def _torch() -> None:
    """torch (the adapters' tensors) is bound when the module's first test runs, not when collected."""
    global save_file, torch
    import torch
    from safetensors.torch import save_file


BASE_CONFIG = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
               "num_key_value_heads": 2}


def _base(tmp_path: Path) -> Path:
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text(json.dumps(BASE_CONFIG))
    return base


def _adapter(tmp_path: Path, *, rank: int = 8, config: dict[str, Any] | None = None,
             tensors: dict[str, tuple[int, int]] | None = None, name: str = "adapter") -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"], **(config or {})}))
    tensors = tensors if tensors is not None else {
        f"base_model.model.model.layers.{layer}.self_attn.{module}.lora_{half}.weight":
            (rank, 64) if half == "A" else ((64 if module == "q_proj" else 32), rank)
        for layer in range(2) for module in ("q_proj", "v_proj") for half in "AB"}
    save_file({name: torch.zeros(shape) for name, shape in tensors.items()}, folder / "adapter_model.safetensors")
    return folder


def test_a_plain_lora_of_the_base_is_admitted(tmp_path):
    facts = check_adapter_dir(_adapter(tmp_path), _base(tmp_path), max_rank=64)
    assert (facts.rank, facts.target_modules) == (8, ("q_proj", "v_proj")) and facts.bytes > 0


@pytest.mark.parametrize("change, reason", [
    ({"peft_type": "PREFIX_TUNING"}, "peft_type"),
    ({"r": 128}, "r must be"),
    ({"r": "8"}, "r must be"),
    ({"target_modules": ["embed_tokens"]}, "not admitted"),
    ({"target_modules": "q_proj"}, "a list of module names"),
    ({"target_modules": ["lm_head", "q_proj"]}, "not admitted"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"use_dora": True}, "plain LoRA"),
    ({"bias": "all"}, "plain LoRA"),
    ({"lora_alpha": 10**9}, "lora_alpha"),
])
def test_a_config_outside_the_allow_list_is_refused(tmp_path, change, reason):
    with pytest.raises(AdapterRefused, match=reason):
        check_adapter_dir(_adapter(tmp_path, config=change), _base(tmp_path), max_rank=64)


def test_files_beside_the_two_and_pickles_are_refused(tmp_path):
    base = _base(tmp_path)
    folder = _adapter(tmp_path)
    (folder / "adapter_model.bin").write_bytes(b"\x80\x04pickle")
    with pytest.raises(AdapterRefused, match="not admitted: adapter_model.bin"):
        check_adapter_dir(folder, base, max_rank=64)
    (folder / "adapter_model.bin").unlink()
    (folder / "adapter_model.safetensors").unlink()
    with pytest.raises(AdapterRefused, match="missing adapter_model.safetensors"):
        check_adapter_dir(folder, base, max_rank=64)


@pytest.mark.parametrize("tensors, reason", [
    ({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": (8, 100)}, "shape"),  # another width
    ({"base_model.model.model.layers.5.self_attn.q_proj.lora_A.weight": (8, 64)}, "layer or module"),  # no layer 5
    ({"base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight": (8, 64)}, "layer or module"),  # not targeted
    ({"base_model.model.lm_head.weight": (8, 64)}, "not a LoRA weight"),
    ({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": (4, 64)}, "shape"),  # rank differs
    ({}, "no tensor"),
])
def test_tensors_that_do_not_fit_the_base_are_refused(tmp_path, tensors, reason):
    with pytest.raises(AdapterRefused, match=reason):
        check_adapter_dir(_adapter(tmp_path, tensors=tensors), _base(tmp_path), max_rank=64)


@pytest.mark.parametrize("dtype_name", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_weights_that_are_not_finite_are_refused_in_each_dtype(tmp_path, dtype_name, bad):
    """Issue 43, finding 2: a NaN adapter beside base rows in a shared batch reaches them;
    every value is read at admission (finite ones of each admitted dtype pass)."""
    from safetensors.torch import load_file

    folder = _adapter(tmp_path)
    weights = folder / "adapter_model.safetensors"
    dtype = getattr(torch, dtype_name)
    tensors = {name: (torch.rand(t.shape) * 2 - 1).to(dtype) for name, t in load_file(weights).items()}
    save_file(tensors, weights)
    base = _base(tmp_path)
    check_adapter_dir(folder, base, max_rank=64)  # finite: admitted
    first = sorted(tensors)[0]
    tensors[first][1, 3] = bad
    save_file(tensors, weights)
    with pytest.raises(AdapterRefused, match="not finite"):
        check_adapter_dir(folder, base, max_rank=64)


def test_the_worker_checks_the_data_of_a_registry_adapter_it_loads(tmp_path):
    """Issue 43, finding 2: no upload checks an admin's adapter; loading one reads its data as
    an upload does, so a NaN adapter reaches no engine whoever configured it."""
    from safetensors.torch import load_file

    from llm_batch.core.config import Settings
    from llm_batch.infra.adapters import resolve_adapters
    from llm_batch.infra.model_registry import AdapterSpec

    folder = _adapter(tmp_path)
    registry = load_registry()
    registry = registry.model_copy(update={"adapters": {**registry.adapters, "admin-bot": AdapterSpec(
        base="tiny-random-llama", checkpoint=str(folder), rank=8)}})
    settings = Settings(home=tmp_path / "home")
    [resolved] = resolve_adapters(["admin-bot"], registry=registry, settings=settings)
    assert (resolved.path, resolved.rank, resolved.source) == (folder, 8, None)

    weights = folder / "adapter_model.safetensors"
    tensors = load_file(weights)
    tensors[sorted(tensors)[-1]][0, 0] = float("nan")
    save_file(tensors, weights)
    with pytest.raises(AdapterRefused, match="adapter 'admin-bot' is refused: .* not finite"):
        resolve_adapters(["admin-bot"], registry=registry, settings=settings)


def test_padding_a_gap_or_another_dtype_in_the_weights_is_refused(tmp_path):
    """Issue 43, finding 7 (in part): nothing stored but the tensors (200 MiB of zeros after
    them were accepted), and only float weights."""
    folder, base = _adapter(tmp_path), _base(tmp_path)
    weights = folder / "adapter_model.safetensors"
    whole = weights.read_bytes()
    weights.write_bytes(whole + b"\0" * 4096)
    with pytest.raises(AdapterRefused, match="fill the file exactly"):
        check_adapter_dir(folder, base, max_rank=64)
    from safetensors.torch import load_file

    tensors = {name: t.to(torch.float64) for name, t in load_file(_adapter(tmp_path, name="f64") / "adapter_model.safetensors").items()}
    save_file(tensors, tmp_path / "f64" / "adapter_model.safetensors")
    with pytest.raises(AdapterRefused, match="admitted: F16, BF16, F32"):
        check_adapter_dir(tmp_path / "f64", base, max_rank=64)


def test_a_weights_file_that_is_not_safetensors_is_refused(tmp_path):
    folder = _adapter(tmp_path)
    (folder / "adapter_model.safetensors").write_bytes(b"\xff" * 8 + b"{}")
    with pytest.raises(AdapterRefused, match="header|safetensors"):
        check_adapter_dir(folder, _base(tmp_path), max_rank=64)


def test_the_registry_s_adapters_name_a_registered_generate_base():
    registry = load_registry()
    assert registry.adapters["tiny-lora-a"].base == "tiny-random-llama"
    assert registry.get("tiny-lora-a") is registry.models["tiny-random-llama"]  # an adapter's job runs its base
    raw = registry.model_dump()
    for bad in ({"base": "all-minilm-l6-v2"}, {"base": "nope"}):
        broken = {**raw, "adapters": {"x": {**raw["adapters"]["tiny-lora-a"], **bad}}}
        with pytest.raises(ValueError, match="not a registered generate model"):
            Registry.model_validate(broken)
    with pytest.raises(ValueError, match="no model has"):
        Registry.model_validate({**raw, "adapters": {"tiny-random-llama": raw["adapters"]["tiny-lora-a"]}})


def test_model_choice_allows_the_base_and_its_adapters_only():
    registry = load_registry()
    choice = model_choice(registry, "tiny-random-llama", owned={"mine": "tiny-random-llama", "theirs": "other"})
    assert choice.adapter_of(None) is None and choice.adapter_of("tiny-random-llama") is None
    assert choice.adapter_of("tiny-lora-b") == "tiny-lora-b" and choice.adapter_of("mine") == "mine"
    for refused in ("smollm2-lora-a", "theirs", "gpt-4o-mini", 7, ["x"]):
        with pytest.raises(ModelRefused, match="not this job's model 'tiny-random-llama'"):
            choice.adapter_of(refused)
    by_adapter = model_choice(registry, "tiny-lora-a", served_model_name="served")
    assert (by_adapter.base, by_adapter.default) == ("served", "tiny-lora-a")
    assert by_adapter.adapter_of(None) == "tiny-lora-a" and by_adapter.adapter_of("served") is None
    embedder = model_choice(registry, "all-minilm-l6-v2")
    assert embedder.adapters == []


def test_an_adapter_is_refused_where_a_model_is_unknown():
    registry = load_registry()
    with pytest.raises(UnknownModel, match="unknown model 'no-such'.*adapters"):
        registry.get("no-such")


def test_engine_rank_and_ids():
    assert [engine_rank([r]) for r in (1, 2, 8, 9, 64, 300)] == [1, 8, 8, 16, 64, 320]
    assert adapter_int_id("a") == adapter_int_id("a") > 0 and adapter_int_id("a") != adapter_int_id("b")
    assert ResolvedAdapter("a", Path("/x"), 8).lora_int_id == adapter_int_id("a")


def test_a_shard_s_adapters_set_the_engine_s_lora_arguments():
    from llm_batch.infra.model_resolution import ResolvedModel
    from llm_batch.runtime.worker import with_adapters

    model = ResolvedModel("m", Path("/m"), "generate", engine_args={"model": "/m", "max_loras": 2})
    assert with_adapters(model, []) is model
    adapters = [ResolvedAdapter(n, Path(f"/{n}"), r) for n, r in (("a", 8), ("b", 16), ("c", 8), ("d", 8), ("e", 8))]
    args = with_adapters(model, adapters).engine_args
    # The job's own engine_args win; the rank covers the largest; the CPU cache holds them all.
    assert (args["enable_lora"], args["max_loras"], args["max_lora_rank"], args["max_cpu_loras"]) == (True, 2, 16, 5)
    shared = with_adapters(ResolvedModel("m", Path("/m"), "generate", engine_args={}), adapters[:1], shared=True)
    assert (shared.engine_args["max_loras"], shared.engine_args["max_lora_rank"]) == (4, 64)


def _validated(adapters: list[str | None]) -> JobLayout:
    layout = new_layout()
    lines = []
    for i, adapter in enumerate(adapters):
        record = {"index": i, "custom_id": f"c{i}", "body": {"messages": [{"role": "user", "content": f"q{i}"}]}}
        if adapter:
            record["adapter"] = adapter
        lines.append(orjson.dumps(record) + b"\n")
    storage.write_bytes(layout.validated, b"".join(lines))
    return layout


def test_the_plan_groups_lines_by_adapter():
    from llm_batch.pipeline.sharding import plan_shards, read_manifest

    # Four models interleaved line by line: a contiguous plan would put all four on each shard.
    models = [None, "a", "b", "c"] * 16
    layout = _validated(models)
    plans = plan_shards(layout, 4)
    assert read_manifest(layout).adapter_grouped
    assert [p.count for p in plans] == [16, 16, 16, 16]
    assert [p.adapters for p in plans] == [[], ["a"], ["b"], ["c"]]
    for plan in plans:  # each shard's lines in input order
        indexes = [orjson.loads(line)["index"] for line in storage.read_bytes(plan.requests_uri).splitlines()]
        assert indexes == sorted(indexes)
    # Two shards: the base lines on one, the three adapters on the other; one model: the plans
    # without adapters, no adapter listed.
    assert [p.adapters for p in plan_shards(layout, 2)] == [[], ["a", "b", "c"]]
    single = _validated(["a"] * 10)
    assert [p.adapters for p in plan_shards(single, 3)] == [["a"], ["a"], ["a"]]
    assert not read_manifest(single).adapter_grouped


def test_the_plan_never_leaves_a_shard_empty():
    from llm_batch.pipeline.sharding import plan_shards

    layout = _validated(["a"] * 9 + [None])
    plans = plan_shards(layout, 5)
    assert len(plans) == 5 and all(p.count for p in plans) and sum(p.count for p in plans) == 10
    assert ModelChoice("b").adapters == []


def _shard_lines(plan) -> list[dict]:
    return [orjson.loads(line) for line in storage.read_bytes(plan.requests_uri).splitlines()]


def _sides(plans) -> list[str]:
    """Each shard's side: "base" (no line names an adapter), "lora" (every line does), or "mixed"."""
    sides = []
    for plan in plans:
        on_adapter = {bool(line.get("adapter")) for line in _shard_lines(plan)}
        sides.append("mixed" if len(on_adapter) == 2 else "lora" if on_adapter == {True} else "base")
    return sides


def test_a_job_mixing_base_and_adapter_lines_gets_a_shard_for_each_even_when_one_was_asked():
    from llm_batch.infra.results import ResultsWriter
    from llm_batch.pipeline.merge import merge_job
    from llm_batch.pipeline.sharding import plan_shards, read_manifest

    # The first line on an adapter: its side comes first, so shard 0 holds the first request.
    models = ["a", None, "b", None, None, "a", None, "c", None, None]
    layout = _validated(models)
    plans = plan_shards(layout, 1)
    manifest = read_manifest(layout)
    assert (manifest.num_shards, len(manifest.shards), manifest.adapter_grouped) == (1, 2, True)
    assert [p.index for p in plans] == [0, 1]
    assert _sides(plans) == ["lora", "base"]
    assert [p.adapters for p in plans] == [["a", "b", "c"], []]
    assert [p.count for p in plans] == [4, 6]
    indexes = [[line["index"] for line in _shard_lines(p)] for p in plans]
    assert indexes == [[0, 2, 5, 7], [1, 3, 4, 6, 8, 9]]  # each shard in input order
    assert sorted(i for shard in indexes for i in shard) == list(range(len(models)))  # every line once
    assert [(p.start, p.first_index, p.last_index) for p in plans] == [(0, 0, 7), (1, 1, 9)]
    # The merge interleaves the two shards back into input order.
    storage.write_bytes(layout.validation_errors, b"")
    for plan in plans:
        with ResultsWriter.open(plan.results_uri) as writer:
            for line in _shard_lines(plan):
                writer.write(ok_result(BatchRequest.model_validate(line)))
    counts = merge_job(layout)
    assert (counts.total, counts.succeeded) == (10, 10)
    outputs = [orjson.loads(line) for line in storage.read_bytes(layout.output_jsonl).splitlines()]
    assert [o["custom_id"] for o in outputs] == [f"c{i}" for i in range(10)]
    # Planned again: the same shards, their results kept.
    assert plan_shards(layout, 1) == plans
    assert merge_job(layout).succeeded == 10


@pytest.mark.parametrize(("models", "asked", "sides"), [
    # Shares in proportion to the lines: 10 base of 40 -> 1 of 4 shards; 30 of 40 -> 3.
    ([None] + ["a", "b", "c"] * 10 + [None] * 9, 4, ["base", "lora", "lora", "lora"]),
    ([None, None, None, "a"] * 10, 4, ["base", "base", "base", "lora"]),
    # One base line among many adapter lines still gets its own shard.
    (["a", "b"] * 20 + [None], 4, ["lora", "lora", "lora", "base"]),
    # More shards asked than lines: one line each, never both sides on one.
    ([None, "a", None], 8, ["base", "base", "lora"]),
    ([None, "a"], 1, ["base", "lora"]),
])
def test_no_shard_mixes_base_and_adapter_lines(models, asked, sides):
    from llm_batch.pipeline.sharding import plan_shards, read_manifest

    layout = _validated(models)
    plans = plan_shards(layout, asked)
    assert _sides(plans) == sides
    assert read_manifest(layout).num_shards == asked
    assert [p.index for p in plans] == list(range(len(plans)))
    assert all(p.count for p in plans)
    indexes = sorted(line["index"] for p in plans for line in _shard_lines(p))
    assert indexes == list(range(len(models)))


def test_a_job_mixing_base_and_adapter_lines_is_split_by_tokens_too():
    from llm_batch.pipeline.sharding import plan_shards

    layout = new_layout()
    lines = []
    for i in range(12):  # the four adapter lines carry most of the prompt tokens
        on_adapter = i % 3 == 0
        record = {"index": i, "custom_id": f"c{i}",
                  "body": {"messages": [{"role": "user", "content": ("x" * 400 if on_adapter else "q")}]}}
        if on_adapter:
            record["adapter"] = "a"
        lines.append(orjson.dumps(record) + b"\n")
    storage.write_bytes(layout.validated, b"".join(lines))
    plans = plan_shards(layout, 1, by="tokens")
    assert _sides(plans) == ["lora", "base"] and [p.count for p in plans] == [4, 8]
    assert _sides(plan_shards(layout, 4, by="tokens")) == ["lora", "lora", "lora", "base"]


def test_jobs_on_one_side_keep_their_plans():
    from llm_batch.pipeline.sharding import plan_shards, read_manifest

    base = _validated([None] * 10)
    assert [(p.first_index, p.last_index) for p in plan_shards(base, 1)] == [(0, 9)]
    assert [(p.first_index, p.last_index) for p in plan_shards(base, 3)] == [(0, 2), (3, 6), (7, 9)]
    assert not read_manifest(base).adapter_grouped
    adapters = _validated(["a", "b"] * 5)
    one = plan_shards(adapters, 1)
    assert [(p.count, p.adapters) for p in one] == [(10, ["a", "b"])]
    assert not read_manifest(adapters).adapter_grouped
    assert [(p.count, p.adapters) for p in plan_shards(adapters, 2)] == [(5, ["a"]), (5, ["b"])]
    assert read_manifest(adapters).adapter_grouped


# -- an uploaded archive (unpack_adapter) -----------------------------------------------------

CONFIG, WEIGHTS = b'{"peft_type": "LORA"}', b"\x08" + b"\x00" * 15
TWO = {"adapter_config.json": CONFIG, "adapter_model.safetensors": WEIGHTS}


def _tar(path: Path, files: dict[str, bytes], *, gz: bool = False, folders: tuple[str, ...] = (),
         links: dict[str, tuple[bytes, str]] | None = None) -> Path:
    with tarfile.open(path, "w:gz" if gz else "w") as tar:
        for folder in folders:
            info = tarfile.TarInfo(folder)
            info.type = tarfile.DIRTYPE
            tar.addfile(info)
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for name, (kind, target) in (links or {}).items():
            info = tarfile.TarInfo(name)
            info.type, info.linkname = kind, target
            tar.addfile(info)
    return path


def _zip(path: Path, files: dict[str, bytes], *, symlinks: dict[str, str] | None = None) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zipped:
        for name, data in files.items():
            zipped.writestr(name, data)
        for name, target in (symlinks or {}).items():
            info = zipfile.ZipInfo(name)
            info.external_attr = (0o120777 << 16)  # S_IFLNK
            zipped.writestr(info, target)
    return path


@pytest.mark.parametrize("make", [
    lambda p: _tar(p, TWO),
    lambda p: _tar(p, {f"my-lora/{n}": d for n, d in TWO.items()}, folders=("my-lora",), gz=True),
    lambda p: _tar(p, {f"./{n}": d for n, d in TWO.items()}, folders=(".",)),  # tar -C folder .
    lambda p: _zip(p, TWO),
    lambda p: _zip(p, {f"my-lora/{n}": d for n, d in TWO.items()}),
], ids=["tar", "tar.gz in a folder", "tar of ./", "zip", "zip in a folder"])
def test_an_archive_of_the_two_files_is_unpacked_flat(tmp_path, make):
    dest = tmp_path / "out"
    unpack_adapter(make(tmp_path / "upload"), dest, max_bytes=1000)
    assert {p.name: p.read_bytes() for p in dest.iterdir()} == TWO


@pytest.mark.parametrize("make, reason", [
    (lambda p: _tar(p, {**TWO, "adapter_model.bin": b"pickle"}), "'adapter_model.bin' is not admitted"),
    (lambda p: _tar(p, {"adapter_config.json": CONFIG, "adapter_model.bin": b"x"}), "'adapter_model.bin' is not admitted"),
    (lambda p: _tar(p, {**TWO, "README.md": b"hi"}), "'README.md' is not admitted"),
    (lambda p: _tar(p, {"../adapter_config.json": CONFIG, "adapter_model.safetensors": WEIGHTS}), "'..'"),
    (lambda p: _tar(p, {"/adapter_config.json": CONFIG, "adapter_model.safetensors": WEIGHTS}), "absolute"),
    (lambda p: _tar(p, {"adapter_config.json": CONFIG},
                    links={"adapter_model.safetensors": (tarfile.SYMTYPE, "/etc/passwd")}), "is a link"),
    (lambda p: _tar(p, {"adapter_config.json": CONFIG},
                    links={"adapter_model.safetensors": (tarfile.LNKTYPE, "adapter_config.json")}), "is a link"),
    (lambda p: _tar(p, {"adapter_config.json": CONFIG}, links={"fifo": (tarfile.FIFOTYPE, "")}), "not a regular file"),
    (lambda p: _zip(p, {"adapter_config.json": CONFIG}, symlinks={"adapter_model.safetensors": "/etc/passwd"}),
     "is a link"),
    (lambda p: _zip(p, {"../adapter_config.json": CONFIG, "adapter_model.safetensors": WEIGHTS}), "'..'"),
    (lambda p: _zip(p, {"a/adapter_config.json": CONFIG, "b/adapter_model.safetensors": WEIGHTS}), "one top folder"),
    (lambda p: _zip(p, {"a/b/adapter_config.json": CONFIG, "a/b/adapter_model.safetensors": WEIGHTS}), "one top folder"),
    (lambda p: _zip(p, {"adapter_config.json": CONFIG, "a/adapter_model.safetensors": WEIGHTS}), "one top folder"),
    (lambda p: _tar(p, {"adapter_config.json": CONFIG}), "no adapter_model.safetensors"),
    (lambda p: _tar(p, {**TWO, "a/adapter_config.json": CONFIG}), "one top folder"),
    (lambda p: _tar(p, {"adapter_config.json": CONFIG, "./adapter_config.json": CONFIG}), "twice"),
    (lambda p: _tar(p, {"adapter_config.json": CONFIG, "adapter_model.safetensors": b"x" * 2000}), "limit of 1000 bytes"),
    (lambda p: _tar(p, TWO, folders=(".",) * MAX_ARCHIVE_MEMBERS), "more than"),
    (lambda p: _zip(p, {f"d{i}/": b"" for i in range(MAX_ARCHIVE_MEMBERS + 1)}), "members"),
    (lambda p: p.write_bytes(b"PK\x03\x04 not really a zip") and p, "not a .tar, .tar.gz or .zip"),
    (lambda p: p.write_bytes(b"\x1f\x8b\x08\x00garbage") and p, "cannot be read"),
    (lambda p: p.write_bytes(json.dumps({"a": 1}).encode()) and p, "not a .tar, .tar.gz or .zip"),
], ids=["pickle beside", "pickle instead", "extra file", "dot-dot", "absolute", "symlink", "hardlink", "fifo",
        "zip symlink", "zip dot-dot", "two folders", "nested folder", "mixed levels", "missing weights",
        "top and folder", "duplicate", "too big", "too many members", "zip too many", "fake zip", "corrupt gzip",
        "json"])
def test_anything_else_in_an_archive_is_refused_saying_what(tmp_path, make, reason):
    dest = tmp_path / "out"
    with pytest.raises(AdapterRefused, match=reason.replace(".", r"\.").replace("(", r"\(")):
        unpack_adapter(make(tmp_path / "upload"), dest, max_bytes=1000)
    assert not dest.exists() or not any(p.name in TWO for p in dest.iterdir())  # nothing half-written kept

