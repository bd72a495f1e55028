"""The worker against vLLM's own batch paths on a CUDA host: generated tokens/s, whole-process time.

    python benchmarks/gpu.py [--model meta-llama/Llama-3.1-8B-Instruct] [--requests 1000] [--dry-run]

The GPU version of benchmarks/worker.py (issue 16), for a machine with CUDA and the
inference image's vLLM (docs/gpu-benchmark.md says how to run it and what to expect). The
same chat requests (greedy, ~``--input-tokens`` prompt tokens, exactly ``--max-tokens``
generated tokens each: min_tokens = max_tokens) and the same engine settings (the model
given by path, bf16, max_model_len, seed 0, tensor parallel size, CUDA graphs as vLLM
ships them) run in a fresh process per case:

  (a) ``LLM.chat`` as shipped: vLLM's default layout (the engine core in its own process)
  (b) vLLM's ``run_batch`` as shipped (AsyncLLM: the engine core always in its own process)
  (c) ``llm-batch worker`` on one shard as shipped (on GPU ``engine_in_process()`` keeps
      vLLM's default: the engine core in its own process)
  (i) the worker with ``LLM_BATCH_ENGINE_IN_PROCESS=true`` (the engine core in the worker's
      process): the switch that compares both layouts
  (r) optional: run_batch with the batch limits the LLM class picks on this GPU
      (``--max-num-seqs`` / ``--max-num-batched-tokens``): like for like with (a) and (c)

Printed per case: generated tokens, whole-process seconds (start-up included, the only
figure (b) gives), generation tokens/s ((a) timed around the call, (c)/(i) the worker's
progress ``tokens_per_s``), the engine layout and batch limits, then the ratios to run_batch
and to LLM.chat; each figure the median of ``--repeat`` interleaved rounds. ``--dry-run``
prints the plan and each case's command without starting anything (it works without CUDA).
Without a CUDA device it refuses to run (exit 2) unless ``--allow-cpu``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import random
import re
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.worker import _median_row, completion_tokens, run_worker, timed, worker_command, write_run_batch_input  # noqa: E402  (the CPU benchmark's helpers)

SCRIPT = str(Path(__file__).resolve())
DEFAULT_MODEL = "meta-llama/Llama-3.1-8B-Instruct"
MODEL_NAME = "gpu-benchmark"  # the worker's model name: outside the registry, so nothing merges in
OWN, IN_PROCESS = "engine core in its own process", "engine core in-process"
CASE_NAMES = {
    "a": "(a) LLM.chat as shipped",
    "b": "(b) vllm run_batch as shipped",
    "c": "(c) llm-batch worker as shipped",
    "i": "(i) worker, LLM_BATCH_ENGINE_IN_PROCESS=true",
    "r": "(r) run_batch, LLM's batch limits",
}
# Environment the cases must not inherit: each case says where its engine core runs.
CLEARED_ENV = ("VLLM_ENABLE_V1_MULTIPROCESSING", "LLM_BATCH_ENGINE_IN_PROCESS", "LLM_BATCH_ENFORCE_EAGER")
WORDS = ("time year people way day man thing woman life child world school state family student "
         "group country problem hand part place case week company system program question work "
         "government number night point home water room mother area money story fact month lot "
         "right study book eye job word business issue side kind head house service friend father "
         "power hour game line end member law car city community name president team minute idea "
         "kid body information back parent face others level office door health person art war "
         "history party result change morning reason research girl guy moment air teacher force "
         "education river bread winter library chess moon tea train bee glass lighthouse map clock").split()


# -- the requests ------------------------------------------------------------------------

def prompt(i: int, input_tokens: int) -> str:
    """~``input_tokens`` tokens of text, different for every request (little prefix sharing
    beyond the chat template): common English words are one Llama-3 token each."""
    rng = random.Random(i)
    words = " ".join(rng.choice(WORDS) for _ in range(max(input_tokens - 20, 1)))
    return f"Notes, part {i}: {words}. Continue these notes at length."


def request_body(i: int, input_tokens: int, max_tokens: int, fixed_output: bool) -> dict:
    body = {"messages": [{"role": "user", "content": prompt(i, input_tokens)}],
            "max_tokens": max_tokens, "temperature": 0}
    if fixed_output:
        body["min_tokens"] = max_tokens  # every case generates exactly max_tokens
    return body


# -- the plan ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Plan:
    model: Path
    requests: int
    input_tokens: int
    max_tokens: int
    max_model_len: int
    tensor_parallel_size: int
    gpu_memory_utilization: float | None
    enforce_eager: bool
    fixed_output: bool
    repeat: int
    warmup: int
    cases: str

    def body(self, i: int) -> dict:
        return request_body(i, self.input_tokens, self.max_tokens, self.fixed_output)

    def engine_kwargs(self) -> dict:
        """``vllm.LLM`` keywords of (a): the engine settings every case shares."""
        kwargs = {"model": str(self.model), "dtype": "bfloat16", "max_model_len": self.max_model_len,
                  "seed": 0, "tensor_parallel_size": self.tensor_parallel_size}
        if self.gpu_memory_utilization is not None:
            kwargs["gpu_memory_utilization"] = self.gpu_memory_utilization
        if self.enforce_eager:
            kwargs["enforce_eager"] = True
        return kwargs

    def run_batch_flags(self) -> list[str]:
        """The same settings as run_batch flags."""
        flags = ["--dtype", "bfloat16", "--max-model-len", str(self.max_model_len), "--seed", "0",
                 "--tensor-parallel-size", str(self.tensor_parallel_size)]
        if self.gpu_memory_utilization is not None:
            flags += ["--gpu-memory-utilization", str(self.gpu_memory_utilization)]
        if self.enforce_eager:
            flags.append("--enforce-eager")
        return flags

    def worker_model_config(self) -> dict:
        """The same settings as the worker's model_config (seed 0 is the registry's default);
        the model by path: checkpoint_path, as a job names a checkpoint of its own."""
        config = {"model": MODEL_NAME, "checkpoint_path": str(self.model), "dtype": "bfloat16",
                  "max_model_len": self.max_model_len, "tensor_parallel_size": self.tensor_parallel_size}
        if self.gpu_memory_utilization is not None:
            config["gpu_memory_utilization"] = self.gpu_memory_utilization
        if self.enforce_eager:
            config["enforce_eager"] = True
        return config


def resolve_model(given: str) -> Path:
    """A local checkpoint directory: absolute as given, relative in the model cache (the
    rule of a job's checkpoint_path; the inference image's cache is /var/lib/llm-batch/models)."""
    from llm_batch.core.config import Settings

    path = Path(given).expanduser()
    if not path.is_absolute():
        path = Path(Settings().model_cache) / path
    return path.resolve()


def make_plan(args: argparse.Namespace) -> Plan:
    unknown = set(args.cases) - set(CASE_NAMES)
    if unknown or not args.cases:
        raise SystemExit(f"--cases: letters of {''.join(CASE_NAMES)}, got {args.cases!r}")
    if args.repeat < 1 or args.requests < 1:
        raise SystemExit("--repeat and --requests: at least 1")
    # Room for the prompt (the word count is approximate), the chat template and the output.
    max_model_len = args.max_model_len or max(2048, -(-(2 * args.input_tokens + args.max_tokens + 256) // 1024) * 1024)
    return Plan(model=resolve_model(args.model), requests=args.requests, input_tokens=args.input_tokens,
                max_tokens=args.max_tokens, max_model_len=max_model_len,
                tensor_parallel_size=args.tensor_parallel_size,
                gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager,
                fixed_output=not args.let_stop, repeat=args.repeat, warmup=args.warmup,
                cases="".join(dict.fromkeys(args.cases)))


def planned_layout(case: str, on_gpu: bool) -> tuple[str, str]:
    """(layout, why) of a case's engine core, as vLLM 0.32 and llm_batch place it."""
    if case == "a":
        return OWN, "vLLM's default for LLM: VLLM_ENABLE_V1_MULTIPROCESSING=1, LLMEngine with SyncMPClient"
    if case in "br":
        return OWN, "AsyncLLM always runs its engine core in a process of its own"
    if case == "c":
        return (OWN if on_gpu else IN_PROCESS), ("engine_in_process(): LLM_BATCH_ENGINE_IN_PROCESS unset means "
                                                 "in-process exactly on CPU, vLLM's layout on GPU")
    return IN_PROCESS, "LLM_BATCH_ENGINE_IN_PROCESS=true: start_engine sets VLLM_ENABLE_V1_MULTIPROCESSING=0"


