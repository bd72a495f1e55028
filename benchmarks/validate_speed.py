"""Lines per second of ``validate_batch`` on a synthetic, realistic chat batch (one core).

    .venv/bin/python benchmarks/validate_speed.py [--lines 200000] [--invalid-every 0]

The batch: short system + user messages with max_tokens (and a temperature on some lines),
written to a temporary JSONL file; validation reads it and writes the validated and error
files to temporary files too, as the DAG's validate task does. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
import time
from pathlib import Path

import orjson

from llm_batch.pipeline.validation import ValidationLimits, validate_batch

QUESTIONS = [
    "What is the capital of France?",
    "Summarise the plot of Hamlet in two sentences.",
    "Translate 'good morning' into Spanish.",
    "Give three tips for writing clear commit messages.",
    "Why is the sky blue? Answer briefly.",
]


def synthetic_line(i: int) -> bytes:
    body: dict = {
        "messages": [
            {"role": "system", "content": "You are a concise, helpful assistant."},
            {"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} (request {i})"},
        ],
        "max_tokens": 64 + i % 64,
    }
    if i % 3 == 0:
        body["temperature"] = 0.7
    return orjson.dumps({"custom_id": f"request-{i:07d}", "method": "POST",
                         "url": "/v1/chat/completions", "body": body}) + b"\n"


def write_batch(path: Path, lines: int, invalid_every: int) -> None:
    with path.open("wb") as out:
        for i in range(lines):
            if invalid_every and i % invalid_every == invalid_every - 1:
                out.write(b'{"custom_id": "broken-%d", "body": {"messages": []}}\n' % i)
            else:
                out.write(synthetic_line(i))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=200_000)
    parser.add_argument("--invalid-every", type=int, default=0,
                        help="make every Nth line invalid (0: none)")
    args = parser.parse_args()
    limits = ValidationLimits(max_requests=10**8, max_input_bytes=2**40, max_line_bytes=2**20,
                              max_reported_errors=100)
    with tempfile.TemporaryDirectory() as tmp:
        batch = Path(tmp) / "batch.jsonl"
        write_batch(batch, args.lines, args.invalid_every)
        with batch.open("rb") as source, open(Path(tmp) / "validated.jsonl", "wb") as valid, \
                open(Path(tmp) / "errors.jsonl", "wb") as errors:
            cpu0, wall0 = time.process_time(), time.perf_counter()
            report = validate_batch(source, fmt="jsonl", endpoint="/v1/chat/completions",
                                    limits=limits, validated_out=valid, errors_out=errors)
            cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        size = batch.stat().st_size
    print(json.dumps({
        "lines": report.total,
        "valid": report.valid,
        "invalid": report.invalid,
        "input_mib": round(size / 2**20, 1),
        "wall_s": round(wall, 2),
        "cpu_s": round(cpu, 2),
        "lines_per_s_wall": round(report.total / wall),
        "lines_per_s_cpu": round(report.total / cpu),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "load_average_1m": round(os.getloadavg()[0], 2),
    }))


if __name__ == "__main__":
    main()
