"""Warm engines: long-lived engine processes that run the shards of many jobs in turn.

A shard normally starts an engine of its own (``llm-batch worker``); for a one-request shard
that start is nearly all of its time. With ``Settings.warm_engines`` the local runner hands
the shard to a warm engine instead: a process (``llm-batch engine-host``) per model
configuration and pool slot on the machine that keeps its vLLM engine between shards and
exits after ``warm_engine_idle_seconds`` without one.

A host runs one shard at a time with the same ``run_worker`` a dedicated worker uses, so the
shard's guarantees are the same: results resume after the shard's last published part
(a kill -9 of the host drops the task's connection, the attempt fails, and its retry
resumes: exactly once), cancel and deadline are read from the shard's own marker and
deadline, results go only to the shard's own URIs under the allowed roots. An engine
failure ends the host too, so the retry gets a fresh engine.

Protocol, over a Unix socket that only this user can open (mode 0600, in a 0700 folder):
the host greets each connection it accepts with ``{"host": pid}``; the client sends one JSON
line ``{"argv": [the worker's arguments]}``; the host answers ``{"log": line}`` lines while
the shard runs, then ``{"exit": code}``. The greeting is how a client tells a live host from
a killed one whose socket still takes connections: vLLM's engine processes are forked with
the listening socket, and until the last of them has died a connect succeeds, then is reset.
The client closing its end stops the shard at the next engine step (``StopReason.ABANDONED``).

Slots: a client holds its slot's lock (flock) while its shard runs, so one task uses a host
at a time; a host about to exit idle takes the same lock first, so no client connects to a
host that is leaving.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import select
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from llm_batch import exit_codes
from llm_batch.stack import _read_pid, _stop_group

if TYPE_CHECKING:
    from vllm import LLM

    from llm_batch.config import Settings
    from llm_batch.model_registry import ResolvedModel

log = logging.getLogger("llm_batch.warm_engines")

# A client waiting for a free slot (all held: a host leaving, or more tasks than slots, as
# when the next shard's task waits for its engine) tries again this often: the handover
# between two shards on one engine costs at most this.
SLOT_RETRY_S = 0.05
# How long a new host may take to open its socket (imports only: the engine loads with
# the first shard, inside the shard's own time).
HOST_START_S = 120.0
# The exit code a client reports when its host went away without answering (as a killed
# process would have).
HOST_GONE = -signal.SIGKILL
_LOGGERS = ("llm_batch", "vllm")


class WarmEngineError(RuntimeError):
    """A warm engine could not be reached or started."""


def engine_key(model_config: dict[str, Any]) -> str:
    """Shards whose model configurations are equal share engines."""
    return hashlib.sha256(orjson.dumps(model_config, option=orjson.OPT_SORT_KEYS)).hexdigest()[:16]


@dataclass(frozen=True)
class Slot:
    """One host's files: lock, pid and log in the home; its socket in a short private folder
    (a Unix socket's path must stay under ~100 bytes, and homes can be deep)."""

    home: Path
    key: str
    index: int

    @property
    def name(self) -> str:
        return f"{self.key}-{self.index}"

    @property
    def lock(self) -> Path:
        return engines_dir(self.home) / f"{self.name}.lock"

    @property
    def pid_file(self) -> Path:
        return engines_dir(self.home) / f"{self.name}.pid"

    @property
    def log(self) -> Path:
        return engines_dir(self.home) / f"{self.name}.log"

    @property
    def socket(self) -> Path:
        return socket_dir(self.home) / f"{self.name}.sock"


def engines_dir(home: Path) -> Path:
    path = home / "engines"
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    return path


def socket_dir(home: Path) -> Path:
    """``$TMPDIR/llm-batch-<uid>/<hash of the home>``, 0700 and ours (checked: a folder in a
    shared temp dir could have been made by someone else)."""
    base = Path(tempfile.gettempdir()) / f"llm-batch-{os.getuid()}"
    path = base / hashlib.sha256(str(home.resolve()).encode()).hexdigest()[:16]
    for folder in (base, path):
        folder.mkdir(mode=0o700, exist_ok=True)
        info = os.lstat(folder)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
            raise WarmEngineError(f"{folder} is not a private folder of this user: not using it for engine sockets")
    return path


# -- the client: the shard task's side ---------------------------------------------------------


class WarmShard:
    """A shard running on a warm engine, as the shard task supervises it: ``pid`` (the
    host's, a process-group leader), ``poll()``, ``wait()`` and ``returncode`` as on a
    ``Popen``; ``detach()`` stops the shard and leaves the host warm."""

    def __init__(self, conn: socket.socket, lock_fd: int, pid: int, on_line: Callable[[str], None]):
        self.pid = pid
        self.returncode: int | None = None
        self._conn = conn
        self._lock_fd = lock_fd
        self._on_line = on_line
        self._done = threading.Event()
        self._reader = threading.Thread(target=self._read, name="warm-engine-reader", daemon=True)
        self._reader.start()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired("warm engine shard", timeout or 0)
        assert self.returncode is not None
        return self.returncode

    def detach(self) -> None:
        """Close our end: the host stops the shard (flushing its finished results)."""
        try:
            self._conn.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _read(self) -> None:
        code = HOST_GONE
        try:
            with self._conn.makefile("rb") as stream:
                for raw in stream:
                    message = orjson.loads(raw)
                    if "exit" in message:
                        code = int(message["exit"])
                        break
                    self._on_line(str(message.get("log", "")))
        except (OSError, ValueError) as exc:
            self._on_line(f"lost the warm engine: {exc}")
        finally:
            self._conn.close()
            os.close(self._lock_fd)  # the slot is free again
            self.returncode = code
            self._done.set()


def start_shard(settings: Settings, model_config: dict[str, Any], worker_args: list[str],
                on_line: Callable[[str], None]) -> WarmShard:
    """Hand a shard (``worker_args``: ``ShardTask.worker_args()``) to a warm engine of its
    model on this machine, starting one if the free slot has none."""
    key = engine_key(model_config)
    slot, lock_fd = _take_slot(settings.home, key, max(1, settings.warm_engine_slots or settings.local_pool_slots))
    try:
        conn, pid = _connect(slot, settings)
        conn.sendall(orjson.dumps({"argv": worker_args}) + b"\n")
    except BaseException:
        os.close(lock_fd)
        raise
    on_line(f"shard on warm engine {slot.name} (pid {pid})")
    return WarmShard(conn, lock_fd, pid, on_line)


def _take_slot(home: Path, key: str, slots: int) -> tuple[Slot, int]:
    while True:
        for index in range(slots):
            slot = Slot(home, key, index)
            if (fd := _lock_now(slot.lock)) is not None:
                return slot, fd
        time.sleep(SLOT_RETRY_S)


def _connect(slot: Slot, settings: Settings) -> tuple[socket.socket, int]:
    """A connection to the slot's host (we hold the slot's lock, so nobody else starts one)."""
    if reached := _try_connect(slot):
        return reached
    slot.socket.unlink(missing_ok=True)  # a killed host's leftover
    _evict_idle(slot)
    host = _spawn_host(slot, settings)
    deadline = time.monotonic() + HOST_START_S
    while (reached := _try_connect(slot)) is None:
        if host.poll() is not None or time.monotonic() > deadline:
            host.kill()
            raise WarmEngineError(f"warm engine {slot.name} did not start (exit {host.poll()}); "
                                  f"its log: {slot.log}: {_tail(slot.log)}")
        time.sleep(0.2)
    return reached


def _evict_idle(starting: Slot, grace: float = 10.0) -> None:
    """Stop the idle hosts of other model configurations before a new one loads, so warm
    engines never hold more memory than the pool's slots of busy engines would (on a GPU an
    idle engine's KV cache would leave a new one no room). Idle: its slot lock is free."""
    for pid_file in engines_dir(starting.home).glob("*.pid"):
        if pid_file.stem.startswith(f"{starting.key}-") or not (pid := _read_pid(pid_file)):
            continue
        if (fd := _lock_now(pid_file.with_suffix(".lock"))) is None:
            continue  # busy: it serves a shard
        try:  # holding its lock: no client can reach it meanwhile
            log.info("stopping idle warm engine %s (pid %d) to make room", pid_file.stem, pid)
            _stop_group(pid, grace)
            pid_file.unlink(missing_ok=True)
        finally:
            os.close(fd)


def _try_connect(slot: Slot) -> tuple[socket.socket, int] | None:
    """A connection to a live host and its pid (from its greeting), or None: no socket, or
    the socket of a killed host (reset, or closed, before a greeting)."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(str(slot.socket))
        # No timeout: a live host greets once it has finished the shard a task abandoned.
        with conn.makefile("rb") as stream:
            return conn, int(orjson.loads(stream.readline())["host"])
    except (OSError, ValueError, KeyError, TypeError):
        conn.close()
        return None


def _spawn_host(slot: Slot, settings: Settings) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "llm_batch.cli", "engine-host", "--socket", str(slot.socket),
               "--lock", str(slot.lock), "--pid-file", str(slot.pid_file),
               "--idle-seconds", str(settings.warm_engine_idle_seconds)]
    log.info("starting warm engine %s: %s", slot.name, " ".join(command))
    with open(slot.log, "ab") as out:
        # Its own session: it outlives the task that started it, and a kill reaches the
        # engine processes vLLM may spawn.
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, cwd=settings.home)


def stop_hosts(home: Path, grace: float = 10.0) -> None:
    """Stop every warm engine of ``home`` (``llm-batch down``)."""
    folder = home / "engines"
    for pid_file in folder.glob("*.pid") if folder.is_dir() else ():
        if pid := _read_pid(pid_file):
            _stop_group(pid, grace)
        pid_file.unlink(missing_ok=True)


# -- the host ------------------------------------------------------------------------------------


class KeptEngine:
    """The host's engine source for ``run_worker``: the engine stays loaded between shards
    (started again for a shard of another configuration); a failure discards it."""

    def __init__(self) -> None:
        self.llm: LLM | None = None
        self._args: dict[str, Any] | None = None
        self.broken = False

    def get(self, model: ResolvedModel) -> LLM:
        from llm_batch.engine.runner import start_engine

        if self.llm is not None and self._args != model.engine_args:
            self.close()
        if self.llm is None:
            self.llm, self._args = start_engine(model), model.engine_args
        else:
            log.info("warm engine: model %s already loaded", model.name)
        return self.llm

    def release(self, llm: LLM, healthy: bool) -> None:
        if not healthy:
            self.broken = True
            self.close()

    def close(self) -> None:
        from llm_batch.engine.runner import stop_engine

        if self.llm is not None:
            stop_engine(self.llm)
        self.llm = self._args = None


def serve(socket_path: Path, lock: Path, pid_file: Path, idle_seconds: float) -> int:
    """The host's loop: one shard per connection until idle or broken."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    socket_path.unlink(missing_ok=True)
    listener.bind(str(socket_path))
    os.chmod(socket_path, 0o600)
    listener.listen(4)
    listener.settimeout(1.0)
    pid_file.write_text(str(os.getpid()))
    engine = KeptEngine()
    idle_since = time.monotonic()
    log.info("warm engine listening on %s (exits after %.0f s idle)", socket_path, idle_seconds)
    try:
        while not engine.broken:
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                # The lock is kept (held until exit): no client is using or entering us.
                if time.monotonic() - idle_since >= idle_seconds and _lock_now(lock) is not None:
                    log.info("warm engine idle for %.0f s: exiting", idle_seconds)
                    break
                continue
            with conn:
                conn.settimeout(None)
                _ConnectionLog(conn).send({"host": os.getpid()})
                _serve_shard(conn, engine)
            idle_since = time.monotonic()
    finally:
        listener.close()
        socket_path.unlink(missing_ok=True)
        pid_file.unlink(missing_ok=True)
        engine.close()
    return 0


def _serve_shard(conn: socket.socket, engine: KeptEngine) -> None:
    from llm_batch.commands.worker import config_from_argv
    from llm_batch.worker import WorkerUsageError, run_worker

    forward = _ConnectionLog(conn)
    loggers = [logging.getLogger(name) for name in _LOGGERS]
    for logger in loggers:
        logger.addHandler(forward)
    try:
        with conn.makefile("rb") as stream:
            line = stream.readline()
        try:
            config = config_from_argv(orjson.loads(line)["argv"])
        except (WorkerUsageError, ValueError, KeyError, TypeError) as exc:
            log.error("not a shard: %s", exc)
            code = exit_codes.USAGE
        else:
            code = run_worker(config, engine, supervisor_gone=lambda: _peer_closed(conn))
    finally:
        for logger in loggers:
            logger.removeHandler(forward)
    forward.send({"exit": code})


class _ConnectionLog(logging.Handler):
    """The shard's log records, to the task that asked for it (its task log)."""

    def __init__(self, conn: socket.socket):
        super().__init__(logging.INFO)
        self.conn = conn
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        self.send({"log": self.format(record)})

    def send(self, message: dict[str, Any]) -> None:
        try:
            self.conn.sendall(orjson.dumps(message) + b"\n")
        except OSError:
            pass  # the client has gone: the stop check sees it


def _peer_closed(conn: socket.socket) -> bool:
    """The client sends nothing after its request, so readable means closed."""
    try:
        readable, _, _ = select.select([conn], [], [], 0)
        return bool(readable) and conn.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


def _lock_now(path: Path) -> int | None:
    """A slot's lock taken without waiting (its open descriptor holds it), or None if held."""
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd
    except BlockingIOError:
        os.close(fd)
        return None


def _tail(path: Path, chars: int = 600) -> str:
    try:
        return path.read_text(errors="replace")[-chars:].strip()
    except OSError:
        return ""
