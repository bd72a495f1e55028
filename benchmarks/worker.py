"""Worker throughput against vLLM's own batch paths, checkpoint cost, and memory vs shard size.

    .venv/bin/python benchmarks/worker.py [--requests 256] [--repeat 3] [--rss-sizes 256,1024]

Same requests, same model (SmolLM2-135M-Instruct, greedy, 256 chat prompts x 64-128 max
tokens), each in a fresh process with the same engine settings (enforce_eager, bf16,
max_model_len 2048, VLLM_CPU_KVCACHE_SPACE=2):

  (a) ``LLM.chat`` over the whole list in one call, the engine core where the worker puts
      it (``llm_batch.runtime.engine.runner.place_engine_core``: in the process on CPU)
  (b) vLLM's ``run_batch`` entrypoint as shipped (AsyncLLM: engine core in its own process)
  (c) ``llm-batch worker`` on one shard as shipped (default checkpointing: a part every 2 s)
  (d) the worker checkpointing every single record (``--flush-every-records 1``)
  (e) the worker with the engine core in its own process, like (b)
      (``LLM_BATCH_ENGINE_IN_PROCESS=false``)

Printed: completion tokens, whole-process seconds (start-up included, the only figure (b)
allows) and generation tokens/s where the process reports it ((a) timed around the call,
(c)/(d)/(e) from the worker's progress object), and the ratios, each the median of
``--repeat`` interleaved rounds. Then peak RSS of the worker's process and of its process
tree (on CPU the engine runs inside the worker, so its own RSS includes the model and KV
cache) for shards of different sizes, on the tiny model: flat means the worker streams.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import psutil

CHAT_MODEL = "smollm2-135m-instruct"
TINY_MODEL = "tiny-random-llama"
MAX_MODEL_LEN = 2048
TOPICS = ["the sea", "bread", "a bicycle", "winter", "a library", "rivers", "chess", "the moon",
          "tea", "volcanoes", "trains", "bees", "glass", "a lighthouse", "maps", "clocks"]


def messages(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Write a few sentences about {TOPICS[i % len(TOPICS)]} (note {i})."}]


def max_tokens(i: int) -> int:
    return 64 + (i * 37) % 65  # 64..128


def engine_env(home: Path, cache: Path) -> dict[str, str]:
    return {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "LLM_BATCH_ENFORCE_EAGER": "1",
            "LLM_BATCH_HOME": str(home), "LLM_BATCH_MODEL_CACHE": str(cache),
            "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}


class PeakRss:
    """Polls a process and its children: peak RSS of the process itself and of the tree."""

    def __init__(self, pid: int):
        self.process = psutil.Process(pid)
        self.own = self.tree = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                own = self.process.memory_info().rss
                tree = own + sum(c.memory_info().rss for c in self.process.children(recursive=True))
            except psutil.Error:
                break
            self.own, self.tree = max(self.own, own), max(self.tree, tree)
            time.sleep(0.2)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def timed(cmd: list[str], env: dict[str, str], log: Path) -> tuple[float, PeakRss]:
    start = time.monotonic()
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
        rss = PeakRss(proc.pid)
        code = proc.wait()
    rss.stop()
    if code != 0:
        raise SystemExit(f"{' '.join(cmd[:4])}... exited {code}; see {log}")
    return time.monotonic() - start, rss


# -- (a) LLM.chat, in its own process ------------------------------------------------------

def llm_chat_main(model_dir: str, out: str, n: int) -> None:
    from vllm import LLM, SamplingParams

    from llm_batch.runtime.engine.runner import place_engine_core

    place_engine_core()  # where the worker places it

    llm = LLM(model=model_dir, enforce_eager=True, dtype="bfloat16", max_model_len=MAX_MODEL_LEN, seed=0)
    params = [SamplingParams(temperature=0, max_tokens=max_tokens(i)) for i in range(n)]
    start = time.monotonic()
    outputs = llm.chat([messages(i) for i in range(n)], params, use_tqdm=False)
    seconds = time.monotonic() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    Path(out).write_text(json.dumps({"tokens": tokens, "gen_seconds": seconds}))


def run_llm_chat(model_dir: Path, n: int, env: dict[str, str], work: Path) -> dict:
    log = work / "a.log"
    out = work / "a.json"
    cmd = [sys.executable, __file__, "--llm-chat", str(model_dir), str(out), "--requests", str(n)]
    seconds, _ = timed(cmd, env, log)
    result = json.loads(out.read_text())
    return {"name": "(a) LLM.chat", "tokens": result["tokens"], "seconds": seconds,
            "gen_tok_s": result["tokens"] / result["gen_seconds"]}


# -- (b) vLLM run_batch --------------------------------------------------------------------

def chat_body(i: int, tokens_of=max_tokens) -> dict:
    """The body of chat request ``i``: what every case runs."""
    return {"messages": messages(i), "max_tokens": tokens_of(i), "temperature": 0}


def write_run_batch_input(source: Path, model_dir: Path, n: int, body_of=chat_body) -> None:
    """run_batch's input file: ``n`` chat requests (``body_of(i)``) for ``model_dir``."""
    with source.open("w") as f:
        for i in range(n):
            body = {"model": str(model_dir), **body_of(i)}
            f.write(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": body}) + "\n")


def completion_tokens(output: Path) -> int:
    """The completion tokens of a run_batch output file."""
    return sum(json.loads(line)["response"]["body"]["usage"]["completion_tokens"]
               for line in output.read_text().splitlines())


def run_vllm_batch(model_dir: Path, n: int, env: dict[str, str], work: Path) -> dict:
    source, output = work / "run_batch_in.jsonl", work / "run_batch_out.jsonl"
    write_run_batch_input(source, model_dir, n)
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.run_batch", "-i", str(source), "-o", str(output),
           "--model", str(model_dir), "--enforce-eager", "--dtype", "bfloat16",
           "--max-model-len", str(MAX_MODEL_LEN), "--seed", "0"]
    seconds, _ = timed(cmd, env, work / "b.log")
    tokens = completion_tokens(output)
    return {"name": "(b) vllm run_batch", "tokens": tokens, "seconds": seconds, "gen_tok_s": None}