def planned_limits(case: str, limits: dict | None) -> str:
    """The batch limits (max_num_seqs / max_num_batched_tokens) a case runs with."""
    which = "run_batch" if case == "b" else "llm"
    if limits:
        seqs, tokens = limits[which]
        return f"{seqs} seqs / {tokens} tokens"
    if case == "b":
        return "vLLM's run_batch defaults (no entry for OPENAI_BATCH_RUNNER: 128 seqs / 2048 tokens in 0.32)"
    if case == "r":
        return "--max-num-seqs / --max-num-batched-tokens = the LLM class's defaults on the GPU (probed at run time)"
    return "vLLM's LLM-class defaults on the GPU (1024 seqs / 16384 tokens on H100/H200 in 0.32)"


# -- the environment of the cases --------------------------------------------------------

def base_env(plan: Plan, home: Path, on_gpu: bool) -> dict[str, str]:
    from llm_batch.core.config import Settings

    env = {k: v for k, v in os.environ.items() if k not in CLEARED_ENV}
    env.update({"LLM_BATCH_HOME": str(home), "LLM_BATCH_MODEL_CACHE": str(Settings().model_cache),
                # the worker confines a job's checkpoint_path to the local roots
                "LLM_BATCH_LOCAL_ROOTS": str(plan.model),
                "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"})
    if not on_gpu:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # vLLM-CPU refuses to start without one
    return env


