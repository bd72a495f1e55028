"""The vLLM internals llm_batch uses (src/llm_batch/runtime/engine/vllm_api.py) against the installed
vLLM, without starting an engine: every name in ``INTERNAL_USES`` exists with a signature
the adapter's calls still fit, and the installed version is inside ``SUPPORTED_VLLM``.

A failure here after a vLLM upgrade names the attribute and the supported range: adapt
``vllm_api`` to the new vLLM (and widen ``SUPPORTED_VLLM``), or keep vLLM inside the range.
The engine tests (tests/engine) then check the behaviour behind these names.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import re

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from llm_batch.runtime.engine import vllm_api
from llm_batch.runtime.engine.vllm_api import INTERNAL_USES, SUPPORTED_VLLM, InternalUse


def _where(use: InternalUse) -> str:
    return f"{use.owner.replace(':', '.')}.{use.name}"


def _fail(use: InternalUse, problem: str) -> None:
    installed = vllm_api.installed_vllm_version()
    kind = "private vLLM API" if use.private else "vLLM API"
    pytest.fail(
        f"{_where(use)} ({kind}, used by llm_batch.runtime.engine.vllm_api.{use.used_by}) {problem} "
        f"in the installed vLLM {installed}; llm-batch supports vllm{SUPPORTED_VLLM}. "
        f"Adapt src/llm_batch/runtime/engine/vllm_api.py to this vLLM (then widen SUPPORTED_VLLM), "
        f"or install a vLLM inside the range.",
        pytrace=False,
    )


def _owner(use: InternalUse) -> object:
    module_name, _, class_name = use.owner.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        _fail(use, f"cannot be imported (module {module_name}: {exc})")
    if not class_name:
        return module
    owner = getattr(module, class_name, None)
    if owner is None:
        _fail(use, f"is missing (no class {class_name} in {module_name})")
    return owner


@pytest.mark.parametrize("guarded", [False, True], ids=["as-installed", "after-the-cpu-lora-guard"])
@pytest.mark.parametrize("use", INTERNAL_USES, ids=_where)
def test_vllm_still_has_what_the_adapter_uses(use: InternalUse, guarded: bool):
    # An in-process engine of an earlier test may have guarded the CPU LoRA ops: the check
    # must see vLLM's own signatures either way.
    if guarded:
        vllm_api.guard_cpu_lora()
    owner = _owner(use)
    if use.kind == "instance attribute":
        # Set on the instance, so not on the class: its __init__ must still assign it.
        source = inspect.getsource(owner.__init__)
        if not re.search(rf"\bself\.{re.escape(use.name)}\s*(:[^=\n]*)?=[^=]", source):
            _fail(use, f"is no longer assigned by {owner.__name__}.__init__")
        return

    target = inspect.getattr_static(owner, use.name, None)
    if target is None:
        _fail(use, "is missing")
    function = getattr(owner, use.name)
    if not callable(function):
        _fail(use, f"is no longer a {use.kind} (it is {type(target).__name__})")
    if use.kind == "method" and isinstance(target, (staticmethod, classmethod)):
        _fail(use, f"became a {type(target).__name__}")

    P = inspect.Parameter
    parameters = list(inspect.signature(function).parameters.values())
    if use.kind == "method":
        parameters = parameters[1:]  # self
    shown = f"({', '.join(str(p).split(':')[0].split('=')[0] for p in parameters)})"
    if use.by_name:
        by_name = {p.name: p for p in parameters if p.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY)}
        if any(name not in by_name for name in use.parameters):
            _fail(use, f"changed its signature: the adapter passes {', '.join(use.parameters)} by "
                       f"name, vLLM now takes {shown}")
        passed = [by_name[name] for name in use.parameters]
    else:
        passed = parameters[: len(use.parameters)]
        if (tuple(p.name for p in passed) != use.parameters
                or any(p.kind not in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD) for p in passed)):
            _fail(use, f"changed its signature: the adapter passes ({', '.join(use.parameters)}) "
                       f"positionally, vLLM now takes {shown}")
    required = [p.name for p in parameters if p not in passed
                and p.default is P.empty and p.kind not in (P.VAR_POSITIONAL, P.VAR_KEYWORD)]
    if required:
        _fail(use, f"now requires {', '.join(required)}, which the adapter does not pass "
                   f"(vLLM takes {shown})")


def test_every_private_vllm_name_in_the_adapter_is_listed():
    # A new llm._something in vllm_api without an INTERNAL_USES entry would go unchecked.
    source = inspect.getsource(vllm_api)
    code = source.split('"""', 2)[2]  # past the module docstring
    called = set(re.findall(r"\.(_[a-z]\w*)\(", code))
    listed = {u.name for u in INTERNAL_USES if u.private}
    assert called <= listed, f"private vLLM names used but not in INTERNAL_USES: {called - listed}"


