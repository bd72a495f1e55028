"""vLLM's serving layer (``OpenAIServingChat``, as run_batch builds it) behind the worker's interface.

    .venv/bin/python benchmarks/serving_layer.py [--requests 256] [--repeat 3] [--cases abe]

Issue 30: could vLLM's own serving layer replace ``llm_batch.runtime.engine.sampling`` (body ->
SamplingParams), ``.responses`` (RequestOutput -> OpenAI body) and the private rendering call? The same
requests as benchmarks/worker.py (256 chat prompts, SmolLM2-135M-Instruct, greedy, 64-128 max
tokens; enforce_eager, bf16, max_model_len 2048, VLLM_CPU_KVCACHE_SPACE=2), each case in a fresh
process, rounds interleaved (abe abe ...), median of ``--repeat``:

  (a) ``llm-batch worker`` on one shard as shipped (our runner/sampling/responses; on CPU the
      engine core runs in the worker's process)
  (b) the serving layer behind the worker's interface: the engine client and
      ``state.openai_serving_chat`` built exactly as vLLM's run_batch builds them
      (run_batch's argument parser, ``build_async_engine_client``, ``init_app_state``), each shard
      request's body turned into a ``ChatCompletionRequest`` and awaited with
      ``create_chat_completion``, at most 4 x max_num_seqs requests between fed and written (the
      worker's window), each response written in input order as a ``ResultRecord`` through the
      worker's ``ResultsWriter`` (same checkpointing: a part every 2 s or 1000 records)
  (e) the worker with its engine core in a process of its own (``LLM_BATCH_ENGINE_IN_PROCESS=false``):
      the engine layout (b) cannot avoid (AsyncLLM has no in-process engine core in vLLM 0.32:
      ``EngineCoreClient.make_client`` raises NotImplementedError for asyncio without
      multiprocessing), so (b)/(e) is the serving layer's own cost and (b)/(a) the whole swap's

Printed: completion tokens, whole-process seconds, generation tokens/s (engine ready -> last
result written: the worker's ``tokens_per_s``; timed the same way in (b)), the ratios (b)/(a) and
(b)/(e), and the load (``uptime``) before and after. Then, untimed, a shape check: both (a) and (b)
must give one 200 result per request with the same custom_id set; the response bodies' key trees
(choices, message, usage, and logprobs on a small extra pass with ``logprobs: true,
top_logprobs: 2``) are compared and every difference printed, as are per-request prompt-token
mismatches. Model text is never compared.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import worker as bench  # noqa: E402  benchmarks/worker.py: model resolution, engine settings, requests

SERVED_NAME = bench.CHAT_MODEL  # the "model" our worker writes into its responses


def logprob_body(i: int) -> dict:
    """A request of the untimed shape pass: token logprobs with the top 2."""
    return {**bench.chat_body(i, lambda _: 8), "logprobs": True, "top_logprobs": 2}


# -- (b) the serving layer, in its own process ---------------------------------------------------

def serving_main(model_dir: str, results: str, out: str, n: int, logprobs: bool) -> None:
    asyncio.run(_serve(model_dir, results, out, n, logprobs))


async def _serve(model_dir: str, results: str, out: str, n: int, logprobs: bool) -> None:
    from starlette.datastructures import State
    from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client, init_app_state
    from vllm.entrypoints.launchers.run_batch import make_arg_parser, validate_run_batch_args
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest, ChatCompletionResponse
    from vllm.usage.usage_lib import UsageContext
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from llm_batch.core.records import RequestError, ResultRecord
    from llm_batch.infra.results import ResultsWriter

    # run_batch's own parser and builders (vllm.entrypoints.launchers.run_batch: main,
    # build_endpoint_registry), with the engine settings of benchmarks/worker.py.
    args = make_arg_parser(FlexibleArgumentParser()).parse_args([
        "-i", "unused", "-o", "unused", "--model", model_dir, "--served-model-name", SERVED_NAME,
        "--enforce-eager", "--dtype", "bfloat16", "--max-model-len", str(bench.MAX_MODEL_LEN), "--seed", "0"])
    validate_run_batch_args(args)
    started = time.monotonic()
    async with build_async_engine_client(args, usage_context=UsageContext.OPENAI_BATCH_RUNNER) as client:
        state = State()
        await init_app_state(client, state, args, await client.get_supported_tasks())
        chat = state.openai_serving_chat
        window = 4 * client.vllm_config.scheduler_config.max_num_seqs  # the worker's WINDOW_PER_SEQ
        ready = time.monotonic()

        async def one(i: int) -> ResultRecord:
            body = logprob_body(i) if logprobs else bench.chat_body(i)
            try:
                response = await chat.create_chat_completion(
                    ChatCompletionRequest.model_validate({"model": SERVED_NAME, **body}))
            except Exception as exc:  # noqa: BLE001 - as run_batch: the request's error result
                return ResultRecord(index=i, custom_id=f"c{i}", status_code=500,
                                    error=RequestError(code="engine_error", message=str(exc)))
            if isinstance(response, ChatCompletionResponse):
                return ResultRecord(index=i, custom_id=f"c{i}", status_code=200,
                                    body=response.model_dump(mode="json"))
            error = response.error  # ErrorResponse
            return ResultRecord(index=i, custom_id=f"c{i}", status_code=error.code,
                                error=RequestError(code=error.type, message=error.message))

        tokens = 0
        with ResultsWriter.open(results) as writer:  # the worker's checkpointing
            tasks: dict[int, asyncio.Task] = {}
            fed = written = writer.done  # resume: skip what has results, as the worker does
            while written < n:
                while fed < n and fed - written < window:
                    tasks[fed] = asyncio.create_task(one(fed))
                    fed += 1
                record = await tasks.pop(written)  # in input order, like the worker's reorder buffer
                writer.write(record)
                tokens += (record.body or {}).get("usage", {}).get("completion_tokens", 0)
                written += 1
            gen_seconds = time.monotonic() - ready
        Path(out).write_text(json.dumps({"tokens": tokens, "gen_seconds": gen_seconds,
                                         "start_seconds": ready - started, "window": window}))


def run_serving(model_dir: Path, n: int, env: dict[str, str], home: Path, work: Path,
                logprobs: bool = False) -> dict:
    job = f"serving-{uuid.uuid4().hex[:8]}"
    results = home / "work" / job / "shards" / "00000" / "results"
    results.parent.mkdir(parents=True, exist_ok=True)
    out = work / f"{job}.json"
    cmd = [sys.executable, __file__, "--serving", str(model_dir), str(results), str(out),
           "--requests", str(n)] + (["--logprobs"] if logprobs else [])
    seconds, _ = bench.timed(cmd, env, work / f"{job}.log")
    figures = json.loads(out.read_text())
    return {"name": "(b) vLLM serving layer (OpenAIServingChat)", "tokens": figures["tokens"],
            "seconds": seconds, "gen_tok_s": figures["tokens"] / figures["gen_seconds"],
            "results": str(results)}


# -- (a), (e): the worker, as benchmarks/worker.py runs it ----------------------------------------

def run_worker(name: str, n: int, env: dict[str, str], home: Path, work: Path, **kw: Any) -> dict:
    row = bench.run_worker(name, bench.CHAT_MODEL, n, env, home, work, **kw)
    job = Path(row["log"]).stem
    return {**row, "results": str(home / "work" / job / "shards" / "00000" / "results")}


CASES = {
    "a": lambda d, n, env, home, work: run_worker("(a) llm-batch worker", n, env, home, work),
    "b": lambda d, n, env, home, work: run_serving(d, n, env, home, work),
    "e": lambda d, n, env, home, work: run_worker("(e) worker, engine core own process", n,
                                                  {**env, "LLM_BATCH_ENGINE_IN_PROCESS": "false"}, home, work),
}


# -- shapes ---------------------------------------------------------------------------------------

def load(results: str) -> dict[str, Any]:
    from llm_batch.infra.results import read_results

    return {r.custom_id: r for r in read_results(results)}


def key_paths(value: Any, prefix: str = "") -> dict[str, str]:
    """path -> JSON type of every field of a body (lists: their first item, as ``[0]``)."""
    paths: dict[str, str] = {}
    if isinstance(value, dict):
        for key, item in value.items():
            path = f"{prefix}.{key}" if prefix else key
            paths[path] = type(item).__name__ if item is not None else "null"
            paths.update(key_paths(item, path))
    elif isinstance(value, list) and value:
        paths.update(key_paths(value[0], f"{prefix}[0]"))
    return paths


def compare(label: str, ours: dict[str, Any], theirs: dict[str, Any], n: int) -> None:
    print(f"\nshape check, {label}:")
    for name, records in (("(a) worker", ours), ("(b) serving layer", theirs)):
        ok = sum(r.ok for r in records.values())
        print(f"  {name}: {len(records)} results for {n} requests, {ok} ok, "
              f"custom_ids {'= c0..c' + str(n - 1) if set(records) == {f'c{i}' for i in range(n)} else 'DIFFER'}")
    if set(ours) != set(theirs):
        print("  custom_id sets DIFFER")
        return
    a_paths: dict[str, set[str]] = {}
    b_paths: dict[str, set[str]] = {}
    prompt_mismatch = choices_mismatch = 0
    for cid in ours:
        a, b = ours[cid].body or {}, theirs[cid].body or {}
        for paths, body in ((a_paths, a), (b_paths, b)):
            for path, kind in key_paths(body).items():
                paths.setdefault(path, set()).add(kind)
        prompt_mismatch += a.get("usage", {}).get("prompt_tokens") != b.get("usage", {}).get("prompt_tokens")
        choices_mismatch += len(a.get("choices", ())) != len(b.get("choices", ()))
    print(f"  requests whose usage.prompt_tokens differ: {prompt_mismatch}; whose number of choices differ: "
          f"{choices_mismatch}")
    only_a = sorted(set(a_paths) - set(b_paths))
    only_b = sorted(set(b_paths) - set(a_paths))
    typed = sorted(p for p in set(a_paths) & set(b_paths) if a_paths[p] != b_paths[p])
    print(f"  fields only (a) has: {', '.join(only_a) or 'none'}")
    print(f"  fields only (b) has: {', '.join(only_b) or 'none'}")
    print("  same field, other type: " + (", ".join(
        f"{p} ({'/'.join(sorted(a_paths[p]))} vs {'/'.join(sorted(b_paths[p]))})" for p in typed) or "none"))


# -- main -----------------------------------------------------------------------------------------

def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3, help="interleaved rounds (median)")
    parser.add_argument("--cases", default="abe", help="cases to time (default abe; '' = shape check only)")
    parser.add_argument("--shape-requests", type=int, default=16, help="requests of the logprobs shape pass (0: skip)")
    parser.add_argument("--model-cache", type=Path,
                        default=Path(os.environ.get("LLM_BATCH_TEST_MODEL_CACHE",
                                                    Path.home() / ".cache/llm-batch-test/models")))
    # internal: run (b) in this process
    parser.add_argument("--serving", nargs=3, metavar=("MODEL_DIR", "RESULTS", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--logprobs", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serving:
        return serving_main(*args.serving, args.requests, args.logprobs)

    from llm_batch.core.config import get_settings

    model_dir = bench.prepare(args.model_cache, bench.CHAT_MODEL)[bench.CHAT_MODEL]
    n = args.requests
    with tempfile.TemporaryDirectory(prefix="llm-batch-serving-") as tmp:
        work, home = Path(tmp), Path(tmp) / "home"
        env = bench.engine_env(home, args.model_cache)
        os.environ.update(env)  # this process reads the results under home (storage's allowed roots)
        get_settings.cache_clear()
        load_before = uptime()
        runs: dict[str, list[dict]] = {case: [] for case in args.cases}
        for _ in range(args.repeat if args.cases else 0):
            for case in args.cases:
                runs[case].append(CASES[case](model_dir, n, env, home, work))
                print(f"  {runs[case][-1]['name']}: {runs[case][-1]['seconds']:.1f} s, "
                      f"{runs[case][-1]['gen_tok_s']:.0f} gen tok/s", flush=True)
        load_after = uptime()
        if args.cases:
            report(runs, n, args.repeat, load_before, load_after)
        if "a" in runs and "b" in runs:
            ours, theirs = (load(runs[c][0]["results"]) for c in "ab")
            # Greedy, same prompts: the token counts per request may still differ (run_batch
            # applies the checkpoint's generation_config); only shapes and prompts are compared.
            compare(f"the {n} timed requests (first round)", ours, theirs, n)
        if args.shape_requests:
            m = args.shape_requests
            ours = load(run_worker("shape", m, env, home, work, body_of=logprob_body)["results"])
            theirs = load(run_serving(model_dir, m, env, home, work, logprobs=True)["results"])
            compare(f"{m} requests with logprobs: true, top_logprobs: 2, max_tokens 8", ours, theirs, m)


def report(runs: dict[str, list[dict]], n: int, repeat: int, load_before: str, load_after: str) -> None:
    rows = {case: {**results[0], "seconds": statistics.median(r["seconds"] for r in results),
                   "gen_tok_s": statistics.median(r["gen_tok_s"] for r in results)}
            for case, results in runs.items()}
    print(f"\n{n} chat requests, {bench.CHAT_MODEL}, greedy, 64-128 max tokens; median of {repeat} "
          f"interleaved round(s); {os.cpu_count()} cores")
    print(f"load before: {load_before}\nload after:  {load_after}")
    print(f"{'':44} {'tokens':>7} {'process s':>10} {'process tok/s':>14} {'gen tok/s':>10}  each run s / gen tok/s")
    for case, row in rows.items():
        each = " ".join(f"{r['seconds']:.1f}/{r['gen_tok_s']:.0f}" for r in runs[case])
        print(f"{row['name']:44} {row['tokens']:7d} {row['seconds']:10.1f} "
              f"{row['tokens'] / row['seconds']:14.0f} {row['gen_tok_s']:10.0f}  {each}")
    rate = lambda r: r["tokens"] / r["seconds"]  # noqa: E731
    a, b, e = (rows.get(c) for c in "abe")
    if a and b:
        print(f"(b) / (a), serving layer / worker as shipped:      generation {b['gen_tok_s'] / a['gen_tok_s']:.3f}"
              f"  whole process {rate(b) / rate(a):.3f}   (adopt if >= 0.98)")
    if e and b:
        print(f"(b) / (e), serving layer / worker, same layout:    generation {b['gen_tok_s'] / e['gen_tok_s']:.3f}"
              f"  whole process {rate(b) / rate(e):.3f}")


if __name__ == "__main__":
    main()
