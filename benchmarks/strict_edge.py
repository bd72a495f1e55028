"""What the strict JSON edge costs: ``strict_json.check`` beside the parse FastAPI does anyway.

    .venv/bin/python benchmarks/strict_edge.py [--repeat 5]

Bodies as the API receives them: a small create (one inline request, a model_config with
engine_args), and inline batches of 1,000 and 100,000 chat requests (Mistral's
``requests``; the largest is ~33 MB, half the 64 MiB body limit). Printed per body: its
size, the median time of Python's ``json.loads`` (FastAPI's own parse, paid with or without
the edge) and of ``strict_json.check`` (orjson's parse plus the depth walk), side by side in
one run, and their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import orjson

from llm_batch.core import strict_json


def body(requests: int) -> bytes:
    return orjson.dumps({
        "model": "smollm2-135m-instruct", "endpoint": "/v1/chat/completions",
        "model_config": {"max_model_len": 2048, "engine_args": {"max_num_seqs": 32, "enable_prefix_caching": True}},
        "metadata": {"team": "search", "run": "nightly"},
        "requests": [{"custom_id": f"req-{i}", "body": {
            "messages": [{"role": "system", "content": "You are terse."},
                         {"role": "user", "content": f"Summarise document {i}: " + "lorem ipsum " * 20}],
            "max_tokens": 64, "temperature": 0.2}} for i in range(requests)],
    })


def median_seconds(call, data: bytes, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        call(data)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    print(f"{'body':>22} {'bytes':>12} {'json.loads ms':>14} {'strict check ms':>16} {'ratio':>6}")
    for label, requests in (("small create (1 req)", 1), ("1,000 inline", 1_000), ("100,000 inline", 100_000)):
        data = body(requests)
        plain = median_seconds(json.loads, data, args.repeat)
        strict = median_seconds(strict_json.check, data, args.repeat)
        print(f"{label:>22} {len(data):>12,} {plain * 1e3:>14.2f} {strict * 1e3:>16.2f} {strict / plain:>6.2f}")


if __name__ == "__main__":
    main()
