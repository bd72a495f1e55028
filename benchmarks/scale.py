"""A big greedy job: the full stack vs vLLM's ``LLM.generate`` on the same lines, side by side.

    PYTHONPATH=src:. .venv/bin/python benchmarks/scale.py [--lines 100000] [--storage local|s3]
        [--cache on|off|both] [--model tiny-random-llama] [--max-tokens 2]

The input (written once): ``--lines`` greedy ``/v1/completions`` lines in OpenAI's batch line
shape, each with a distinct prompt of 25 words (~336 bytes a line: 33.6 MB at 100k).

1. Raw: a subprocess builds ``vllm.LLM`` as the stack's worker does
   (``llm_batch.runtime.engine.runner.start_engine``: the registry's engine arguments, the
   engine core in the process on CPU) and runs ``LLM.generate`` over the file's prompts. Its
   time runs from the process's start (imports, reading the file and the model load count,
   as they do in the worker) to the last output; printed also without the load.
2. Stack: per cache setting, a fresh embedded stack (``llm-batch up``'s: LocalExecutor,
   SQLite, warm engines) in a temporary home, the model cache shared with the raw side,
   ``LLM_BATCH_RESULT_CACHE`` off or on. A fresh stack each, so each first job starts its
   engine cold as the raw side does. The file goes through the REST API as a user sends it
   (upload, ``POST /batch/v1/jobs``, one shard); the time runs from the upload's start to
   the job's end seen by polling. The output is checked: one line per input line, the
   custom_ids in input order, every line a 200. With the cache on, the same file is then
   submitted again (upload included: a new job of the same owner), answered wholly from
   the cache.

Each job's steps: Airflow's task instances (``/api/v2``: ``prepare``, ``run_shard``,
``finalize``) and the job's own timestamps (its job store): validate + plan (``started_at``
to ``in_progress_at``) and merge + finalize (``finalizing_at`` to ``completed_at``). Each pair
runs in one task with no timestamp between its steps, so their split is not measured. The
fill is the merge + finalize seconds with the cache on minus those with it off.

``--storage s3``: one SeaweedFS S3 server (``benchmarks/s3.py``, started after the raw side)
holds each stack's uploads, work files and result cache; the input is still written locally
and uploaded. Both sides run with the same engine settings: ``VLLM_CPU_KVCACHE_SPACE`` (the
stack's 2 GiB unless set) and ``LLM_BATCH_ENFORCE_EAGER`` (on unless set, as the other
benchmarks run) from the environment. Printed: one table with the targets of issue 46 (they
are for 100k and 1M lines on a quiet machine) and the load average around each part.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.s3 import BUCKET, start_s3  # noqa: E402
from benchmarks.shape import all_task_instances, ts  # noqa: E402
from benchmarks.small_jobs import stack_in_temp_home  # noqa: E402

WORDS = ("apple river stone cloud green quiet seven market paper window orange silver garden winter "
         "morning engine bridge yellow forest number letter animal summer island planet signal travel "
         "circle mirror sudden basket pocket rocket candle velvet hollow meadow harbor").split()
_RESULT = "SCALE-BENCH-RESULT "


def custom_id(i: int) -> str:
    return f"r-{i:07d}"


def write_input(path: Path, model: str, lines: int, max_tokens: int) -> None:
    rng = random.Random(46)
    with path.open("wb") as out:
        for i in range(lines):
            prompt = f"{i}: " + " ".join(rng.choice(WORDS) for _ in range(25))
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
            out.write(json.dumps({"custom_id": custom_id(i), "method": "POST", "url": "/v1/completions",
                                  "body": body}).encode() + b"\n")


# -- raw ------------------------------------------------------------------------------------


def run_raw(path: Path, model: str, max_tokens: int) -> dict[str, float]:
    """In this process (a subprocess of the benchmark): imports, the file, the model load and
    ``LLM.generate``, timed from the process's start to the last output."""
    import psutil

    started = psutil.Process().create_time()
    from vllm import SamplingParams

    from llm_batch.infra.model_resolution import resolve_model
    from llm_batch.runtime.engine.runner import start_engine

    with path.open("rb") as lines:
        prompts = [orjson.loads(line)["body"]["prompt"] for line in lines]
    resolved = resolve_model({"model": model})
    load_started = time.time()
    llm = start_engine(resolved)  # placed as the worker places it: in this process on CPU
    loaded = time.time()
    outputs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0), use_tqdm=False)
    ended = time.time()
    assert len(outputs) == len(prompts), (len(outputs), len(prompts))
    return {"total_s": ended - started, "load_s": loaded - load_started, "generate_s": ended - loaded,
            "tokens": sum(len(o.outputs[0].token_ids) for o in outputs)}


