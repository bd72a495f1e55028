"""benchmarks/gpu.py on a machine without CUDA: the dry run prints every case with its engine
layout and its command, and a real run refuses (exit 2, naming CUDA) unless --allow-cpu.

Each test runs the script in a subprocess, as on the GPU host (~1 s). ``CUDA_VISIBLE_DEVICES=""``
hides any GPU, so the outcome is the same on a machine that has one, and the script knows it
without importing torch. Nothing here starts an engine.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu.py"
CHECKPOINT = "/nonexistent/Llama-3.1-8B-Instruct"
OWN, IN_PROCESS = "engine core in its own process", "engine core in-process"


def run_script(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, str(SCRIPT), "--model", CHECKPOINT, *args],
                          capture_output=True, text=True, env=env, timeout=120, check=False)


def cases_of(stdout: str) -> dict[str, str]:
    """The dry run's block of each case, by its letter: "(a) ..." up to the next case."""
    blocks = re.split(r"\n(?=\([a-z]\) )", stdout)
    return {m.group(1): block for block in blocks if (m := re.match(r"\(([a-z])\) ", block))}


def test_dry_run_prints_each_case_with_its_layout_and_command():
    proc = run_script("--dry-run", "--cases", "abcir", "--tensor-parallel-size", "2", "--requests", "64")
    assert proc.returncode == 0, proc.stderr
    assert "no CUDA device visible" in proc.stdout
    assert "vLLM " in proc.stdout.splitlines()[1]
    cases = cases_of(proc.stdout)
    assert list(cases) == list("abcir")
    layouts = {"a": OWN, "b": OWN, "c": OWN, "i": IN_PROCESS, "r": OWN}
    commands = {}
    for case, layout in layouts.items():
        assert f"layout: {layout}, tensor parallel 2" in cases[case], cases[case]
        (command,) = re.findall(r"^    command: (.+)$", cases[case], re.MULTILINE)
        commands[case] = command
    assert cases["a"].startswith("(a) LLM.chat as shipped")
    assert "--llm-chat" in commands["a"]
    assert "'tensor_parallel_size': 2" in cases["a"]
    for case in "br":
        assert " -m vllm.entrypoints.openai.run_batch -i " in commands[case]
        assert f"--model {CHECKPOINT}" in commands[case]
        assert "--tensor-parallel-size 2" in commands[case]
    assert "--max-num-seqs" not in commands["b"] and "--max-num-seqs" in commands["r"]
    for case in "ci":
        assert " -m llm_batch.cli.main worker " in commands[case]
        assert f'"checkpoint_path": "{CHECKPOINT}"' in commands[case]
        assert '"tensor_parallel_size": 2' in commands[case]
    # the as-shipped worker keeps vLLM's layout; only (i) flips the switch
    assert "LLM_BATCH_ENGINE_IN_PROCESS" not in commands["c"]
    assert commands["i"].startswith("LLM_BATCH_ENGINE_IN_PROCESS=true ")


def test_refuses_to_run_without_cuda():
    proc = run_script("--requests", "8")
    assert proc.returncode == 2
    assert "CUDA" in proc.stderr
    assert "--dry-run" in proc.stderr and "--allow-cpu" in proc.stderr


def test_allow_cpu_passes_the_cuda_check():
    # past the CUDA check it stops at the missing checkpoint, before any engine starts
    proc = run_script("--allow-cpu", "--requests", "8")
    assert proc.returncode == 2
    assert "no CUDA device" not in proc.stderr
    assert f"config.json) at {CHECKPOINT}" in proc.stderr
