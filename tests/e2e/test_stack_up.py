"""``up`` on the real stack with one dead component: only that one is started again.

Uses the session's stack (tests/e2e/conftest.py), after test_stack.py. The scheduler's
leader is killed with SIGKILL, which leaves its children (``serve-logs`` on the log-server
port, the LocalExecutor workers) in its process group: ``up`` must clear those, start a new
scheduler on the same ports, and leave the other three components untouched.
"""

from __future__ import annotations

import os
import signal
import time
from datetime import datetime

import pytest

from tests.e2e.conftest import stack_logs, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.airflow]


def _group(pgid: int) -> list[int]:
    members = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry))
    return members


def test_up_starts_only_the_killed_scheduler(e2e_stack):
    before = e2e_stack.running()
    assert all(before.values()), before
    old = before["scheduler"]
    killed_at = datetime.now().astimezone()
    os.kill(old, signal.SIGKILL)  # the leader only, as a crash would
    wait_until("the scheduler to be dead", lambda: e2e_stack.running()["scheduler"] is None, 30, poll=0.2)
    assert _group(old), "the killed scheduler left no children: nothing to clean up in this test"

    started = time.monotonic()
    try:
        result = e2e_stack.up(timeout=180)
    except Exception:
        print(stack_logs(e2e_stack))
        raise
    took = time.monotonic() - started

    assert (result.started, result.restarted) == (("scheduler",), ())
    assert result.already_running == ("api-server", "dag-processor", "triggerer")
    after = e2e_stack.running()
    assert {c: pid for c, pid in after.items() if c != "scheduler"} == {c: pid for c, pid in before.items() if c != "scheduler"}
    assert after["scheduler"] not in (None, old)
    assert _group(old) == []  # the dead scheduler's leftovers are gone

    def fresh_heartbeat():
        beat = (e2e_stack.monitor_health().get("scheduler") or {}).get("latest_scheduler_heartbeat")
        return beat and datetime.fromisoformat(beat) > killed_at

    wait_until("the new scheduler to heartbeat", fresh_heartbeat, 120)
    assert took < 120, f"up took {took:.0f}s"
