"""Prefix-aware sharding against today's contiguous plan and vLLM's run_batch.

    .venv/bin/python benchmarks/prefix_sharding.py [--docs 64] [--doc-tokens 1000]
        [--questions 4] [--answer-tokens 16] [--dp 1,2] [--repeat 1] [--no-run-batch]
        [--cases ...] [--dry-run]

Batches (generated deterministically from a fixed vocabulary; no downloads), chat requests
to smollm2-135m-instruct, greedy, ``--answer-tokens`` tokens each:

- **document QA**: ``--docs`` documents of about ``--doc-tokens`` tokens (counted with the
  model's tokenizer), ``--questions`` questions each (system prompt, then the document,
  then the question), the lines **shuffled**; and the same lines **grouped** by document.
- **control**: as many requests, each with its own document (no shared prefix but the
  short system prompt), the same sizes.

Each batch runs as a job: validate (``validate_batch``), plan (``plan_shards``: today's
contiguous plan with the switch off, ``LLM_BATCH_PREFIX_AWARE_SHARDING=false``, or the
prefix-aware plan), then one ``llm-batch worker`` process per shard, all at once, each with
its own cores at data_parallelism 2 (``VLLM_CPU_OMP_THREADS_BIND``: shard k on core k of
2; at 1 the worker's default, both cores), then ``merge_job`` (checked: every line
succeeded, in input order). The workers with today's plan also feed in file order (the
switch turns both off). vLLM's ``run_batch`` runs the shuffled document-QA file as shipped.

Printed per case: wall time (first worker start to last worker end: engine starts
included, as a job pays them), planning time, prompt tokens, prompt tokens served from
vLLM's prefix cache (the engine's own count, ``RequestOutput.num_cached_tokens``, which the
worker sums into its progress object; run_batch's ``usage.prompt_tokens_details``) and so
computed, generated tokens and generated tokens/s (over the wall time, and over the
engine loop's time of the slowest shard); then the issue's targets beside their figures.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

MODEL = "smollm2-135m-instruct"
ENDPOINT = "/v1/chat/completions"
SYSTEM = "You answer questions about the document the user gives. Answer in one short sentence."
VOCABULARY = (
    "the river city market winter harvest council bridge road school library village mill "
    "report season price grain water station north south east west year month people trade "
    "farmer merchant engineer teacher doctor river valley hill forest lake coast port ship "
    "train engine factory wool cotton iron steel coal salt bread cheese wine oil paper ink "
    "record letter account ledger tax law court judge mayor guild festival church tower "
    "clock bell road canal dam flood drought storm snow rain wind sun moon field garden "
    "orchard apple pear plum cherry horse cattle sheep goat pig chicken fish net boat "
    "built opened closed grew fell rose moved sold bought paid carried wrote read kept "
    "new old large small early late first last many few every most some several"
).split()
TOPICS = ["the bridge", "the harvest", "the market prices", "the council", "the river",
          "the factory", "the school", "the weather", "the port", "the festival"]


# -- the batches ------------------------------------------------------------------------------

def document(d: int, words: int) -> str:
    rng = random.Random(1_000 + d)
    out = [f"Record {d} of the archive."]
    while len(out) < words:
        sentence = [rng.choice(VOCABULARY) for _ in range(rng.randint(6, 14))]
        out.append(" ".join(sentence).capitalize() + ".")
        out[-1:] = out[-1].split(" ")
    return " ".join(out[:words])


def question(d: int, q: int) -> str:
    return f"What does record {d} say about {TOPICS[(d + 3 * q) % len(TOPICS)]}? (question {q + 1})"


def body(doc: str, q_text: str, answer_tokens: int) -> dict:
    return {"messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": f"Document:\n{doc}\n\nQuestion: {q_text}"}],
            "max_tokens": answer_tokens, "temperature": 0}


def words_for(tokens: int, model_dir: Path) -> int:
    """Words per document for about ``tokens`` tokens, with the model's own tokenizer."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    words = tokens
    for _ in range(4):
        counted = len(tokenizer.encode(document(0, words)).ids)
        words = max(10, round(words * tokens / counted))
    return words


def batch_lines(kind: str, docs: int, questions: int, words: int, answer_tokens: int) -> list[dict]:
    if kind == "control":  # one document per request: nothing shared but the system prompt
        pairs = [(d, 0) for d in range(docs * questions)]
    else:
        pairs = [(d, q) for d in range(docs) for q in range(questions)]
    if kind in ("docqa", "control"):
        random.Random(42).shuffle(pairs)
    texts = {d: document(d, words) for d in {d for d, _ in pairs}}
    return [{"custom_id": f"d{d}-q{q}", "method": "POST", "url": ENDPOINT,
             "body": body(texts[d], question(d, q), answer_tokens)} for d, q in pairs]