def case_env(case: str, env: dict[str, str]) -> dict[str, str]:
    return {**env, "LLM_BATCH_ENGINE_IN_PROCESS": "true"} if case == "i" else env


def run_batch_command(plan: Plan, source: Path, output: Path, limit_flags: list[str]) -> list[str]:
    # run_batch's module entry: the same main() and parser as `vllm run-batch`, whose CLI also
    # wants the `vllm` distribution's metadata (vllm-cpu installs it under another name)
    return [sys.executable, "-m", "vllm.entrypoints.openai.run_batch", "-i", str(source), "-o", str(output),
            "--model", str(plan.model), *plan.run_batch_flags(), *limit_flags]


def limit_flags(case: str, limits: dict | None) -> list[str]:
    if case != "r":
        return []
    seqs, tokens = limits["llm"] if limits else ("<LLM's max_num_seqs>", "<LLM's max_num_batched_tokens>")
    return ["--max-num-seqs", str(seqs), "--max-num-batched-tokens", str(tokens)]


# -- running the cases ---------------------------------------------------------------------

def run_case(case: str, plan: Plan, n: int, env: dict[str, str], work: Path, tag: str,
             limits: dict | None) -> dict:
    env = case_env(case, env)
    name = CASE_NAMES[case]
    if case == "a":
        spec, out = work / f"a-{tag}-spec.json", work / f"a-{tag}.json"
        spec.write_text(json.dumps({"engine": plan.engine_kwargs(), "n": n, "input_tokens": plan.input_tokens,
                                    "max_tokens": plan.max_tokens, "fixed_output": plan.fixed_output}))
        seconds, _ = timed([sys.executable, SCRIPT, "--llm-chat", str(spec), str(out)], env, work / f"a-{tag}.log")
        result = json.loads(out.read_text())
        layout = {"InprocClient": IN_PROCESS, "SyncMPClient": OWN}.get(result["engine_core"], result["engine_core"])
        return {"name": name, "tokens": result["tokens"], "prompt_tokens": result["prompt_tokens"],
                "seconds": seconds, "gen_tok_s": result["tokens"] / result["gen_seconds"], "layout": layout,
                "limits": f"{result['max_num_seqs']} seqs / {result['max_num_batched_tokens']} tokens"}
    if case in "br":
        source, output = work / f"{case}-{tag}-in.jsonl", work / f"{case}-{tag}-out.jsonl"
        write_run_batch_input(source, plan.model, n, body_of=plan.body)
        cmd = run_batch_command(plan, source, output, limit_flags(case, limits))
        seconds, _ = timed(cmd, env, work / f"{case}-{tag}.log")
        failed = [line for line in output.read_text().splitlines()
                  if (json.loads(line).get("response") or {}).get("status_code") != 200]
        if failed or len(output.read_text().splitlines()) != n:
            raise SystemExit(f"{name}: {len(failed)} failed requests; see {output}")
        return {"name": name, "tokens": completion_tokens(output), "seconds": seconds, "gen_tok_s": None,
                "layout": OWN, "limits": planned_limits(case, limits) if limits else "-"}
    row = run_worker(name, MODEL_NAME, n, env, work / "home", work, body_of=plan.body,
                     model_config=plan.worker_model_config())
    found = re.findall(r"engine core (in this process|in its own process)", Path(row["log"]).read_text())
    layout = {"in this process": IN_PROCESS, "in its own process": OWN}.get(found[-1]) if found else "?"
    return {**row, "layout": layout, "limits": planned_limits(case, limits) if limits else "-"}