def raw(path: Path, model: str, max_tokens: int) -> dict[str, Any]:
    done = subprocess.run([sys.executable, __file__, "--raw-only", str(path), "--model", model,
                           "--max-tokens", str(max_tokens)], capture_output=True, text=True)
    # vLLM logs to stdout too: the result is the line with the marker.
    found = [line for line in done.stdout.splitlines() if line.startswith(_RESULT)]
    if done.returncode or not found:
        return {"why": f"the raw run failed (exit {done.returncode}): {done.stderr[-1500:]}"}
    return json.loads(found[0][len(_RESULT):])


# -- stack ----------------------------------------------------------------------------------


def stack_runs(model_cache: Path, path: Path, args: argparse.Namespace, cache: bool,
               s3_env: dict[str, str] | None) -> dict[str, dict[str, Any]]:
    """The job on a fresh stack; with the cache on, the same file again as a new job."""
    name = f"scale-cache-{'on' if cache else 'off'}"
    env = {"LLM_BATCH_RESULT_CACHE": str(cache).lower()}
    if s3_env is not None:  # each stack its own prefix: the cache-on stack starts with an empty cache
        root = f"s3://{BUCKET}/{name}"
        env |= s3_env | {"LLM_BATCH_WORK_URI": f"{root}/work", "LLM_BATCH_FILES_URI": f"{root}/files",
                         "LLM_BATCH_RESULT_CACHE_URI": f"{root}/result-cache"}
    runs: dict[str, dict[str, Any]] = {}
    with stack_in_temp_home(model_cache, name, **env) as stack:
        runs["first"] = one_job(stack, path, args)
        if cache and "why" not in runs["first"]:
            runs["rerun"] = one_job(stack, path, args)
    return runs


def one_job(stack: Any, path: Path, args: argparse.Namespace) -> dict[str, Any]:
    from llm_batch.infra.api_client import BatchClient
    from llm_batch.infra.jobstore import JobStore

    with BatchClient(f"{stack.base_url}/batch", stack.ensure_api_key(), timeout=600) as client:
        started = time.time()
        file_id = client.upload(path)
        uploaded = time.time()
        job = client.create_job({"input_file_ids": [file_id], "endpoint": "/v1/completions", "model": args.model,
                                 "data_parallelism": 1})
        created = time.time()
        while not job["terminal"]:
            time.sleep(0.5)
            job = client.get_job(job["id"])
        ended = time.time()
        if job["status"] != "SUCCEEDED":
            return {"why": f"job {job['id']} ended {job['status']}: {job.get('status_reason')}"}
        wrong = check_output(client, job["output_file_id"], args.lines)
    store = JobStore(stack.settings.database_url)
    try:
        record = store.get_job(job["id"])
    finally:
        store.close()
    tasks = {ti["task_id"]: ti for ti in all_task_instances(stack, job) if ti["task_id"] != "run_shard"
             or ti["map_index"] >= 0}

    def task_s(task_id: str) -> float | None:
        ti = tasks.get(task_id) or {}
        start, end = ts(ti.get("start_date")), ts(ti.get("end_date"))
        return end - start if start and end else None

    def between(a: Any, b: Any) -> float | None:
        return (b - a).total_seconds() if a and b else None

    prepare_start = ts((tasks.get("prepare") or {}).get("start_date"))
    return {"wall_s": ended - started, "upload_s": uploaded - started,
            "queued_s": prepare_start - created if prepare_start else None,
            "prepare_s": task_s("prepare"), "validate_plan_s": between(record.started_at, record.in_progress_at),
            "run_shard_s": task_s("run_shard"), "engine_s": record.engine_seconds,
            "finalize_s": task_s("finalize"), "merge_finalize_s": between(record.finalizing_at, record.completed_at),
            "hits": record.result_cache_hits, "wrong": wrong}