def write_jsonl(path: Path, lines: list[dict], model: str | None = None) -> None:
    with path.open("w") as f:
        for line in lines:
            if model is not None:
                line = {**line, "body": {**line["body"], "model": model}}
            f.write(json.dumps(line) + "\n")


# -- running a job ----------------------------------------------------------------------------

def engine_env(home: Path, cache: Path) -> dict[str, str]:
    return {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "LLM_BATCH_ENFORCE_EAGER": "1",
            "LLM_BATCH_HOME": str(home), "LLM_BATCH_MODEL_CACHE": str(cache),
            "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}


def plan_job(source: Path, dp: int, prefix: bool, home: Path):
    from llm_batch.core.layout import JobLayout
    from llm_batch.pipeline.sharding import plan_shards, read_manifest
    from llm_batch.pipeline.validation import validate_batch

    layout = JobLayout(str(home / "work"), f"bench-{uuid.uuid4().hex[:8]}")
    validate_batch(str(source), fmt="jsonl", layout=layout)
    start = time.monotonic()
    plans = plan_shards(layout, dp, prefix_aware=prefix)
    return layout, plans, time.monotonic() - start, read_manifest(layout)


def run_job(name: str, source: Path, dp: int, prefix: bool, env: dict[str, str], home: Path,
            work: Path, feed: str | None = None) -> dict:
    from llm_batch.pipeline.merge import merge_job

    layout, plans, plan_s, manifest = plan_job(source, dp, prefix, home)
    config = json.dumps({"model": MODEL, "dtype": "bfloat16"})
    procs = []
    start = time.monotonic()
    for plan in plans:
        shard_env = {**env, "LLM_BATCH_PREFIX_AWARE_SHARDING": "true" if prefix else "false"}
        if feed:
            shard_env["LLM_BATCH_PREFIX_FEED_ORDER"] = feed
        if len(plans) > 1:  # each shard its own core(s), as each would have its own GPU
            cores = os.cpu_count() or 1
            per = max(1, cores // len(plans))
            first = (plan.index * per) % cores
            shard_env["VLLM_CPU_OMP_THREADS_BIND"] = (
                str(first) if per == 1 else f"{first}-{first + per - 1}")
        log = (work / f"{layout.job_id}-{plan.index}.log").open("wb")
        cmd = [sys.executable, "-m", "llm_batch.cli.main", "worker", "--job-id", layout.job_id,
               "--shard", str(plan.index), "--endpoint", ENDPOINT, "--model-config", config]
        procs.append((subprocess.Popen(cmd, env=shard_env, stdout=log, stderr=subprocess.STDOUT), log))
    ends = []
    for proc, log in procs:
        code = proc.wait()
        ends.append(time.monotonic())
        log.close()
        if code != 0:
            raise SystemExit(f"{name}: worker exited {code}; see {log.name}")
    wall = max(ends) - start
    progress = [json.loads(Path(p.progress_uri).read_text()) for p in plans]
    counts = merge_job(layout)
    total = sum(p.count for p in plans)
    assert counts.succeeded == total == counts.total, counts
    outputs = [json.loads(x) for x in Path(layout.output_jsonl).read_text().splitlines()]
    expected = [json.loads(x)["custom_id"] for x in source.read_text().splitlines()]
    assert [o["custom_id"] for o in outputs] == expected  # input order
    prompt = sum(p["prompt_tokens"] for p in progress)
    cached = sum(p["cached_prompt_tokens"] for p in progress)
    generated = sum(p["completion_tokens"] for p in progress)
    engine_s = max(p["engine_seconds"] for p in progress)
    return {"name": name, "wall": wall, "plan_s": plan_s, "prompt": prompt, "cached": cached,
            "generated": generated, "engine_s": engine_s, "shards": len(plans),
            "prefix_plan": manifest.prefix_aware, "groups": manifest.prefix_groups,
            "sizes": [p.count for p in plans]}


def run_vllm_batch(name: str, source: Path, model_dir: Path, env: dict[str, str], work: Path) -> dict:
    tagged = work / f"run_batch_in_{uuid.uuid4().hex[:6]}.jsonl"
    write_jsonl(tagged, [json.loads(x) for x in source.read_text().splitlines()], str(model_dir))
    output = work / f"run_batch_out_{uuid.uuid4().hex[:6]}.jsonl"
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.run_batch", "-i", str(tagged), "-o", str(output),
           "--model", str(model_dir), "--enforce-eager", "--dtype", "bfloat16", "--max-model-len", "8192",
           "--enable-prefix-caching", "--enable-prompt-tokens-details", "--seed", "0"]
    start = time.monotonic()
    with (work / "run_batch.log").open("wb") as log:
        code = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT).wait()
    wall = time.monotonic() - start
    if code != 0:
        raise SystemExit(f"{name}: run_batch exited {code}; see {work / 'run_batch.log'}")
    usage = [json.loads(x)["response"]["body"]["usage"] for x in output.read_text().splitlines()]
    cached = [((u.get("prompt_tokens_details") or {}).get("cached_tokens")) for u in usage]
    return {"name": name, "wall": wall, "plan_s": None, "prompt": sum(u["prompt_tokens"] for u in usage),
            "cached": None if None in cached else sum(cached),
            "generated": sum(u["completion_tokens"] for u in usage), "engine_s": None, "shards": 1,
            "prefix_plan": None, "groups": None, "sizes": [len(usage)]}


