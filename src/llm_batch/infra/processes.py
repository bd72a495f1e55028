"""Process groups and pid files: how the stack, its supervisor and warm engines find and stop
the processes they own."""

from __future__ import annotations

import os
import signal
import time
from contextlib import suppress
from pathlib import Path


def stop_group(pid: int, grace: float) -> None:
    """SIGTERM, SIGKILL after ``grace``, then wait until the group is gone."""
    signal_group(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    signal_group(pid, signal.SIGKILL)
    # SIGKILL takes a moment: a leftover (a dead scheduler's log server) holds the port its successor binds.
    deadline = time.monotonic() + 10
    while group_members(pid) and time.monotonic() < deadline:
        time.sleep(0.05)


def stop_recorded(pid_file: Path, grace: float) -> None:
    """``stop_group`` the process whose pid ``pid_file`` holds (if any), then remove the file."""
    if pid := read_pid(pid_file):
        stop_group(pid, grace)
    pid_file.unlink(missing_ok=True)


def group_members(pgid: int) -> list[int]:
    """Zombies left out."""
    members = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                state, _, group = f.read().rsplit(")", 1)[1].split()[:3]
        except (OSError, IndexError, ValueError):
            continue
        if int(group) == pgid and state != "Z":
            members.append(int(entry))
    return members


def read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (exited, not yet reaped) counts as dead.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def signal_group(pid: int, sig: signal.Signals) -> None:
    with suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)
