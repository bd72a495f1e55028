"""End to end: the full stack vs vLLM's ``LLM.chat`` directly, on the same chat requests.

    .venv/bin/python benchmarks/e2e.py [--requests 512] [--max-tokens 64] [--model NAME]

1. Direct, twice: a subprocess builds ``vllm.LLM`` with the model registry's engine
   arguments, once as vLLM ships it (engine core in its own process) and once placed as the
   worker places it (``llm_batch.runtime.engine.runner.start_engine``: in the process on CPU), and
   runs ``LLM.chat`` over all requests; its time runs from the process's start (imports and
   model load count, as they do in the pipeline's worker) to the last output.
2. Pipeline: a fresh embedded stack (temporary LLM_BATCH_HOME, free port, the model cache
   shared) takes the same requests through the REST API (upload + Mistral job, one shard);
   its time runs from the submit call to the job's end, so it counts the model load in
   the shard worker too, plus validation, planning, merge and Airflow's scheduling.

Prints: submit-to-first-shard-start latency (the shard task's start in Airflow), end-to-end
time, generated tokens/s and the ratios against each direct run, and the targets (pipeline
extra wall time < 20 s, throughput >= 0.85 of direct). Both sides run with the same engine settings
(VLLM_CPU_KVCACHE_SPACE, LLM_BATCH_ENFORCE_EAGER from the environment, eager by default).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

QUESTIONS = [
    "What is the capital of {}?", "Name a famous dish from {}.", "Describe the climate of {}.",
    "Which language is spoken in {}?", "Give one fact about the history of {}.",
    "What is a popular sport in {}?", "Name a river or lake in {}.", "What currency does {} use?",
]
PLACES = [
    "France", "Japan", "Brazil", "Kenya", "Canada", "India", "Norway", "Peru", "Egypt", "Vietnam",
    "Spain", "Mexico", "Chile", "Ghana", "Italy", "Nepal", "Poland", "Turkey", "Cuba", "Iceland",
    "Morocco", "Greece", "Sweden", "Thailand", "Argentina", "Portugal", "Ireland", "Finland",
    "Austria", "Mongolia", "Jordan", "Colombia", "Ethiopia", "Indonesia", "Scotland", "Wales",
    "Germany", "Australia", "Korea", "Hungary", "Croatia", "Senegal", "Bolivia", "Denmark",
    "Belgium", "Malaysia", "Uruguay", "Tunisia", "Latvia", "Georgia", "Laos", "Panama",
    "Rwanda", "Oman", "Qatar", "Fiji", "Malta", "Cyprus", "Estonia", "Bhutan", "Samoa", "Chad",
    "Niger", "Togo",
]


def requests(count: int) -> list[list[dict[str, str]]]:
    prompts = [q.format(p) for p in PLACES for q in QUESTIONS]
    return [[{"role": "user", "content": prompts[i % len(prompts)]}] for i in range(count)]


def write_batch(path: Path, model: str, count: int, max_tokens: int) -> None:
    with path.open("w") as out:
        for i, messages in enumerate(requests(count)):
            body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
            out.write(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                                  "body": body}) + "\n")


# -- direct ---------------------------------------------------------------------------------

_RESULT = "E2E-BENCH-RESULT "


def run_direct(model: str, count: int, max_tokens: int, placed_as_worker: bool) -> dict[str, float]:
    """In this process (a subprocess of the benchmark): imports + load + LLM.chat, timed from
    the process's start (the pipeline's worker pays the same imports) to the last output."""
    import psutil

    started = psutil.Process().create_time()
    from vllm import SamplingParams

    from llm_batch.infra.model_resolution import resolve_model
    from llm_batch.runtime.engine.runner import start_engine

    resolved = resolve_model({"model": model})
    load_started = time.time()
    # Placed as the worker places it (in this process on CPU), or vLLM's own layout.
    llm = start_engine(resolved, in_process=None if placed_as_worker else False)
    loaded = time.time()
    outputs = llm.chat(requests(count), SamplingParams(max_tokens=max_tokens, temperature=0),
                       use_tqdm=False)
    ended = time.time()
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"load_s": loaded - load_started, "total_s": ended - started, "tokens": tokens}


def direct(model: str, count: int, max_tokens: int, placed_as_worker: bool) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, __file__, "--direct-only", "--model", model, "--requests", str(count),
         "--max-tokens", str(max_tokens), *(["--placed-as-worker"] if placed_as_worker else [])],
        check=True, capture_output=True, text=True,
    )
    # vLLM logs to stdout too: the result is the line with the marker.
    return json.loads(next(line for line in out.stdout.splitlines() if line.startswith(_RESULT))[len(_RESULT):])


# -- pipeline -------------------------------------------------------------------------------


def pipeline(model: str, count: int, max_tokens: int, model_cache: Path) -> dict[str, float]:
    import httpx

    home = Path(tempfile.mkdtemp(prefix="llm-batch-bench-"))
    os.environ["LLM_BATCH_HOME"] = str(home)
    os.environ["LLM_BATCH_MODEL_CACHE"] = str(model_cache)
    from llm_batch.core.config import get_settings
    from llm_batch.devstack.stack import Stack, free_port
    from llm_batch.infra.api_client import BatchClient

    get_settings.cache_clear()
    stack = Stack.create(get_settings(), free_port())
    batch = home / "bench.jsonl"
    write_batch(batch, model, count, max_tokens)
    try:
        stack.up(timeout=300)
        with BatchClient(f"{stack.base_url}/batch", stack.ensure_api_key()) as client:
            submitted_wall, submitted = time.time(), time.monotonic()
            job = client.submit(batch, endpoint="/v1/chat/completions", model=model)
            job = client.wait(job.id, poll=0.5)
            ended = time.monotonic()
            if job.status != "SUCCEEDED":
                raise SystemExit(f"the pipeline job ended {job.status}: {job.errors}")
            results = b"".join(client.file_content(job.output_file)).splitlines()
        tokens = sum(json.loads(r)["response"]["body"]["usage"]["completion_tokens"] for r in results if r.strip())
        shard_start = _first_shard_start(stack, job.id, httpx)
        return {"total_s": ended - submitted, "tokens": tokens,
                "first_shard_start_s": shard_start - submitted_wall}
    finally:
        stack.down()


def _first_shard_start(stack, job_id: str, httpx) -> float:
    headers = {"Authorization": f"Bearer {stack.airflow_token()}"}
    api = f"{stack.base_url}/api/v2/dags/batch_inference"
    runs = httpx.get(f"{api}/dagRuns", headers=headers, timeout=30).json()["dag_runs"]
    run_id = next(r["dag_run_id"] for r in runs if job_id in r["dag_run_id"])
    instances = httpx.get(f"{api}/dagRuns/{run_id}/taskInstances", headers=headers, timeout=30).json()
    starts = [datetime.fromisoformat(ti["start_date"]).timestamp() for ti in instances["task_instances"]
              if ti["task_id"].startswith("run_shard") and ti["map_index"] >= 0 and ti["start_date"]]
    return min(starts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--direct-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--placed-as-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("LLM_BATCH_ENFORCE_EAGER", "1")
    if args.direct_only:
        print(_RESULT + json.dumps(run_direct(args.model, args.requests, args.max_tokens, args.placed_as_worker)),
              flush=True)
        return

    from llm_batch.infra.model_cache import prepare_model

    model_cache = prepare_model(args.model).parent  # the shared cache (prepared once)
    print(f"{args.requests} chat requests, max_tokens {args.max_tokens}, model {args.model}, "
          f"eager={os.environ['LLM_BATCH_ENFORCE_EAGER']}", flush=True)
    directs = {"direct LLM.chat, vLLM as shipped": direct(args.model, args.requests, args.max_tokens, False),
               "direct LLM.chat, engine placed as the worker": direct(args.model, args.requests, args.max_tokens,
                                                                     True)}
    for name, d in directs.items():
        print(f"{name + ':':46} {d['total_s']:.1f} s (model load {d['load_s']:.1f} s), "
              f"{d['tokens']} tokens, {d['tokens'] / d['total_s']:.0f} tokens/s", flush=True)
    p = pipeline(args.model, args.requests, args.max_tokens, model_cache)
    print(f"{'full stack:':46} {p['total_s']:.1f} s submit-to-end, {p['tokens']} tokens, "
          f"{p['tokens'] / p['total_s']:.0f} tokens/s")
    print(f"submit to first shard start: {p['first_shard_start_s']:.1f} s")
    for name, d in directs.items():
        extra = p["total_s"] - d["total_s"]
        ratio = (p["tokens"] / p["total_s"]) / (d["tokens"] / d["total_s"])
        print(f"vs {name}: pipeline extra wall time {extra:.1f} s (target < 20 s: "
              f"{'met' if extra < 20 else 'missed'}), throughput ratio {ratio:.2f} (target >= 0.85: "
              f"{'met' if ratio >= 0.85 else 'missed'})")


if __name__ == "__main__":
    main()