def benchmark(plan: Plan, info: dict, work: Path, on_gpu: bool) -> None:
    env = base_env(plan, work / "home", on_gpu)
    limits = info.get("limits")
    pause = 5 if on_gpu else 0  # lets the previous engine's processes exit and free GPU memory
    print(f"\n{environment_line(info)}")
    print(f"work dir (logs, inputs, outputs; kept): {work}", flush=True)
    if plan.warmup:
        # The first start compiles the model into vLLM's torch.compile cache; no counted run pays it.
        for case in plan.cases:
            print(f"warm-up {CASE_NAMES[case]}: {plan.warmup} requests (not counted)", flush=True)
            run_case(case, plan, plan.warmup, env, work, "warmup", limits)
            time.sleep(pause)
    runs: dict[str, list[dict]] = {case: [] for case in plan.cases}
    for round_ in range(plan.repeat):
        for case in plan.cases:
            row = run_case(case, plan, plan.requests, env, work, f"round{round_ + 1}", limits)
            runs[case].append(row)
            print(f"round {round_ + 1} {row['name']}: {row['seconds']:.1f} s, {row['tokens']} tokens", flush=True)
            time.sleep(pause)
    report(plan, info, runs, on_gpu)


def report(plan: Plan, info: dict, runs: dict[str, list[dict]], on_gpu: bool) -> None:
    rows = {case: _median_row(results) for case, results in runs.items()}
    prompt_tokens = next((r["prompt_tokens"] for r in rows.values() if r.get("prompt_tokens")), None)
    measured = f", {prompt_tokens / plan.requests:.0f} measured" if prompt_tokens else ""
    output = "exactly" if plan.fixed_output else "at most"
    print(f"\n{plan.requests} chat requests, ~{plan.input_tokens} prompt tokens a request{measured}, {output} "
          f"{plan.max_tokens} generated tokens each, greedy; {plan.model}; tensor parallel "
          f"{plan.tensor_parallel_size}; median of {plan.repeat} interleaved round(s)")
    print(environment_line(info))
    print(f"{'':42} {'tokens':>9} {'process s':>10} {'process tok/s':>14} {'gen tok/s':>10}  "
          f"{'engine layout':31} {'TP':>2}  {'batch limits':24} each run s")
    for case, row in rows.items():
        gen = f"{row['gen_tok_s']:.0f}" if row["gen_tok_s"] else "-"
        each = " ".join(f"{r['seconds']:.1f}" for r in runs[case])
        layouts = {r["layout"] for r in runs[case]}
        layout = row["layout"] if len(layouts) == 1 else "/".join(sorted(layouts))
        expected, _ = planned_layout(case, on_gpu)
        flag = "" if layout == expected else f"  (planned: {expected})"
        print(f"{row['name']:42} {row['tokens']:9d} {row['seconds']:10.1f} {row['tokens'] / row['seconds']:14.0f} "
              f"{gen:>10}  {layout:31} {plan.tensor_parallel_size:>2}  {row['limits']:24} {each}{flag}")
    tokens = {row["tokens"] for row in rows.values()}
    if max(tokens) > 1.01 * min(tokens):
        print(f"note: the cases generated different token counts ({min(tokens)}..{max(tokens)}): compare rates")
    rate = lambda r: r["tokens"] / r["seconds"]  # noqa: E731
    pairs = [(x, "b") for x in rows if x != "b" and "b" in rows]
    pairs += [(x, "a") for x in rows if x not in "ab" and "a" in rows]
    if "i" in rows and "c" in rows:
        pairs.append(("i", "c"))
    if "r" in rows and "c" in rows:
        pairs.append(("c", "r"))
    if pairs:
        print("\nratios (generation: gen tok/s; whole process: generated tokens / process s)")
        print(f"{'':90}{'generation':>10}  {'whole process':>13}")
    for x, base in dict.fromkeys(pairs):
        a, b = rows[x], rows[base]
        gen = f"{a['gen_tok_s'] / b['gen_tok_s']:.3f}" if a["gen_tok_s"] and b["gen_tok_s"] else "-"
        print(f"{a['name'] + ' / ' + b['name']:90}{gen:>10}  {rate(a) / rate(b):13.3f}")