# -- (c) our worker ------------------------------------------------------------------------

def write_shard(home: Path, job: str, n: int, tokens_of=max_tokens, body_of=None) -> Path:
    from llm_batch.core.records import BatchRequest, dumps_line

    body_of = body_of or (lambda i: chat_body(i, tokens_of))
    path = home / "work" / job / "shards" / "00000" / "requests.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as f:
        for i in range(n):
            f.write(dumps_line(BatchRequest(index=i, custom_id=f"c{i}", body=body_of(i))))
    return path


def worker_command(job: str, config: str, *extra: str) -> list[str]:
    """``llm-batch worker`` on shard 0 of ``job`` with the model config JSON ``config``."""
    return [sys.executable, "-m", "llm_batch.cli.main", "worker", "--job-id", job, "--shard", "0",
            "--endpoint", "/v1/chat/completions", "--model-config", config, *extra]


def run_worker(name: str, model: str, n: int, env: dict[str, str], home: Path, work: Path,
               *extra: str, tokens_of=max_tokens, body_of=None, model_config: dict | None = None) -> dict:
    job = f"bench-{uuid.uuid4().hex[:8]}"
    write_shard(home, job, n, tokens_of, body_of)
    context = MAX_MODEL_LEN if model == CHAT_MODEL else 512  # the tiny model's positions
    config = json.dumps(model_config or {"model": model, "max_context_length": context, "dtype": "bfloat16"})
    log = work / f"{job}.log"
    seconds, rss = timed(worker_command(job, config, *extra), env, log)
    progress = json.loads((home / "work" / job / "shards" / "00000" / "progress.json").read_text())
    assert progress["done"] == n and progress["failed"] == 0, progress
    return {"name": name, "tokens": progress["completion_tokens"], "seconds": seconds,
            "gen_tok_s": progress["tokens_per_s"], "rss_own_mb": rss.own / 2**20,
            "rss_tree_mb": rss.tree / 2**20, "prompt_tokens": progress["prompt_tokens"], "log": log}


