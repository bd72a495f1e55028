"""The supervisor's rounds (llm_batch.devstack.supervisor.Supervisor.poll) on `sleep` processes
standing in for the components, with the clock passed in: what it starts, when (backoff),
what it records, what it leaves alone. The supervisor process itself, started by ``up``, is
tested in test_stack_up.py; on the real stack in tests/e2e/test_stack_up.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from llm_batch.core.config import Settings
from llm_batch.devstack.stack import COMPONENTS, Stack
from llm_batch.devstack.supervisor import HEALTH_EVERY_S, NOT_ANSWERING, Supervisor, read_restarts


class SleepStack(Stack):
    def command(self, component: str) -> list[str]:
        return ["sleep", "600"]

    def not_answering(self, state: dict[str, int | None]) -> tuple[str, ...]:
        return ()


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[SleepStack]:
    sleeping = SleepStack(Settings(home=tmp_path))
    yield sleeping
    sleeping.down(grace=2)


@pytest.fixture
def started(stack: SleepStack) -> tuple[Supervisor, float]:
    supervisor = Supervisor(stack)
    t0 = time.monotonic()
    supervisor.poll(t0)
    assert all(stack.running().values()) and read_restarts(stack) == {}  # first starts are no restarts
    return supervisor, t0


def kill(stack: Stack, name: str, sig: signal.Signals = signal.SIGKILL) -> int:
    pid = stack.pid_of(name)
    os.kill(pid, sig)
    deadline = time.monotonic() + 10
    while stack.pid_of(name):  # a zombie until the supervisor reaps it: dead already
        assert time.monotonic() < deadline
        time.sleep(0.02)
    return pid


def test_a_dead_component_is_started_again_and_recorded_with_its_exit_status(stack, started):
    supervisor, t0 = started
    before = stack.running()
    kill(stack, "scheduler")
    supervisor.poll(t0 + 120)  # it had run for two minutes: at once
    after = stack.running()
    assert after["scheduler"] not in (None, before["scheduler"])
    assert {c: p for c, p in after.items() if c != "scheduler"} == {c: p for c, p in before.items() if c != "scheduler"}
    record = read_restarts(stack)
    assert record.keys() == {"scheduler"}
    assert (record["scheduler"]["restarts"], record["scheduler"]["reason"]) == (1, "killed by SIGKILL")

    stack.stop_component("scheduler")  # SIGTERM to its group: the supervisor starts it again
    supervisor.poll(t0 + 240)
    assert stack.pid_of("scheduler") and read_restarts(stack)["scheduler"]["restarts"] == 2
    assert read_restarts(stack)["scheduler"]["reason"] == "killed by SIGTERM"


def test_one_that_keeps_dying_young_waits_longer_each_time(stack, started):
    supervisor, t0 = started
    # Died 1 s after its start: 1 s to wait; then 2 s; after a minute up, at once again.
    for died_at, wait in ((t0 + 1, 1), (t0 + 3, 2), (t0 + 6, 4)):
        kill(stack, "triggerer")
        supervisor.poll(died_at)
        supervisor.poll(died_at + wait - 0.5)
        assert stack.pid_of("triggerer") is None, f"started again before its {wait} s"
        supervisor.poll(died_at + wait)
        assert stack.pid_of("triggerer"), f"not started again after {wait} s"
    kill(stack, "triggerer")
    supervisor.poll(t0 + 10 + 61)
    assert stack.pid_of("triggerer") and read_restarts(stack)["triggerer"]["restarts"] == 4


def test_a_start_by_someone_else_is_adopted_and_a_locked_component_waits(stack, started):
    supervisor, t0 = started
    stack.stop_component("dag-processor")
    mine = stack.start_component("dag-processor")  # as `up` or a test would
    supervisor.poll(t0 + 120)
    assert stack.pid_of("dag-processor") == mine and read_restarts(stack) == {}

    # Another process (`up`, a test) holds the lock: this round leaves it to them.
    lock = stack.pid_file("api-server").with_suffix(".lock")
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, sys; f = open(sys.argv[1], 'a'); fcntl.flock(f, fcntl.LOCK_EX); "
         "print('held', flush=True); sys.stdin.read()", str(lock)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        kill(stack, "api-server")
        supervisor.poll(t0 + 240)
        assert stack.pid_of("api-server") is None
    finally:
        holder.communicate("")
    supervisor.poll(t0 + 241)
    assert stack.pid_of("api-server") and read_restarts(stack)["api-server"]["restarts"] == 1


def test_a_hung_component_is_stopped_and_started_again(stack, started, monkeypatch):
    supervisor, t0 = started
    hung = stack.pid_of("triggerer")
    monkeypatch.setattr(SleepStack, "not_answering", lambda self, state: ("triggerer",))
    supervisor.poll(t0 + HEALTH_EVERY_S / 2)  # not checked yet
    assert stack.pid_of("triggerer") == hung
    supervisor.poll(t0 + 4 * HEALTH_EVERY_S)  # (not_answering names only what has run 120 s)
    assert stack.pid_of("triggerer") not in (None, hung)
    assert read_restarts(stack)["triggerer"]["reason"] == NOT_ANSWERING
    assert all(stack.pid_of(c) for c in COMPONENTS)


def test_after_sigterm_it_starts_nothing(stack, started):
    supervisor, t0 = started
    kill(stack, "scheduler")
    supervisor._stop(signal.SIGTERM, None)
    supervisor.poll(t0 + 120)
    assert stack.pid_of("scheduler") is None  # down stops the supervisor first, then the rest