# -- probing the machine -----------------------------------------------------------------

def vllm_distribution() -> str:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return f"{importlib.metadata.version(dist)} ({dist})"
        except importlib.metadata.PackageNotFoundError:
            continue
    return "not installed"


def probe_main(kind: str, tensor_parallel_size: int) -> None:
    """In a subprocess of its own (the benchmark's process never initialises CUDA): torch,
    the CUDA devices, vLLM's version; "full" adds vLLM's batch limits for LLM and run_batch."""
    info: dict = {"vllm": vllm_distribution()}
    try:
        import torch
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        print(json.dumps({**info, "cuda": False, "torch": f"not importable: {exc}"}))
        return
    info.update(torch=torch.__version__, cuda=torch.cuda.is_available(), cuda_version=torch.version.cuda)
    if info["cuda"]:
        count = torch.cuda.device_count()
        info["devices"] = [torch.cuda.get_device_name(d) for d in range(count)]
        info["memory_gib"] = [torch.cuda.get_device_properties(d).total_memory / 2**30 for d in range(count)]
    if kind == "full":
        from vllm.config.scheduler import SchedulerConfig
        from vllm.engine.arg_utils import EngineArgs
        from vllm.usage.usage_lib import UsageContext

        tokens, seqs = EngineArgs.get_batch_defaults(tensor_parallel_size)
        batch_runner = UsageContext.OPENAI_BATCH_RUNNER  # usage context of run_batch
        info["limits"] = {
            "llm": [seqs[UsageContext.LLM_CLASS], tokens[UsageContext.LLM_CLASS]],
            "run_batch": [seqs.get(batch_runner, SchedulerConfig.DEFAULT_MAX_NUM_SEQS),
                          tokens.get(batch_runner, SchedulerConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS)],
        }
    print(json.dumps(info))