def prepare(cache: Path, *names: str) -> dict[str, Path]:
    from llm_batch.core.config import Settings
    from llm_batch.infra.model_cache import prepare_model

    settings = Settings(home=cache.parent, model_cache=cache)
    return {name: prepare_model(name, settings=settings) for name in names}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256)
    # The worker's window is 4 x max_num_seqs = 1024 on CPU: sizes past it show flatness.
    parser.add_argument("--rss-sizes", default="256,1024,4096")
    parser.add_argument("--cases", default="abcde", help="throughput cases to run (default abcde; '' = none)")
    parser.add_argument("--repeat", type=int, default=3, help="rounds of the throughput cases (median)")
    parser.add_argument("--model-cache", type=Path,
                        default=Path(os.environ.get("LLM_BATCH_TEST_MODEL_CACHE",
                                                    Path.home() / ".cache/llm-batch-test/models")))
    # internal: run (a) in this process, write its figures to OUT
    parser.add_argument("--llm-chat", nargs=2, metavar=("MODEL_DIR", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.llm_chat:
        return llm_chat_main(*args.llm_chat, args.requests)

    dirs = prepare(args.model_cache, CHAT_MODEL, TINY_MODEL)
    n = args.requests
    with tempfile.TemporaryDirectory(prefix="llm-batch-bench-") as tmp:
        work, home = Path(tmp), Path(tmp) / "home"
        env = engine_env(home, args.model_cache)
        if args.cases:
            throughput(args.cases, dirs, n, env, home, work, args.repeat)
        if args.rss_sizes:
            rss(args.rss_sizes, env, home, work)


CASES = {
    "a": lambda dirs, n, env, home, work: run_llm_chat(dirs[CHAT_MODEL], n, env, work),
    "b": lambda dirs, n, env, home, work: run_vllm_batch(dirs[CHAT_MODEL], n, env, work),
    "c": lambda dirs, n, env, home, work: run_worker("(c) llm-batch worker", CHAT_MODEL, n, env, home, work),
    "d": lambda dirs, n, env, home, work: run_worker("(d) worker, flush every record", CHAT_MODEL, n, env,
                                                     home, work, "--flush-every-records", "1"),
    "e": lambda dirs, n, env, home, work: run_worker("(e) worker, engine core own process", CHAT_MODEL, n,
                                                     {**env, "LLM_BATCH_ENGINE_IN_PROCESS": "false"},
                                                     home, work),
}


def throughput(cases: str, dirs: dict[str, Path], n: int, env: dict[str, str], home: Path, work: Path,
               repeat: int = 1) -> None:
    # Rounds interleave the cases (abcd abcd ...) so drift in the machine's load hits each
    # case alike; each figure is the median over the rounds.
    runs: dict[str, list[dict]] = {case: [] for case in cases}
    for _ in range(repeat):
        for case in cases:
            runs[case].append(CASES[case](dirs, n, env, home, work))
    rows = {case: _median_row(results) for case, results in runs.items()}
    print(f"\n{n} chat requests, {CHAT_MODEL}, greedy, 64-128 max tokens; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; median of {repeat} round(s)")
    print(f"{'':34} {'tokens':>7} {'process s':>10} {'process tok/s':>14} {'gen tok/s':>10}  each run s")
    for case, row in rows.items():
        gen = f"{row['gen_tok_s']:.0f}" if row["gen_tok_s"] else "-"
        each = " ".join(f"{r['seconds']:.1f}" for r in runs[case])
        print(f"{row['name']:34} {row['tokens']:7d} {row['seconds']:10.1f} "
              f"{row['tokens'] / row['seconds']:14.0f} {gen:>10}  {each}")
    a, b, c, d, e = (rows.get(case) for case in "abcde")
    rate = lambda r: r["tokens"] / r["seconds"]  # noqa: E731
    if a and c:
        print(f"worker / LLM.chat:   generation {c['gen_tok_s'] / a['gen_tok_s']:.3f}  "
              f"whole process {rate(c) / rate(a):.3f}   (target >= 0.95)")
    if b and c:
        print(f"worker / run_batch:  whole process {rate(c) / rate(b):.3f}   (target >= 1.0)")
    if b and e:
        print(f"worker / run_batch, both engine cores in their own process: whole process "
              f"{rate(e) / rate(b):.3f}")
    if c and d:
        print(f"checkpoint every record costs {100 * (1 - d['gen_tok_s'] / c['gen_tok_s']):.1f}% "
              f"of generation tok/s vs default   (target < 3%)")


def _median_row(results: list[dict]) -> dict:
    """One row: the first run's name and tokens (greedy: the same every run), median figures."""
    gen = [r["gen_tok_s"] for r in results if r["gen_tok_s"]]
    return {**results[0], "seconds": statistics.median(r["seconds"] for r in results),
            "gen_tok_s": statistics.median(gen) if gen else None}


def rss(sizes: str, env: dict[str, str], home: Path, work: Path) -> None:
    print(f"\npeak RSS of the worker vs shard size ({TINY_MODEL}, 16 tokens a request)")
    print(f"{'requests':>9} {'worker MB':>10} {'process tree MB':>16}")
    for size in (int(s) for s in sizes.split(",")):
        row = run_worker(f"rss {size}", TINY_MODEL, size, env, home, work, tokens_of=lambda i: 16)
        print(f"{size:9d} {row['rss_own_mb']:10.0f} {row['rss_tree_mb']:16.0f}")


if __name__ == "__main__":
    main()