def check_output(client: Any, file_id: str | None, lines: int) -> str | None:
    """Why the output is not one 200 line per input line in input order; None when it is."""
    if not file_id:
        return "no output file"
    count = 0
    for count, line in enumerate(client.file_lines(file_id), 1):
        record = orjson.loads(line)
        if record.get("custom_id") != custom_id(count - 1):
            return f"output line {count} is {record.get('custom_id')}, not {custom_id(count - 1)}"
        if (record.get("response") or {}).get("status_code") != 200:
            return f"output line {count} is not a 200: {line[:300]!r}"
    return None if count == lines else f"{count} output lines for {lines} input lines"


# -- the table ------------------------------------------------------------------------------


def seconds(value: float | None, width: int = 8) -> str:
    return f"{value:{width}.1f}" if value is not None else f"{'-':>{width}}"


def report(args: argparse.Namespace, raw_run: dict[str, Any], stacks: dict[str, dict[str, Any]],
           loads: list[tuple[str, float]], size_mb: float, where: str) -> None:
    print(f"\n{args.lines:,} greedy /v1/completions lines ({size_mb:.1f} MB), max_tokens {args.max_tokens}, "
          f"{args.model}, one shard; storage: {where}; VLLM_CPU_KVCACHE_SPACE={os.environ['VLLM_CPU_KVCACHE_SPACE']}, "
          f"LLM_BATCH_ENFORCE_EAGER={os.environ['LLM_BATCH_ENFORCE_EAGER']}")
    print("load average (1 min): " + ", ".join(f"{name} {load:.1f}" for name, load in loads))
    raw_s, raw_no_load = raw_run.get("total_s"), raw_run.get("generate_s")
    if "why" in raw_run:
        print(f"raw: not measured: {raw_run['why']}")
    else:
        print(f"\n{'':32}{'seconds':>8}  stack/raw  stack / raw's generate alone")
        print(f"{'raw LLM.generate':32}{seconds(raw_s)}  (model load {raw_run['load_s']:.1f} s; "
              f"{raw_no_load:.1f} s without it)")
    rows = [("stack, cache off", "off", "first"), ("stack, cache on", "on", "first"),
            ("rerun wholly from the cache", "on", "rerun")]
    for label, cache, run in rows:
        if cache not in stacks:
            print(f"{label:32}{'-':>8}  (not run: --cache {args.cache})")
            continue
        job = stacks[cache].get(run) or {"why": "not run: the first job failed"}
        if "why" in job:
            print(f"{label:32}{'-':>8}  ({job['why']})")
            continue
        ratios = (f"{job['wall_s'] / raw_s:7.2f}x  {job['wall_s'] / raw_no_load:7.2f}x"
                  if raw_s and run == "first" else "")
        target = {("on", "first"): "  target <= 1.0x (100k, 1M)", ("on", "rerun"): "  target <= 15 s"}.get((cache, run), "")
        check = "" if job["wrong"] is None else f"  OUTPUT WRONG: {job['wrong']}"
        print(f"{label:32}{seconds(job['wall_s'])}  {ratios}{target}{check}")
    fills = [stacks.get(c, {}).get("first", {}).get("merge_finalize_s") for c in ("off", "on")]
    if None in fills:
        print(f"{'the fill':32}{'-':>8}  (needs --cache both and both first jobs)")
    else:
        print(f"{'the fill':32}{seconds(fills[1] - fills[0])}  (merge + finalize with the cache on minus off: "
              f"{fills[1]:.1f} - {fills[0]:.1f} s; target <= 10 s for 100k on the S3 server)")
    print(f"\n{'steps, s':28}  upload  queued  prepare (validate+plan)  run_shard (engine)  "
          "finalize (merge+finalize)  rest    wall  cached lines")
    for label, cache, run in rows:
        job = stacks.get(cache, {}).get(run)
        if not job or "why" in job:
            continue
        known = [job[k] for k in ("upload_s", "queued_s", "prepare_s", "run_shard_s", "finalize_s") if job[k]]
        print(f"{label:28}{seconds(job['upload_s'])}{seconds(job['queued_s'])}"
              f"{seconds(job['prepare_s'])} ({seconds(job['validate_plan_s'], 5)})"
              f"          {seconds(job['run_shard_s'])} ({seconds(job['engine_s'], 5)})"
              f"   {seconds(job['finalize_s'])} ({seconds(job['merge_finalize_s'], 5)})"
              f"       {seconds(job['wall_s'] - sum(known), 6)}{seconds(job['wall_s'])}  {job['hits']:,}")
    print("(run_shard -: no shard ran, every line came from the cache; rest: the create call, Airflow's "
          "scheduling between the tasks and the polling. Validate and plan, merge and finalize: one task "
          "each, with no timestamp between the two steps, so only their sums are measured.)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=100_000)
    parser.add_argument("--storage", choices=("local", "s3"), default="local")
    parser.add_argument("--cache", choices=("on", "off", "both"), default="both")
    parser.add_argument("--model", default="tiny-random-llama")
    parser.add_argument("--max-tokens", type=int, default=2)
    parser.add_argument("--raw-only", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("LLM_BATCH_ENFORCE_EAGER", "1")
    if args.raw_only:
        print(_RESULT + json.dumps(run_raw(args.raw_only, args.model, args.max_tokens)), flush=True)
        return

    from llm_batch.infra.model_cache import prepare_model

    model_cache = prepare_model(args.model).parent  # the shared cache (prepared once)
    os.environ["LLM_BATCH_MODEL_CACHE"] = str(model_cache)  # the raw side's too
    loads = [("at start", os.getloadavg()[0])]
    with ExitStack() as cleanup:
        folder = Path(tempfile.mkdtemp(prefix="llm-batch-scale-"))
        cleanup.callback(shutil.rmtree, folder, True)
        path = folder / "scale.jsonl"
        write_input(path, args.model, args.lines, args.max_tokens)
        size_mb = path.stat().st_size / 1e6
        print(f"{args.lines:,} lines, {size_mb:.1f} MB; raw LLM.generate ...", flush=True)
        raw_run = raw(path, args.model, args.max_tokens)
        loads.append(("after raw", os.getloadavg()[0]))
        s3_env, where = None, "local disk"
        if args.storage == "s3":
            server, s3_env = start_s3(folder / "s3", cleanup)
            where = f"SeaweedFS S3 server ({server.endpoint_url})"
        stacks = {}
        for cache in {"both": ("off", "on"), "on": ("on",), "off": ("off",)}[args.cache]:
            print(f"stack, cache {cache} ...", flush=True)
            try:
                stacks[cache] = stack_runs(model_cache, path, args, cache == "on", s3_env)
            except Exception as exc:  # noqa: BLE001 - reported in the table, the other parts still run
                stacks[cache] = {"first": {"why": f"the stack failed: {exc!r}"[:1500]}}
            loads.append((f"after the stack with cache {cache}", os.getloadavg()[0]))
        report(args, raw_run, stacks, loads, size_mb, where)


if __name__ == "__main__":
    main()
