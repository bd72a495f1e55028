"""The stack's supervisor: it keeps every component running, and records its restarts.

``up`` starts it (``python -m llm_batch.devstack.supervisor <stack class>``); it rebuilds the
stack (``create()``) and, every second, starts again each of ``Stack.supervised()`` that died
(at once if it had run a minute, else with backoff) and, every 30 s, one that
``Stack.not_answering`` calls hung; each restart goes to ``run/restarts.json`` with its reason.
It holds a component's ``component_lock`` while it starts or stops it, and never stops a
component on exit: a new supervisor adopts them. See docs/embedded.md.

Decision: our own loop, not supervisord or circus: each must be the parent of every program
it watches from its own start, so it could not adopt the components ``up`` leaves running,
would replace the pid files, process groups and logs that ``up``, ``down``, ``status``, the
Celery shape and the tests use, and would need our health check as a plugin anyway.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from llm_batch.devstack.stack import Stack, read_json

POLL_S = 1.0
HEALTH_EVERY_S = 30.0
# A process that ran this long before dying is restarted at once; one that dies younger
# waits 1, 2, 4 ... BACKOFF_MAX_S seconds (a crash loop must not eat the machine).
STABLE_AFTER_S = 60.0
BACKOFF_MAX_S = 60.0
NOT_ANSWERING = "not answering"


@dataclass
class _Watch:
    pid: int | None = None
    proc: subprocess.Popen | None = None  # when the supervisor started it (its exit status)
    started_at: float = 0.0  # monotonic
    young_deaths: int = 0  # deaths in a row within STABLE_AFTER_S of their start
    down: str | None = None  # why it needs a start (None: running)
    due: float = 0.0  # not started again before (monotonic)
    record: bool = True  # False for the first start: not a restart


class Supervisor:
    def __init__(self, stack: Stack):
        self.stack = stack
        now = time.monotonic()
        self.watches = {name: _Watch(down="not running", due=now, record=False) for name in stack.supervised()}
        self.next_health = now + HEALTH_EVERY_S
        self.stopping = False

    def run(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._stop)
        _log(f"supervising {', '.join(self.watches)} (pid {os.getpid()})")
        while not self.stopping:
            try:
                self.poll(time.monotonic())
            except Exception:  # noqa: BLE001 (e.g. a start failing on a full disk: try again)
                _log(f"round failed:\n{traceback.format_exc()}")
            time.sleep(POLL_S)
        _log("stopped; the components keep running")

    def _stop(self, signum: int, frame: Any) -> None:
        self.stopping = True  # the round under way finishes: no half-started component

    def poll(self, now: float) -> None:
        """One round: notice deaths (and, every HEALTH_EVERY_S, hangs), start what is due."""
        for name, watch in self.watches.items():
            if watch.down is None and (reason := self._gone(name, watch, now)):
                self._note_down(watch, reason, now)
        if now >= self.next_health:
            self.next_health = now + HEALTH_EVERY_S
            for name in self.stack.not_answering(self.stack.running()):
                if name in self.watches and self.watches[name].down is None:
                    self._note_down(self.watches[name], NOT_ANSWERING, now)
        for name, watch in self.watches.items():
            if watch.down is not None and now >= watch.due and not self.stopping:
                self._start(name, watch, now)

    def _gone(self, name: str, watch: _Watch, now: float) -> str | None:
        """Why the watched process is not running, or None while it (or a successor that
        someone else started, which is adopted) runs."""
        status = watch.proc.poll() if watch.proc else None  # reaps it: its exit status
        pid = self.stack.pid_of(name)
        if pid and pid != watch.pid:  # up or a test started it anew
            self._adopt(watch, pid, now)
        if pid or (watch.proc and status is None):  # ours and alive without a pid file: never start two
            return None
        if watch.proc is None:
            return "exited (status unknown: not started by this supervisor)"
        return f"killed by {signal.Signals(-status).name}" if status < 0 else f"exited with status {status}"

    def _note_down(self, watch: _Watch, reason: str, now: float) -> None:
        young = now - watch.started_at < STABLE_AFTER_S
        watch.young_deaths = watch.young_deaths + 1 if young else 0
        delay = min(BACKOFF_MAX_S, 2.0 ** (watch.young_deaths - 1)) if watch.young_deaths else 0.0
        watch.down, watch.due, watch.record = reason, now + delay, True

    def _start(self, name: str, watch: _Watch, now: float) -> None:
        with self.stack.component_lock(name, blocking=False) as ours:
            if not ours:
                return  # someone is starting or stopping it: next round
            pid = self.stack.pid_of(name)
            if pid and pid != watch.pid:
                self._adopt(watch, pid, now)
                return
            # What is left of its process group (a dead scheduler's log server holds its port),
            # or the hung process itself.
            self.stack.stop_component(name)
            watch.proc = self.stack.launch(name)
        watch.pid, watch.started_at = watch.proc.pid, now
        if watch.record:
            count = record_restart(self.stack, name, watch.down)
            _log(f"{name}: {watch.down}; started again (pid {watch.pid}, restart {count})")
        else:
            _log(f"{name}: started (pid {watch.pid})")
        watch.down = None

    def _adopt(self, watch: _Watch, pid: int, now: float) -> None:
        watch.pid, watch.proc, watch.down, watch.started_at = pid, None, None, now


def read_restarts(stack: Stack) -> dict[str, dict[str, Any]]:
    """{name: {"restarts": n, "at": ISO time, "reason": ...}} of each process restarted since
    the stack's clean start."""
    return read_json(stack.restarts_file, {})


def record_restart(stack: Stack, name: str, reason: str) -> int:
    """Count one restart of `name` (only the supervisor writes the file); returns the count."""
    restarts = read_restarts(stack)
    count = restarts.get(name, {}).get("restarts", 0) + 1
    restarts[name] = {"restarts": count, "at": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"), "reason": reason}
    tmp = stack.restarts_file.with_suffix(".tmp")
    tmp.write_text(json.dumps(restarts, indent=1, sort_keys=True))
    os.replace(tmp, stack.restarts_file)
    return count


def describe_restarts(record: dict[str, Any] | None) -> str:
    """``1 restart, last 2026-12-01T10:00:03Z: killed by SIGKILL`` ('' for none)."""
    if not record:
        return ""
    n = record["restarts"]
    return f"{n} restart{'s' if n != 1 else ''}, last {record['at']}: {record['reason']}"


def _log(message: str) -> None:
    print(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {message}", flush=True)


def main(argv: list[str] | None = None) -> None:
    """``python -m llm_batch.devstack.supervisor module:StackClass`` (started by ``Stack.supervise``)."""
    module, _, qualname = (argv if argv is not None else sys.argv[1:])[0].partition(":")
    stack_class = getattr(importlib.import_module(module), qualname)
    Supervisor(stack_class.create()).run()


if __name__ == "__main__":
    main()
