"""LoRA adapters: one job mixing the base model and four adapters, against one job per model.

    .venv/bin/python benchmarks/lora.py [--requests 256] [--base-share 0.5] [--tokens 32] [--repeat 1] [--dry-run]

``--requests`` chat requests (deterministic prompts, greedy, exactly ``--tokens`` generated
tokens each: ``max_tokens`` = ``min_tokens``) to smollm2-135m-instruct: ``--base-share`` of the
lines on the base model, the others on the adapters ``ADAPTERS`` in turn (the registry's random
LoRAs smollm2-lora-a/b/c at rank 8, -d at rank 16; body.model names it), base and adapter lines
interleaved. Each job is validated into a job folder as validation writes it and planned by the
pipeline's own planner with one shard asked (``plan_shards``); each of its shards is run by one
``llm-batch worker`` process, one after another (a one-slot machine), then merged:

- **base**: a job of exactly the mixed job's base lines (the same prompts and ids, a file of their own);
- **mixed**: one job of every line; the planner gives its base lines a shard of their own (an
  engine without LoRA) and its adapter lines another (one engine, LoRA on for all four);
- **per model**: one job per model: the base job above and one job of each adapter's lines.

Each round runs mixed (its adapter shard, then its base shard), base, then the four adapter
jobs: the base job right after the mixed job's base shard, so the two compared run under the
same load of a shared machine. ``--repeat`` rounds, medians shown.
Every run is checked on the merged output: one successful line per request, in input order,
``body.model`` naming the adapter the line ran on (or the base). Printed per case: wall time
(worker start to exit, engine start included, summed over the job's shards and jobs), generated
tokens, tokens/s over the wall and over the engine loop (``engine_seconds`` of the shards'
progress objects), the time outside the engine loop; then per shard of the mixed job; then the
targets beside their figures: mixed / per model wall <= 0.6, and the mixed job's base lines /
the base job, engine-loop seconds, <= 1.3 (base lines beside adapter lines at the base's speed).
``--dry-run`` plans the jobs and prints their shards, without an engine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

MODEL = "smollm2-135m-instruct"
ADAPTERS = ["smollm2-lora-a", "smollm2-lora-b", "smollm2-lora-c", "smollm2-lora-d"]
ENDPOINT = "/v1/chat/completions"
TOPICS = ["the sea", "bread", "a bicycle", "winter", "a library", "rivers", "chess", "the moon",
          "tea", "volcanoes", "trains", "bees", "glass", "a lighthouse", "maps", "clocks"]


# -- the jobs ---------------------------------------------------------------------------------

def request(i: int, adapter: str | None, tokens: int) -> dict:
    """Request ``i`` of the batch (input line i + 1) on ``adapter`` (None: the base model)."""
    body = {"messages": [{"role": "user", "content": f"Write a few sentences about {TOPICS[i % len(TOPICS)]} "
                                                     f"(note {i})."}],
            "max_tokens": tokens, "min_tokens": tokens, "temperature": 0}
    if adapter:
        body["model"] = adapter
    return {"index": i, "line": i + 1, "custom_id": f"c{i}", "body": body, "adapter": adapter}


def line_models(n: int, base_share: float) -> list[str | None]:
    """Each line's model: ``base_share`` of them the base (None), spread evenly; the others the
    adapters in turn."""
    models: list[str | None] = []
    for i in range(n):
        on_base = int((i + 1) * base_share) > int(i * base_share)
        models.append(None if on_base else ADAPTERS[(i - int((i + 1) * base_share)) % len(ADAPTERS)])
    return models


def alone(lines: list[dict]) -> list[dict]:
    """``lines`` (the same prompts and ids) as a job of their own: input lines 1..n."""
    return [{**line, "index": k, "line": k + 1} for k, line in enumerate(lines)]


def write_job(work: str, lines: list[dict]):
    """A job of ``lines`` under ``work``: its validated file as validation writes it (the lines'
    input indexes and custom ids kept), planned as the pipeline plans it, one shard asked."""
    from llm_batch.core.layout import JobLayout
    from llm_batch.core.records import BatchRequest, dumps_line
    from llm_batch.infra import storage
    from llm_batch.pipeline.sharding import plan_shards

    layout = JobLayout(work, f"bench-{uuid.uuid4().hex[:8]}")
    storage.write_bytes(layout.validated, b"".join(dumps_line(BatchRequest(**line)) for line in lines))
    storage.write_bytes(layout.validation_errors, b"")
    plan_shards(layout, 1, prefix_aware=False)
    return layout


def engine_env(home: Path, cache: Path) -> dict[str, str]:
    return {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "LLM_BATCH_ENFORCE_EAGER": "1",
            "LLM_BATCH_HOME": str(home), "LLM_BATCH_MODEL_CACHE": str(cache),
            "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}


def run_shard(layout, plan, env: dict[str, str], logs: Path) -> dict:
    """One worker process on one shard of the job: timed."""
    from llm_batch.infra.progress import read_progress

    cmd = [sys.executable, "-m", "llm_batch.cli.main", "worker", "--job-id", layout.job_id, "--shard", str(plan.index),
           "--work-uri", layout.work_uri, "--endpoint", ENDPOINT, "--model-config", json.dumps({"model": MODEL})]
    log = logs / f"{layout.job_id}-{plan.index}.log"
    start = time.monotonic()
    with log.open("wb") as out:
        code = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT).wait()
    wall = time.monotonic() - start
    if code != 0:
        raise SystemExit(f"{layout.job_id} shard {plan.index}: worker exited {code}; see {log}")
    return {"wall": wall, "engine_s": read_progress(plan.progress_uri).engine_seconds, "requests": plan.count,
            "adapters": plan.adapters}


def run_job(lines: list[dict], env: dict[str, str], work: str, logs: Path) -> dict:
    """A job of ``lines``: planned, each shard run, merged, then checked."""
    from llm_batch.infra import storage
    from llm_batch.pipeline.merge import merge_job
    from llm_batch.pipeline.sharding import read_manifest

    layout = write_job(work, lines)
    # The base shards last: right before the base job, which the mixed case runs next.
    plans = sorted(read_manifest(layout).shards, key=lambda plan: not plan.adapters)
    shards = [run_shard(layout, plan, env, logs) for plan in plans]
    merge_job(layout, jsonl=True)
    outputs = [json.loads(line) for line in storage.read_bytes(layout.output_jsonl).splitlines()]
    if [o["custom_id"] for o in outputs] != [x["custom_id"] for x in lines]:
        raise SystemExit(f"{layout.job_id}: outputs {[o['custom_id'] for o in outputs][:10]}..., expected every "
                         f"line once, in input order; see {logs}")
    for output, line in zip(outputs, lines):
        expected = line["adapter"] or MODEL
        if output["response"]["body"]["model"] != expected:
            raise SystemExit(f"{layout.job_id}: line {line['index']} ({line['custom_id']}) answered by "
                             f"{output['response']['body']['model']!r}, expected {expected!r}")
    base = [s for s in shards if not s["adapters"]]
    return {"wall": sum(s["wall"] for s in shards), "engine_s": sum(s["engine_s"] for s in shards),
            "requests": len(lines), "jobs": 1, "shards": shards,
            "generated": sum(o["response"]["body"]["usage"]["completion_tokens"] for o in outputs),
            "base_engine_s": sum(s["engine_s"] for s in base), "base_wall": sum(s["wall"] for s in base)}


def per_model(base: dict, lines: list[dict], env: dict[str, str], work: str, logs: Path) -> dict:
    """One job per model, one after another: the base job's run and one job per adapter; walls,
    tokens and engine loops add up."""
    runs = [base] + [run_job(alone([x for x in lines if x["adapter"] == a]), env, work, logs) for a in ADAPTERS]
    return {"wall": sum(r["wall"] for r in runs), "requests": sum(r["requests"] for r in runs),
            "engine_s": sum(r["engine_s"] for r in runs), "generated": sum(r["generated"] for r in runs),
            "jobs": len(runs), "each": [round(r["wall"], 1) for r in runs]}


# -- the report -------------------------------------------------------------------------------

def median_row(runs: list[dict]) -> dict:
    """Median wall and engine seconds; the rest from the middle run (greedy with min_tokens: the
    tokens are the same every run)."""
    middle = sorted(runs, key=lambda r: r["wall"])[len(runs) // 2]
    medians = {key: statistics.median(r[key] for r in runs)
               for key in ("wall", "engine_s", "base_engine_s", "base_wall") if key in middle}
    return {**middle, **medians, "walls": [r["wall"] for r in runs]}


def show(rows: dict[str, dict]) -> None:
    print(f"{'case':9} {'jobs':>4} {'requests':>8} {'wall s':>7} {'gen tokens':>10} {'gen/s wall':>10} "
          f"{'engine s':>8} {'gen/s engine':>12} {'outside s':>9}  runs s")
    for name, r in rows.items():
        runs = " ".join(f"{w:.1f}" for w in r["walls"])
        print(f"{name:9} {r['jobs']:>4} {r['requests']:>8} {r['wall']:7.1f} {r['generated']:>10} "
              f"{r['generated'] / r['wall']:10.1f} {r['engine_s']:8.1f} {r['generated'] / r['engine_s']:12.1f} "
              f"{r['wall'] - r['engine_s']:9.1f}  {runs}" + (f"  (the middle run's jobs {r['each']})" if "each" in r else ""))
    print("the mixed job's shards (the middle run), one after another:")
    for shard in rows["mixed"]["shards"]:
        print(f"  {', '.join(shard['adapters']) or MODEL + ' (no LoRA)'}: {shard['requests']} requests, "
              f"wall {shard['wall']:.1f} s, engine loop {shard['engine_s']:.1f} s")


def targets(rows: dict[str, dict]) -> None:
    mixed, separate, base = rows["mixed"], rows["per model"], rows["base"]
    for text, value, target in (
            ("mixed / per model wall", mixed["wall"] / separate["wall"], 0.6),
            ("mixed job's base lines / base-only job, engine loop", mixed["base_engine_s"] / base["engine_s"], 1.3)):
        print(f"{text}: {value:.3f}  (target <= {target}: {'PASS' if value <= target else 'MISS'})")
    # Information: the same with engine start included (each a worker process of its own).
    print(f"mixed job's base lines / base-only job, wall: {mixed['base_wall'] / base['wall']:.3f}  (information)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--base-share", type=float, default=0.5, help="the share of lines on the base model")
    parser.add_argument("--tokens", type=int, default=32, help="generated tokens per request (max = min)")
    parser.add_argument("--repeat", type=int, default=1, help="rounds (mixed, base, per model each); medians shown")
    parser.add_argument("--dry-run", action="store_true", help="plan the jobs only (no engine)")
    parser.add_argument("--model-cache", type=Path,
                        default=Path(os.environ.get("LLM_BATCH_MODEL_CACHE", Path.home() / ".llm-batch/models")))
    args = parser.parse_args()
    if not 0 < args.base_share < 1:
        parser.error("--base-share must be between 0 and 1 (both kinds of line)")

    with tempfile.TemporaryDirectory(prefix="llm-batch-lora-bench-") as tmp:
        logs, home = Path(tmp), Path(tmp) / "home"
        work = str(home / "work")  # under LLM_BATCH_HOME: the worker's default work prefix
        (home / "data").mkdir(parents=True)
        env = engine_env(home, args.model_cache)
        # This process plans, merges and reads the workers' progress: the same home, the same roots.
        os.environ.update({k: env[k] for k in ("LLM_BATCH_HOME", "LLM_BATCH_MODEL_CACHE")})
        from llm_batch.core.config import Settings
        from llm_batch.infra.adapters import prepare_adapter
        from llm_batch.pipeline.sharding import read_manifest

        settings = Settings(home=home, model_cache=args.model_cache)
        if not args.dry_run:
            for name in ADAPTERS:  # builds the base model first if needed
                prepare_adapter(name, settings=settings)
        mixed = [request(i, model, args.tokens) for i, model in enumerate(line_models(args.requests, args.base_share))]
        base = alone([x for x in mixed if x["adapter"] is None])
        print(f"{len(mixed)} chat requests, {MODEL}, greedy, {args.tokens} tokens each: {len(base)} on the base, "
              f"{len(mixed) - len(base)} on adapters {', '.join(ADAPTERS)}, interleaved; load average "
              f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores at start")
        if args.dry_run:
            for name, lines in [("mixed", mixed), ("base", base)] + [
                    (a, alone([x for x in mixed if x["adapter"] == a])) for a in ADAPTERS]:
                shards = read_manifest(write_job(work, lines)).shards
                print(f"  job {name}: {len(lines)} lines, shards " + ", ".join(
                    f"{p.index}: {p.count} on {', '.join(p.adapters) or MODEL}" for p in shards))
            return

        runs: dict[str, list[dict]] = {"base": [], "mixed": [], "per model": []}
        for _ in range(args.repeat):
            for case in ("mixed", "base", "per model"):  # the two base runs compared, back to back
                started = time.strftime("%H:%M:%S", time.gmtime())
                if case == "per model":
                    run = per_model(runs["base"][-1], mixed, env, work, logs)
                else:
                    run = run_job(mixed if case == "mixed" else base, env, work, logs)
                runs[case].append(run)
                print(f"  [{started} UTC, load {os.getloadavg()[0]:.1f}] {case}: {run['wall']:.1f} s", flush=True)
        rows = {case: median_row(r) for case, r in runs.items()}
        print()
        show(rows)
        print()
        targets(rows)
        print(f"load average at the end {os.getloadavg()[0]:.1f} (1 min) {os.getloadavg()[1]:.1f} (5 min)")


if __name__ == "__main__":
    main()
