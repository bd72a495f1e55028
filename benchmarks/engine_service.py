"""Small shards on an engine service vs a worker of their own, side by side in one run.

    .venv/bin/python benchmarks/engine_service.py [--shards 8] [--requests 1] [--seats 2]
        [--model smollm2-135m-instruct] [--max-tokens 16]

What a Kubernetes shard costs without and with an engine service (docs/orchestration.md,
"Engine services"), minus what only a cluster adds (pod scheduling, image pull), which makes
the dedicated case only slower:

- dedicated: each shard is ``llm-batch worker`` in a process of its own, what a shard pod
  runs: the engine starts for every shard.
- service: ``llm-batch engine-host --listen`` on 127.0.0.1 with a token, as the Deployment's
  pod runs it; each shard is handed over TCP as ``EngineServiceShardOperator`` hands it
  (``warm_engines.start_service_shard``). The first shard loads the engine (cold); then the
  same shards one at a time (warm), then all of them at once (the host runs ``--seats``
  at a time, the rest wait in line there).

Printed: each case's per-shard wall time (median, min, max), the whole batch of shards at once
on the service, the ratio dedicated / warm, and that every shard has all its results.
"""

from __future__ import annotations

import argparse
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.worker import CHAT_MODEL, engine_env, prepare, worker_command, write_shard  # noqa: E402
from llm_batch.devstack.stack import free_port  # noqa: E402


def _shard(home: Path, n: int, max_tokens: int) -> str:
    job = f"bench-{uuid.uuid4().hex[:8]}"
    write_shard(home, job, n, tokens_of=lambda i: max_tokens)
    return job


def _done(home: Path, job: str, n: int) -> bool:
    progress = orjson.loads((home / "work" / job / "shards" / "00000" / "progress.json").read_bytes())
    return progress["done"] == n and progress["failed"] == 0


def dedicated(home: Path, env: dict, config: str, shards: int, n: int, max_tokens: int, logs: Path) -> list[float]:
    times = []
    for _ in range(shards):
        job = _shard(home, n, max_tokens)
        started = time.monotonic()
        with open(logs / f"{job}.log", "wb") as out:
            code = subprocess.run(worker_command(job, config), env=env, stdout=out, stderr=subprocess.STDOUT).returncode
        times.append(time.monotonic() - started)
        assert code == 0 and _done(home, job, n), f"dedicated shard {job} failed: see {logs}"
    return times


def service_shard(address: tuple[str, int], token: str, home: Path, config: str, n: int, max_tokens: int) -> float:
    from llm_batch.runtime.warm_engines import start_service_shard

    job = _shard(home, n, max_tokens)
    argv = worker_command(job, config)[3:]  # after "python -m llm_batch.cli.main"
    started = time.monotonic()
    code = start_service_shard(address, token, argv, lambda line: None).wait(600)
    seconds = time.monotonic() - started
    assert code == 0 and _done(home, job, n), f"service shard {job} ended with {code}"
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--requests", type=int, default=1, help="chat requests per shard")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--seats", type=int, default=2)
    parser.add_argument("--model", default=CHAT_MODEL)
    parser.add_argument("--model-cache", type=Path,
                        default=Path(os.environ.get("LLM_BATCH_TEST_MODEL_CACHE",
                                                    Path.home() / ".cache/llm-batch-test/models")))
    args = parser.parse_args()
    prepare(args.model_cache, args.model)
    config = orjson.dumps({"model": args.model, "max_context_length": 2048, "dtype": "bfloat16"}).decode()
    print(f"load average at start: {os.getloadavg()[0]:.2f}; {args.shards} shards of {args.requests} request(s), "
          f"{args.max_tokens} tokens each, model {args.model}", flush=True)
    with tempfile.TemporaryDirectory(prefix="llm-batch-engine-service-") as tmp:
        home, logs = Path(tmp) / "home", Path(tmp)
        env = engine_env(home, args.model_cache)
        token, port = secrets.token_hex(16), free_port()
        os.environ.update({k: v for k, v in env.items() if k.startswith(("LLM_BATCH_", "VLLM_"))})

        print("dedicated (a worker per shard, as a shard pod runs it) ...", flush=True)
        own = dedicated(home, env, config, args.shards, args.requests, args.max_tokens, logs)

        print("engine service ...", flush=True)
        started = time.monotonic()
        host = subprocess.Popen([sys.executable, "-m", "llm_batch.cli.main", "engine-host", "--listen", f"127.0.0.1:{port}",
                                 "--model", args.model, "--seats", str(args.seats)],
                                env={**env, "LLM_BATCH_ENGINE_TOKEN": token}, stdout=open(logs / "host.log", "wb"),
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    assert host.poll() is None, (logs / "host.log").read_text()[-2000:]
                    time.sleep(0.1)
            listening = time.monotonic() - started
            address = ("127.0.0.1", port)
            cold = service_shard(address, token, home, config, args.requests, args.max_tokens)
            warm = [service_shard(address, token, home, config, args.requests, args.max_tokens)
                    for _ in range(args.shards)]
            at_once: list[float] = []
            threads = [threading.Thread(target=lambda: at_once.append(
                service_shard(address, token, home, config, args.requests, args.max_tokens)))
                for _ in range(args.shards)]
            together = time.monotonic()
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            together = time.monotonic() - together
            assert len(at_once) == args.shards, "a shard sent at once did not finish"
        finally:
            host.terminate()
            host.wait(60)

    def row(name: str, times: list[float]) -> str:
        return (f"| {name} | {len(times)} | {statistics.median(times):.2f} | {min(times):.2f} | {max(times):.2f} |")

    print()
    print("| case | shards | median s | min s | max s |")
    print("|---|---|---|---|---|")
    print(row("dedicated worker per shard", own))
    print(f"| service: listening after start | 1 | {listening:.2f} | | |")
    print(row("service: first shard (engine loads)", [cold]))
    print(row("service: warm, one at a time", warm))
    print(row(f"service: all {args.shards} at once, {args.seats} seats (each shard's wall)", at_once))
    print()
    print(f"all {args.shards} shards at once on the service ended in {together:.2f} s "
          f"(one at a time: {sum(warm):.2f} s; dedicated: {sum(own):.2f} s)")
    print(f"dedicated / warm per shard (medians): {statistics.median(own) / statistics.median(warm):.1f}x")
    print("every shard: all its results, none failed")


if __name__ == "__main__":
    main()
