"""LoRA adapters: one job mixing four adapters against one job per adapter, and against the base.

    .venv/bin/python benchmarks/lora.py [--requests 256] [--tokens 32] [--repeat 1] [--dry-run]

``--requests`` chat requests (deterministic prompts, greedy, exactly ``--tokens`` generated
tokens each: ``max_tokens`` = ``min_tokens``) to smollm2-135m-instruct, line i on adapter
``ADAPTERS[i % 4]`` (the registry's random LoRAs smollm2-lora-a/b/c at rank 8, -d at rank 16;
body.model names it). Each job is one shard run by one ``llm-batch worker`` process, as the
pipeline runs it:

- **base**: the same prompts with no adapter (the LoRA overhead's reference);
- **mixed**: one job of every line, the adapters interleaved (one engine, LoRA on for all four);
- **4 jobs**: four jobs of one adapter each, run one after another (a one-slot machine).

Each round runs base, mixed, 4 jobs in that order; ``--repeat`` rounds, medians shown. Every
run is checked: one successful result per line, in input order, ``body.model`` naming the
adapter the line ran on (or the base). Printed per case: wall time (worker start to exit,
engine start included, as a job pays it; for 4 jobs the sum of the four), generated tokens,
tokens/s over the wall and over the engine loop (``engine_seconds`` of the progress object),
and the time outside the engine loop (import, model load, engine start, exit); then the
issue's targets beside their figures: mixed / 4 jobs wall <= 0.6, mixed / base wall <= 1.3.
``--dry-run`` writes the shards and prints their sizes and adapters, without an engine.
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
    """Request ``i`` of the batch on ``adapter`` (None: the base model)."""
    body = {"messages": [{"role": "user", "content": f"Write a few sentences about {TOPICS[i % len(TOPICS)]} "
                                                     f"(note {i})."}],
            "max_tokens": tokens, "min_tokens": tokens, "temperature": 0}
    if adapter:
        body["model"] = adapter
    return {"custom_id": f"c{i}", "body": body, "adapter": adapter}


def write_job(work: str, lines: list[dict]) -> str:
    """A one-shard job of ``lines`` under ``work`` (what validation and planning would write)."""
    from llm_batch.core.layout import JobLayout
    from llm_batch.core.records import BatchRequest, dumps_line

    job = f"bench-{uuid.uuid4().hex[:8]}"
    path = Path(JobLayout(work, job).shard(0).requests)
    path.parent.mkdir(parents=True)
    with path.open("wb") as f:
        for index, line in enumerate(lines):
            f.write(dumps_line(BatchRequest(index=index, line=index + 1, **line)))
    return job


def engine_env(home: Path, cache: Path) -> dict[str, str]:
    return {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "LLM_BATCH_ENFORCE_EAGER": "1",
            "LLM_BATCH_HOME": str(home), "LLM_BATCH_MODEL_CACHE": str(cache),
            "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}


def run_job(lines: list[dict], env: dict[str, str], work: str, logs: Path) -> dict:
    """One worker process on a one-shard job of ``lines``: timed, then checked."""
    from llm_batch.core.layout import JobLayout
    from llm_batch.infra.progress import read_progress
    from llm_batch.infra.results import read_results

    job = write_job(work, lines)
    shard = JobLayout(work, job).shard(0)
    cmd = [sys.executable, "-m", "llm_batch.cli.main", "worker", "--job-id", job, "--shard", "0",
           "--work-uri", work, "--endpoint", ENDPOINT, "--model-config", json.dumps({"model": MODEL})]
    log = logs / f"{job}.log"
    start = time.monotonic()
    with log.open("wb") as out:
        code = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT).wait()
    wall = time.monotonic() - start
    if code != 0:
        raise SystemExit(f"{job}: worker exited {code}; see {log}")
    results = list(read_results(shard.results))
    if [r.index for r in results] != list(range(len(lines))):
        raise SystemExit(f"{job}: results for indexes {[r.index for r in results][:10]}..., "
                         f"expected 0..{len(lines) - 1} in order; see {log}")
    for result, line in zip(results, lines):
        expected = line["adapter"] or MODEL
        if not result.ok:
            raise SystemExit(f"{job}: line {result.index} failed: {result.error}; see {log}")
        if result.custom_id != line["custom_id"] or result.body["model"] != expected:
            raise SystemExit(f"{job}: line {result.index} ({result.custom_id}) answered by "
                             f"{result.body['model']!r}, expected {expected!r} ({line['custom_id']})")
    progress = read_progress(shard.progress)
    return {"wall": wall, "requests": len(lines), "engine_s": progress.engine_seconds,
            "generated": sum(r.body["usage"]["completion_tokens"] for r in results)}


def run_case(case: str, lines: list[dict], env: dict[str, str], work: str, logs: Path) -> dict:
    if case != "4 jobs":
        return {**run_job(lines, env, work, logs), "jobs": 1}
    # One job per adapter, one after another: walls, tokens and engine loops add up.
    runs = [run_job([x for x in lines if x["adapter"] == a], env, work, logs) for a in ADAPTERS]
    return {"wall": sum(r["wall"] for r in runs), "requests": sum(r["requests"] for r in runs),
            "engine_s": sum(r["engine_s"] for r in runs), "generated": sum(r["generated"] for r in runs),
            "jobs": len(runs), "each": [round(r["wall"], 1) for r in runs]}


# -- the report -------------------------------------------------------------------------------

def median_row(runs: list[dict]) -> dict:
    """Median wall and engine seconds; the rest from the middle run (greedy with min_tokens: the
    tokens are the same every run)."""
    middle = sorted(runs, key=lambda r: r["wall"])[len(runs) // 2]
    return {**middle, "wall": statistics.median(r["wall"] for r in runs),
            "engine_s": statistics.median(r["engine_s"] for r in runs), "walls": [r["wall"] for r in runs]}


def show(rows: dict[str, dict]) -> None:
    print(f"{'case':8} {'jobs':>4} {'requests':>8} {'wall s':>7} {'gen tokens':>10} {'gen/s wall':>10} "
          f"{'engine s':>8} {'gen/s engine':>12} {'outside s':>9}  runs s")
    for name, r in rows.items():
        runs = " ".join(f"{w:.1f}" for w in r["walls"])
        print(f"{name:8} {r['jobs']:>4} {r['requests']:>8} {r['wall']:7.1f} {r['generated']:>10} "
              f"{r['generated'] / r['wall']:10.1f} {r['engine_s']:8.1f} {r['generated'] / r['engine_s']:12.1f} "
              f"{r['wall'] - r['engine_s']:9.1f}  {runs}" + (f"  (the middle run's jobs {r['each']})" if "each" in r else ""))


def targets(rows: dict[str, dict]) -> None:
    mixed, four, base = rows["mixed"], rows["4 jobs"], rows["base"]
    for text, value, target in (("mixed / 4 jobs wall", mixed["wall"] / four["wall"], 0.6),
                                ("mixed / base wall", mixed["wall"] / base["wall"], 1.3)):
        print(f"{text}: {value:.3f}  (target <= {target}: {'PASS' if value <= target else 'MISS'})")
    # Information: the LoRA overhead inside the engine loop, engine start left out.
    print(f"mixed / base engine loop: {mixed['engine_s'] / base['engine_s']:.3f}  (information)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=32, help="generated tokens per request (max = min)")
    parser.add_argument("--repeat", type=int, default=1, help="rounds (base, mixed, 4 jobs each); medians shown")
    parser.add_argument("--dry-run", action="store_true", help="write the shards only (no engine)")
    parser.add_argument("--model-cache", type=Path,
                        default=Path(os.environ.get("LLM_BATCH_MODEL_CACHE", Path.home() / ".llm-batch/models")))
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="llm-batch-lora-bench-") as tmp:
        logs, home = Path(tmp), Path(tmp) / "home"
        work = str(home / "work")  # under LLM_BATCH_HOME: the worker's default work prefix
        (home / "data").mkdir(parents=True)
        env = engine_env(home, args.model_cache)
        # This process reads the workers' results and progress: the same home, the same roots.
        os.environ.update({k: env[k] for k in ("LLM_BATCH_HOME", "LLM_BATCH_MODEL_CACHE")})
        from llm_batch.core.config import Settings
        from llm_batch.infra.adapters import prepare_adapter

        settings = Settings(home=home, model_cache=args.model_cache)
        for name in ADAPTERS:  # builds the base model first if needed
            prepare_adapter(name, settings=settings)
        n = args.requests
        cases = {"base": [request(i, None, args.tokens) for i in range(n)],
                 "mixed": [request(i, ADAPTERS[i % len(ADAPTERS)], args.tokens) for i in range(n)]}
        cases["4 jobs"] = cases["mixed"]
        print(f"{n} chat requests, {MODEL}, greedy, {args.tokens} tokens each; adapters {', '.join(ADAPTERS)} "
              f"interleaved; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores at start")
        if args.dry_run:
            for adapter in [None, *ADAPTERS]:
                lines = [x for x in cases["mixed" if adapter else "base"] if x["adapter"] == adapter]
                print(f"  job on {adapter or MODEL}: {len(lines)} lines, shard {write_job(work, lines)}")
            return

        runs: dict[str, list[dict]] = {case: [] for case in cases}
        for _ in range(args.repeat):
            for case, lines in cases.items():
                started = time.strftime("%H:%M:%S", time.gmtime())
                runs[case].append(run_case(case, lines, env, work, logs))
                print(f"  [{started} UTC, load {os.getloadavg()[0]:.1f}] {case}: {runs[case][-1]['wall']:.1f} s",
                      flush=True)
        rows = {case: median_row(r) for case, r in runs.items()}
        print()
        show(rows)
        print()
        targets(rows)
        print(f"load average at the end {os.getloadavg()[0]:.1f} (1 min) {os.getloadavg()[1]:.1f} (5 min)")


if __name__ == "__main__":
    main()