def no_cuda_reason() -> str | None:
    """Why no CUDA device can be visible, found without importing torch (seconds on a busy
    machine); None when one may be, and torch must say."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return "CUDA_VISIBLE_DEVICES hides every device"
    if not Path("/proc/driver/nvidia").exists() and not any(Path("/dev").glob("nvidia[0-9]*")):
        return "no NVIDIA driver: no /proc/driver/nvidia, no /dev/nvidia*"
    return None


def probe(kind: str, tensor_parallel_size: int) -> dict:
    if kind == "light" and (reason := no_cuda_reason()):
        try:
            torch = importlib.metadata.version("torch")
        except importlib.metadata.PackageNotFoundError:
            torch = "not installed"
        return {"cuda": False, "vllm": vllm_distribution(), "torch": torch, "error": reason}
    proc = subprocess.run([sys.executable, SCRIPT, "--probe", kind, "--tensor-parallel-size",
                           str(tensor_parallel_size)], capture_output=True, text=True, check=False)
    lines = proc.stdout.strip().splitlines()
    try:
        return json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        return {"cuda": False, "vllm": vllm_distribution(), "torch": "?",
                "error": (proc.stderr.strip().splitlines() or ["probe failed"])[-1]}


def environment_line(info: dict) -> str:
    if info.get("devices"):
        names = sorted(set(info["devices"]))
        gpu = ", ".join(f"{info['devices'].count(n)} x {n}" for n in names)
        gpu += f" ({info['memory_gib'][0]:.0f} GiB each)"
    else:
        gpu = "no CUDA device visible" + (f" ({info['error']})" if info.get("error") else "")
    try:  # the image has no checkout, maybe no git
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, check=False).stdout.strip() or "?"
    except OSError:
        commit = "?"
    cuda = f", CUDA {info['cuda_version']}" if info.get("cuda_version") else ""
    return (f"vLLM {info.get('vllm')}, torch {info.get('torch')}{cuda}; GPU: {gpu}; llm-batch {commit}; "
            f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")


# -- the dry run ---------------------------------------------------------------------------

def dry_run(plan: Plan, info: dict, on_gpu: bool) -> None:
    work = Path("<work>")
    found = (plan.model / "config.json").is_file()
    print("benchmarks/gpu.py --dry-run: the plan; nothing is started.")
    print(environment_line(info))
    if not on_gpu:
        print("the layouts below are those on a CUDA host, where this benchmark is meant to run")
    print(f"model: {plan.model}" + ("" if found else " (not here: no config.json; a CUDA host needs it)"))
    output = "exactly" if plan.fixed_output else "at most"
    print(f"requests: {plan.requests} chat requests, ~{plan.input_tokens} prompt tokens, {output} "
          f"{plan.max_tokens} generated tokens each, greedy")
    print("engine settings of every case: " + ", ".join(f"{k}={v}" for k, v in plan.engine_kwargs().items()
                                                         if k != "model"))
    warmup = f"a warm-up run of each case ({plan.warmup} requests, not counted), then " if plan.warmup else ""
    print(f"rounds: {warmup}{plan.repeat} interleaved round(s) of {' '.join(plan.cases)}; figures are medians")
    env = base_env(plan, work / "home", True)
    changed = {k: v for k, v in env.items() if os.environ.get(k) != v}
    print("environment of every case: " + " ".join(f"{k}={v}" for k, v in changed.items())
          + "; removed: " + " ".join(CLEARED_ENV))
    for case in plan.cases:
        layout, why = planned_layout(case, True)
        print(f"\n{CASE_NAMES[case]}")
        print(f"    layout: {layout}, tensor parallel {plan.tensor_parallel_size} ({why})")
        print(f"    batch limits: {planned_limits(case, info.get('limits'))}")
        if case == "a":
            print(f"    runs: LLM(**{plan.engine_kwargs()}).chat(messages, sampling params, use_tqdm=False), "
                  "generation timed around the call")
            cmd = [sys.executable, SCRIPT, "--llm-chat", str(work / "a-spec.json"), str(work / "a.json")]
        elif case in "br":
            cmd = run_batch_command(plan, work / f"{case}-in.jsonl", work / f"{case}-out.jsonl",
                                    limit_flags(case, info.get("limits")))
        else:
            cmd = worker_command("<job>", json.dumps(plan.worker_model_config()))
            print(f"    shard: {work}/home/work/<job>/shards/00000/requests.jsonl; generation: the "
                  "progress object's tokens_per_s")
        extra = "LLM_BATCH_ENGINE_IN_PROCESS=true " if case == "i" else ""
        print(f"    command: {extra}{shlex.join(cmd)}")


# -- (a) in its own process ----------------------------------------------------------------

def llm_chat_main(spec_path: str, out_path: str) -> None:
    """Case (a): ``LLM.chat`` over every request in one call, vLLM's layout untouched."""
    from vllm import LLM, SamplingParams

    spec = json.loads(Path(spec_path).read_text())
    bodies = [request_body(i, spec["input_tokens"], spec["max_tokens"], spec["fixed_output"])
              for i in range(spec["n"])]
    llm = LLM(**spec["engine"])
    params = [SamplingParams(temperature=0, max_tokens=b["max_tokens"], min_tokens=b.get("min_tokens", 0))
              for b in bodies]
    start = time.monotonic()
    outputs = llm.chat([b["messages"] for b in bodies], params, use_tqdm=False)
    seconds = time.monotonic() - start
    scheduler = llm.llm_engine.vllm_config.scheduler_config
    Path(out_path).write_text(json.dumps({
        "tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
        "prompt_tokens": sum(len(o.prompt_token_ids or ()) for o in outputs),
        "gen_seconds": seconds, "engine_core": type(llm.llm_engine.engine_core).__name__,
        "max_num_seqs": scheduler.max_num_seqs, "max_num_batched_tokens": scheduler.max_num_batched_tokens}))