def test_installed_vllm_is_in_the_supported_range():
    installed = vllm_api.installed_vllm_version()
    assert SpecifierSet(SUPPORTED_VLLM).contains(Version(installed), prereleases=True), (
        f"installed vLLM {installed} is outside llm-batch's supported range vllm{SUPPORTED_VLLM}: "
        "the adapter's internal uses (src/llm_batch/runtime/engine/vllm_api.py) are only known to match "
        "inside it; check them on this vLLM, then move SUPPORTED_VLLM and the pins "
        "(pyproject's vllm extra, inference_image/Dockerfile's base tag) together")
    assert vllm_api.vllm_supported() and vllm_api.check_vllm_version()


@pytest.mark.parametrize(("version", "inside"), [
    ("0.32.0", True), ("0.32.0+cpu", True), ("0.32.3.dev4+g0123abc", True),
    ("0.31.2", False), ("0.33.0rc1", False), ("0.33.0", False), ("1.0.0", False), ("not-a-version", False),
])
def test_outside_the_range_warns_once_and_never_raises(caplog, monkeypatch, version, inside):
    monkeypatch.setattr(vllm_api, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="llm_batch.runtime.engine"):
        assert vllm_api.check_vllm_version(version) is inside
        assert vllm_api.check_vllm_version(version) is inside
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    if inside:
        assert warnings == []
    else:
        assert len(warnings) == 1
        assert version in warnings[0] and SUPPORTED_VLLM in warnings[0]
        assert "LLM._preprocess_chat_one" in warnings[0]


def test_the_cpu_lora_guard_leaves_base_rows_as_they_are_whatever_the_slot_holds():
    """``_adapter_rows_only`` on vLLM's own expand ops: a base token (index -1, which the CPU
    ops read as the last slot) keeps its row exactly though that slot's B is NaN; an adapter
    token's row gets its adapter's delta as the unguarded op gives it."""
    import torch
    from vllm.lora.ops.torch_ops import lora_ops

    weights = torch.ones(2, 1, 6, 4)  # 2 slots of B (out 6, rank 4)
    weights[1] = float("nan")  # the last slot: what a base token gathers
    inputs = torch.ones(3, 4)
    indices = torch.tensor([0, -1, 0])
    for name, extra in (("bgmv_expand", ()), ("bgmv_expand_slice", (1, 6))):  # (slice_offset, slice_size)
        op = inspect.unwrap(getattr(lora_ops, name))  # vLLM's own, though an engine of this process guarded it
        guarded, plain = torch.rand(3, 8), torch.zeros(3, 8)
        plain[:] = guarded
        before = guarded[1].clone()
        vllm_api._adapter_rows_only(op)(inputs, weights, guarded, indices, *extra)
        op(inputs, weights, plain, indices, *extra)
        assert torch.equal(guarded[1], before), name  # untouched
        assert bool(plain[1].isnan().any()), name  # what the guard prevents
        assert torch.equal(guarded[[0, 2]], plain[[0, 2]]), name