# -- the report -------------------------------------------------------------------------------

def median_row(rows: list[dict]) -> dict:
    row = dict(rows[len(rows) // 2])
    row["wall"] = statistics.median(r["wall"] for r in rows)
    row["walls"] = [r["wall"] for r in rows]
    return row


def show(rows: dict[str, dict]) -> None:
    def num(value, fmt: str = "") -> str:
        return "-" if value is None else format(value, fmt)

    print(f"{'case':42} {'shards':>6} {'wall s':>7} {'plan s':>6} {'prompt':>8} {'cached':>8} "
          f"{'computed':>8} {'hit %':>6} {'gen':>6} {'gen/s wall':>10} {'gen/s eng':>9}  runs s")
    for name, r in rows.items():
        cached = r["cached"]
        computed = r["prompt"] - cached if cached is not None else None
        hit = 100 * cached / r["prompt"] if cached is not None and r["prompt"] else None
        per_engine = r["generated"] / r["engine_s"] if r["engine_s"] else None
        runs = " ".join(f"{w:.1f}" for w in r.get("walls", [r["wall"]]))
        print(f"{name:42} {r['shards']:>6} {r['wall']:7.1f} {num(r['plan_s'], '.2f'):>6} "
              f"{r['prompt']:>8} {num(cached):>8} {num(computed):>8} {num(hit, '.1f'):>6} "
              f"{r['generated']:>6} {r['generated'] / r['wall']:10.1f} {num(per_engine, '.1f'):>9}  "
              f"{runs}   sizes {r['sizes']}{' (prefix plan)' if r['prefix_plan'] else ''}")


def targets(rows: dict[str, dict]) -> None:
    def ratio(slow: str, fast: str) -> float | None:
        if slow in rows and fast in rows:
            return rows[slow]["wall"] / rows[fast]["wall"]
        return None

    def line(text: str, value: float | None, ok=None) -> None:
        """A figure beside its target (``ok``), or for information (no ``ok``)."""
        if value is None:
            print(f"{text}: not measured")
        else:
            print(f"{text}: {value:.3f}" + (f"  ({'met' if ok(value) else 'MISSED'})" if ok else ""))

    line("doc-QA shuffled dp1: today's plan / prefix-aware wall (information; the target is at dp2)",
         ratio("docqa shuffled dp1 today", "docqa shuffled dp1 prefix"))
    line("doc-QA shuffled dp2: today's plan / prefix-aware wall (target >= 1.4)",
         ratio("docqa shuffled dp2 today", "docqa shuffled dp2 prefix"), lambda v: v >= 1.4)
    line("doc-QA shuffled: run_batch / prefix-aware dp2 wall (target >= 1.4)",
         ratio("docqa shuffled run_batch", "docqa shuffled dp2 prefix"), lambda v: v >= 1.4)
    line("doc-QA shuffled: run_batch / prefix-aware dp1 wall (information: the same cores)",
         ratio("docqa shuffled run_batch", "docqa shuffled dp1 prefix"))
    for dp in (1, 2):
        line(f"doc-QA dp{dp} prefix-aware: shuffled / grouped wall (target <= 1.05)",
             ratio(f"docqa shuffled dp{dp} prefix", f"docqa grouped dp{dp} prefix"), lambda v: v <= 1.05)
        line(f"control dp{dp}: prefix-aware / today's plan wall (target <= 1.02)",
             ratio(f"control dp{dp} prefix", f"control dp{dp} today"), lambda v: v <= 1.02)
    line("doc-QA shuffled dp2 prefix-aware: leaders_first / grouped feed wall (information)",
         ratio("docqa shuffled dp2 prefix leaders_first", "docqa shuffled dp2 prefix"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=64)
    parser.add_argument("--doc-tokens", type=int, default=1000)
    parser.add_argument("--questions", type=int, default=4)
    parser.add_argument("--answer-tokens", type=int, default=16)
    parser.add_argument("--dp", default="1,2")
    parser.add_argument("--repeat", type=int, default=1, help="rounds (interleaved); the median is shown")
    parser.add_argument("--cases", default="docqa,grouped,control,run_batch",
                        help="comma list of docqa, grouped, control, run_batch, leaders")
    parser.add_argument("--no-run-batch", action="store_true")
    parser.add_argument("--dry-run", action="store_true", help="generate and plan only (no engine)")
    parser.add_argument("--model-cache", type=Path,
                        default=Path(os.environ.get("LLM_BATCH_MODEL_CACHE", Path.home() / ".llm-batch/models")))
    args = parser.parse_args()
    dps = [int(x) for x in args.dp.split(",") if x]
    cases = set(args.cases.split(","))
    if args.no_run_batch:
        cases.discard("run_batch")

    with tempfile.TemporaryDirectory(prefix="llm-batch-prefix-bench-") as tmp:
        work, home = Path(tmp), Path(tmp) / "home"
        (home / "data").mkdir(parents=True)
        env = engine_env(home, args.model_cache)
        os.environ.update({k: env[k] for k in ("LLM_BATCH_HOME", "LLM_BATCH_MODEL_CACHE")})
        from llm_batch.core.config import Settings
        from llm_batch.infra.model_cache import prepare_model

        model_dir = prepare_model(MODEL, settings=Settings(home=home, model_cache=args.model_cache))
        words = words_for(args.doc_tokens, model_dir)
        files = {}
        for kind in ("docqa", "grouped", "control"):
            files[kind] = home / "data" / f"{kind}.jsonl"
            write_jsonl(files[kind], batch_lines(kind, args.docs, args.questions, words, args.answer_tokens))
        n = args.docs * args.questions
        print(f"{args.docs} documents x {args.questions} questions = {n} requests; documents of ~"
              f"{args.doc_tokens} tokens ({words} words); {args.answer_tokens} answer tokens, greedy; "
              f"control: {n} requests with a document each; model {MODEL}; "
              f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores at start")
        if args.dry_run:
            for kind, path in files.items():
                for dp in dps:
                    for prefix in (False, True):
                        _, plans, plan_s, manifest = plan_job(path, dp, prefix, home)
                        print(f"{kind:8} dp{dp} {'prefix' if prefix else 'today '}: plan {plan_s:.3f} s, "
                              f"sizes {[p.count for p in plans]}, prefix plan {manifest.prefix_aware}, "
                              f"groups {manifest.prefix_groups}, est. saved {manifest.estimated_saved_tokens}")
            return

        jobs: list[tuple[str, callable]] = []
        for kind, label in (("docqa", "docqa shuffled"), ("grouped", "docqa grouped"), ("control", "control")):
            if kind not in cases:
                continue
            for dp in dps:
                for prefix in (False, True):
                    if kind == "grouped" and not prefix:
                        continue
                    name = f"{label} dp{dp} {'prefix' if prefix else 'today'}"
                    jobs.append((name, lambda name=name, kind=kind, dp=dp, prefix=prefix:
                                 run_job(name, files[kind], dp, prefix, env, home, work)))
        if "leaders" in cases:
            name = "docqa shuffled dp2 prefix leaders_first"
            jobs.append((name, lambda name=name: run_job(name, files["docqa"], 2, True, env, home, work,
                                                        feed="leaders_first")))
        if "run_batch" in cases:
            name = "docqa shuffled run_batch"
            jobs.append((name, lambda name=name: run_vllm_batch(name, files["docqa"], model_dir, env, work)))

        runs: dict[str, list[dict]] = {name: [] for name, _ in jobs}
        for round_ in range(args.repeat):
            for name, job in jobs:
                started = time.strftime("%H:%M:%S", time.gmtime())
                runs[name].append(job())
                print(f"  [{started} UTC, load {os.getloadavg()[0]:.1f}] {name}: "
                      f"{runs[name][-1]['wall']:.1f} s", flush=True)
        rows = {name: median_row(r) for name, r in runs.items() if r}
        print()
        show(rows)
        print()
        targets(rows)
        print(f"load average at the end {os.getloadavg()[0]:.1f} (1 min) {os.getloadavg()[1]:.1f} (5 min)")


if __name__ == "__main__":
    main()
