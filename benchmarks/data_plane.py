"""Data-plane throughput and memory: validate, plan shards, fabricate results, merge.

    .venv/bin/python benchmarks/data_plane.py                # 100k and 1M lines
    .venv/bin/python benchmarks/data_plane.py --sizes 10000  # a quick look

Each size runs in a fresh subprocess (so peak RSS, ``ru_maxrss``, is that size's own) with
its own LLM_BATCH_HOME in a temporary directory. Steps, timed one by one:

- generate: write a synthetic chat batch (JSONL, 1 line in 100 invalid), streamed;
- validate: the real validation over that file (validated + validation errors);
- shard: ``plan_shards`` with N=8, balanced by count;
- results: fabricate a result per request without an engine (98 ok, 1 engine error, 1 never
  run in 100), through ``ResultsWriter`` as a worker would (not a target, shown for scale);
- merge: ``merge_job`` writing the OpenAI JSONL, the error file and the Scale JSON array.

Targets (issue 2): validate >= 100k lines/s on one core; peak RSS < 300 MB, and within
50 MB between 100k and 1M lines. Each step prints wall-clock lines/s and lines per CPU
second (``time.process_time``): on a shared machine the second is the one-core figure.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

NUM_SHARDS = 8
TARGET_VALIDATE_LINES_PER_S = 100_000
TARGET_PEAK_RSS_MB = 300
TARGET_RSS_GROWTH_MB = 50


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def generate(path: Path, lines: int) -> None:
    """A chat batch like users send: varied prompt lengths, 1 line in 100 invalid."""
    topics = ["the weather", "French cheese", "a sorting algorithm", "the history of Rome",
              "a haiku about rain", "unit tests", "the speed of light"]
    with path.open("wb", buffering=1 << 20) as out:
        for i in range(lines):
            if i % 100 == 57:
                out.write(b'{"custom_id": "bad-%d", "body": {"messages": []}}\n' % i)
                continue
            prompt = f"Tell me about {topics[i % len(topics)]}. " * (1 + i % 5)
            out.write(json.dumps({
                "custom_id": f"request-{i}", "method": "POST", "url": "/v1/chat/completions",
                "body": {"model": "bench", "max_tokens": 64, "temperature": 0.2,
                         "messages": [{"role": "system", "content": "You are helpful."},
                                      {"role": "user", "content": prompt}]},
            }).encode() + b"\n")


def validate(input_path: Path, layout) -> int:
    """The real validation: writes layout.validated and layout.validation_errors."""
    from llm_batch.pipeline.validation import validate_batch

    report = validate_batch(str(input_path), fmt="jsonl", endpoint="/v1/chat/completions",
                            layout=layout)
    return report.total


def fabricate_results(plans) -> int:
    """A result per request, in shard order, as a worker writes them (no engine)."""
    import orjson

    from llm_batch.core.records import RequestError, ResultRecord
    from llm_batch.infra import storage
    from llm_batch.infra.results import ResultsWriter
    from llm_batch.infra.storage import iter_lines

    written = 0
    for plan in plans:
        with (storage.open_read(plan.requests_uri) as stream,
              ResultsWriter.open(plan.results_uri) as writer):
            for line in iter_lines(stream):
                request = orjson.loads(line)
                index, custom_id = request["index"], request["custom_id"]
                if index % 100 == 99:
                    continue  # never run
                if index % 100 == 98:
                    record = ResultRecord(index=index, custom_id=custom_id, status_code=400,
                                          error=RequestError(code="context_length_exceeded",
                                                             message="prompt is too long"))
                else:
                    record = ResultRecord(index=index, custom_id=custom_id, status_code=200, body={
                        "id": f"chatcmpl-{index}", "object": "chat.completion", "created": 0,
                        "model": "bench",
                        "choices": [{"index": 0, "finish_reason": "stop", "message": {
                            "role": "assistant", "content": "A short answer."}}],
                        "usage": {"prompt_tokens": 20, "completion_tokens": 4, "total_tokens": 24},
                    })
                writer.write(record)
                written += 1
    return written


def run_one(lines: int) -> dict:
    """Every step for one size, in this process; returns the figures."""
    from llm_batch.core.config import get_settings
    from llm_batch.core.layout import JobLayout
    from llm_batch.pipeline.merge import merge_job
    from llm_batch.pipeline.sharding import plan_shards

    layout = JobLayout(get_settings().work_uri, "bench")
    input_path = get_settings().home / "input.jsonl"
    figures: dict = {"lines": lines, "steps": {}}

    def step(name: str, fn: Callable[[], object], count: int) -> object:
        started, cpu_started = time.perf_counter(), time.process_time()
        out = fn()
        seconds = time.perf_counter() - started
        cpu_seconds = time.process_time() - cpu_started
        figures["steps"][name] = {"seconds": round(seconds, 2),
                                  "lines_per_s": round(count / seconds),
                                  "cpu_lines_per_s": round(count / max(cpu_seconds, 1e-9)),
                                  "peak_rss_mb": round(peak_rss_mb(), 1)}
        return out

    input_path.parent.mkdir(parents=True, exist_ok=True)
    step("generate", lambda: generate(input_path, lines), lines)
    figures["input_mb"] = round(input_path.stat().st_size / 1e6, 1)
    step("validate", lambda: validate(input_path, layout), lines)
    plans = step("shard", lambda: plan_shards(layout, NUM_SHARDS), lines)
    step("results", lambda: fabricate_results(plans), lines)
    counts = step("merge", lambda: merge_job(layout, json_array=True), lines)
    figures["counts"] = counts.__dict__
    figures["peak_rss_mb"] = round(peak_rss_mb(), 1)
    return figures


def run_in_subprocess(lines: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="llm-batch-bench-") as home:
        env = {**os.environ, "LLM_BATCH_HOME": home}
        out = subprocess.run([sys.executable, __file__, "--one", str(lines)], env=env,
                             check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def report(results: list[dict]) -> None:
    print(f"{'lines':>10} {'step':>9} {'seconds':>8} {'lines/s':>10} {'lines/cpu-s':>12}"
          f" {'peak RSS MB':>12}")
    for figures in results:
        for name, s in figures["steps"].items():
            print(f"{figures['lines']:>10,} {name:>9} {s['seconds']:>8} {s['lines_per_s']:>10,}"
                  f" {s['cpu_lines_per_s']:>12,} {s['peak_rss_mb']:>12}")
        print(f"{'':>10} counts {figures['counts']}, input {figures['input_mb']} MB")
    # One core's rate: CPU time, which a machine shared with other work does not inflate.
    validate_rates = [f["steps"]["validate"]["cpu_lines_per_s"] for f in results]
    peaks = [f["peak_rss_mb"] for f in results]
    print(f"validate >= {TARGET_VALIDATE_LINES_PER_S:,} lines/s: "
          f"{'met' if min(validate_rates) >= TARGET_VALIDATE_LINES_PER_S else 'NOT met'} "
          f"({min(validate_rates):,} lines per CPU second at worst; wall-clock rates above)")
    print(f"peak RSS < {TARGET_PEAK_RSS_MB} MB: {'met' if max(peaks) < TARGET_PEAK_RSS_MB else 'NOT met'}"
          f" ({max(peaks)} MB at most)")
    if len(peaks) > 1:
        growth = max(peaks) - min(peaks)
        print(f"peak RSS growth <= {TARGET_RSS_GROWTH_MB} MB across sizes: "
              f"{'met' if growth <= TARGET_RSS_GROWTH_MB else 'NOT met'} ({growth:.1f} MB)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # the per-size subprocess
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one)))
        return
    report([run_in_subprocess(n) for n in args.sizes])


if __name__ == "__main__":
    main()