# -- the command line ------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="the checkpoint: a local model directory (config.json, safetensors), absolute or "
                             "relative to the model cache ($LLM_BATCH_MODEL_CACHE, in the inference image "
                             "/var/lib/llm-batch/models); not a hub id: the image runs with HF_HUB_OFFLINE=1 "
                             f"(default: {DEFAULT_MODEL} in the model cache)")
    parser.add_argument("--requests", type=int, default=1000, help="chat requests per case (default: 1000)")
    parser.add_argument("--input-tokens", type=int, default=512, help="approximate prompt tokens a request (default: 512)")
    parser.add_argument("--max-tokens", type=int, default=512, help="generated tokens a request (default: 512)")
    parser.add_argument("--let-stop", action="store_true",
                        help="let requests end at the model's EOS (default: min_tokens = max_tokens)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="default: room for 2 x input-tokens + max-tokens, at least 2048")
    parser.add_argument("--repeat", type=int, default=3, help="interleaved rounds; figures are medians (default: 3)")
    parser.add_argument("--warmup", type=int, default=16,
                        help="requests of one uncounted run of each case first; 0: none (default: 16)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="in every case (default: 1)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=None, help="in every case (default: vLLM's)")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="no CUDA graphs / torch.compile in any case (default: as vLLM ships)")
    parser.add_argument("--cases", default="abci",
                        help="cases to run, in order: a LLM.chat, b run_batch, c worker, i worker in-process, "
                             "r run_batch with LLM's batch limits (default: abci)")
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="where inputs, outputs and logs go (default: a new temporary directory, kept)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and each case's command, run nothing")
    parser.add_argument("--allow-cpu", action="store_true", help="run even when no CUDA device is visible")
    # internal: a subprocess's probe of the machine; case (a) in its own process
    parser.add_argument("--probe", choices=("light", "full"), help=argparse.SUPPRESS)
    parser.add_argument("--llm-chat", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.probe:
        probe_main(args.probe, args.tensor_parallel_size)
        return 0
    if args.llm_chat:
        llm_chat_main(*args.llm_chat)
        return 0
    plan = make_plan(args)
    info = probe("light", plan.tensor_parallel_size)
    on_gpu = bool(info.get("cuda"))
    if args.dry_run:
        dry_run(plan, info, on_gpu)
        return 0
    if not on_gpu and not args.allow_cpu:
        why = info.get("error") or f"torch {info.get('torch')}: torch.cuda.is_available() is False"
        print(f"benchmarks/gpu.py: no CUDA device is visible ({why}); this benchmark is for a CUDA host. "
              "--dry-run prints the plan; --allow-cpu runs it here anyway.", file=sys.stderr)
        return 2
    if on_gpu and len(info["devices"]) < plan.tensor_parallel_size:
        print(f"benchmarks/gpu.py: --tensor-parallel-size {plan.tensor_parallel_size} needs as many CUDA devices; "
              f"{len(info['devices'])} visible", file=sys.stderr)
        return 2
    if not (plan.model / "config.json").is_file():
        print(f"benchmarks/gpu.py: no model directory (config.json) at {plan.model}; --model takes a local "
              "checkpoint", file=sys.stderr)
        return 2
    full = probe("full", plan.tensor_parallel_size)
    if "limits" not in full:
        if "r" in plan.cases:
            print(f"benchmarks/gpu.py: case (r) needs vLLM's batch limits, not probed: {full.get('error')}",
                  file=sys.stderr)
            return 2
        print(f"note: vLLM's batch limits not probed ({full.get('error')}); the table shows those of (a)")
    info = {**info, **{k: v for k, v in full.items() if k not in ("cuda", "error")}}
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="llm-batch-gpu-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    benchmark(plan, info, work, on_gpu)
    return 0


if __name__ == "__main__":
    sys.exit(main())
