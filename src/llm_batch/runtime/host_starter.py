"""Start warm engine hosts by forking a process that has imported vLLM already.

A host started as a fresh interpreter spends ~13 s of CPU importing vLLM, torch and
transformers before it loads its model (~4 s): most of a cold warm engine's start. A starter
(one per home and import-time environment, ``python -m llm_batch.runtime.host_starter``)
imports them once, then forks each host it is asked for; the child sets the requested
environment and working folder, starts its own session (a kill of its group reaches only it)
and runs ``llm-batch engine-host``. vLLM forks its own engine processes from the same state (imported,
no engine, no accelerator touched), which is why this is safe.

Protocol, over a Unix socket only this user can open: the client sends one line, a
``StartRequest`` (``{"argv": [...], "env": {...}, "cwd": path, "log": path}``); the starter
answers ``{"pid": pid}``, or closes the connection on a request it cannot run. A starter
exits after ``idle_seconds`` without a request; the hosts it forked live on (their own
sessions). ``multiprocessing``'s forkserver is the library version of this, but it lives and
dies with the one process that started it, and each Airflow task is a process of its own.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import importlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from contextlib import suppress
from pathlib import Path

import orjson
from pydantic import BaseModel, ConfigDict, Field

from llm_batch.core.config import get_settings
from llm_batch.infra.processes import alive, read_pid, signal_group

log = logging.getLogger("llm_batch.runtime.host_starter")

# How long a new starter may take to import vLLM and listen.
STARTER_START_S = 120.0
# The variables a starter is keyed by: those read as vLLM, torch and the hubs are imported
# (threads, caches, vLLM's own, the interpreter's paths), which its hosts must share. The
# others are read at run time, from the host's own environment, or only by exec (LD_*), and
# vary from task to task (an Airflow task's context; what vLLM's import and engines set in a
# process that ran one), so keying by them would start a starter per task.
_IMPORT_TIME = ("OMP_", "MKL_", "OPENBLAS_", "GOMP_", "VLLM_", "HF_", "HUGGINGFACE_", "TRANSFORMERS_", "CUDA_",
                "TORCH_HOME", "PYTHON", "PATH", "VIRTUAL_ENV", "HOME", "XDG_", "TMPDIR")
# What a host imports before its first shard; a starter imports it once for all of them.
PRELOAD = ("llm_batch.runtime.engine.runner", "llm_batch.runtime.worker", "llm_batch.cli.main",
           "llm_batch.cli.engine_service", "llm_batch.cli.worker")


class StartedHost:
    """A host the starter forked: ``poll()`` and ``kill()`` as on a ``Popen`` (it is not our
    child, so its exit code is unknown: ``-1`` once gone)."""

    def __init__(self, pid: int):
        self.pid = pid

    def poll(self) -> int | None:
        return None if alive(self.pid) else -1

    def kill(self) -> None:
        signal_group(self.pid, signal.SIGKILL)


def starter_key(env: dict[str, str]) -> str:
    """A starter per environment of what is read at import time (``_IMPORT_TIME``)."""
    kept = sorted((name, value) for name, value in env.items() if name.startswith(_IMPORT_TIME))
    return hashlib.sha256(orjson.dumps(kept)).hexdigest()[:16]


def start_host(starters: Path, sockets: Path, argv: list[str], env: dict[str, str], cwd: Path, log_path: Path,
               idle_seconds: float, preload: tuple[str, ...] = PRELOAD) -> StartedHost:
    """Fork ``llm-batch <argv>`` from the starter of ``env`` (``starters``: its lock, pid and
    log files; ``sockets``: a private folder for its socket), starting the starter first if
    none is up (importing ``preload``, and exiting after ``idle_seconds`` without a request).
    OSError when no starter could be reached."""
    key = starter_key(env)
    path = sockets / f"starter-{key}.sock"
    request = StartRequest(argv=argv, env=env, cwd=str(cwd), log=str(log_path)).model_dump_json().encode() + b"\n"
    starters.mkdir(parents=True, exist_ok=True, mode=0o700)
    lock = os.open(starters / f"{key}.lock", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one starter per key, however many clients start hosts at once
        conn = _connect(path) or _start_starter(path, starters / f"{key}.pid", starters / f"{key}.log", env,
                                                idle_seconds, preload)
    finally:
        os.close(lock)
    with conn:
        try:
            conn.sendall(request)
            conn.settimeout(STARTER_START_S)
            with conn.makefile("rb") as answer:
                return StartedHost(int(orjson.loads(answer.readline())["pid"]))
        except (ValueError, KeyError, TypeError) as exc:  # it went idle as we came, or could not fork
            raise OSError(f"the host starter gave no pid: {exc!r}") from None


def _connect(path: Path) -> socket.socket | None:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(str(path))
        return conn
    except OSError:
        conn.close()
        return None


def _start_starter(path: Path, pid_file: Path, log_path: Path, env: dict[str, str], idle_seconds: float,
                   preload: tuple[str, ...]) -> socket.socket:
    path.unlink(missing_ok=True)  # a killed starter's leftover
    command = [sys.executable, "-m", "llm_batch.runtime.host_starter", "--socket", str(path), "--pid-file",
               str(pid_file), "--idle-seconds", str(idle_seconds)]
    for name in preload:
        command += ["--preload", name]
    with open(log_path, "ab") as out:
        starter = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   start_new_session=True, env=env)
    deadline = time.monotonic() + STARTER_START_S
    while (conn := _connect(path)) is None:
        if starter.poll() is not None or time.monotonic() > deadline:
            starter.kill()
            raise OSError(f"the host starter did not start (exit {starter.poll()}); its log: {log_path}")
        time.sleep(0.2)
    return conn


# -- the starter ---------------------------------------------------------------------------------


def serve(path: Path, pid_file: Path, idle_seconds: float, preload: tuple[str, ...] = PRELOAD) -> int:
    for name in preload:
        importlib.import_module(name)
    # Forked hosts are not waited for here: the kernel reaps them (reset in each child).
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    path.unlink(missing_ok=True)
    listener.bind(str(path))
    os.chmod(path, 0o600)
    listener.listen(16)
    listener.settimeout(1.0)
    pid_file.write_text(str(os.getpid()))
    log.info("host starter listening on %s (exits after %.0f s without a request)", path, idle_seconds)
    last = time.monotonic()
    try:
        while time.monotonic() - last < idle_seconds:
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            last = time.monotonic()
            with conn:
                conn.settimeout(10.0)
                try:
                    with conn.makefile("rb") as lines:
                        request = StartRequest.model_validate_json(lines.readline())
                    pid = _fork_host(listener, conn, request)
                except (OSError, ValueError) as exc:  # pydantic's ValidationError is a ValueError
                    log.warning("a bad start request: %r", exc)
                    continue
                with suppress(OSError):
                    conn.sendall(orjson.dumps({"pid": pid}) + b"\n")
    finally:
        listener.close()
        with suppress(OSError):
            if read_pid(pid_file) == os.getpid():
                pid_file.unlink()
                path.unlink()
    log.info("host starter idle for %.0f s: exiting", idle_seconds)
    return 0


class StartRequest(BaseModel):
    """What a client asks a starter for: a host's ``llm-batch`` arguments, environment,
    working folder and log file."""

    model_config = ConfigDict(extra="forbid", strict=True)

    argv: list[str] = Field(min_length=1)
    env: dict[str, str]
    cwd: str
    log: str


def _fork_host(listener: socket.socket, conn: socket.socket, request: StartRequest) -> int:
    argv, env, cwd = request.argv, request.env, request.cwd
    out = os.open(request.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        pid = os.fork()
    except OSError:
        os.close(out)
        raise
    if pid:
        os.close(out)
        log.info("started host pid %d: llm-batch %s", pid, " ".join(argv))
        return pid
    code = 1
    try:  # the child: never back into the starter's loop
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        listener.close()
        conn.close()
        os.setsid()
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(null)
        os.close(out)
        os.chdir(cwd)
        _title(argv)  # before the environment changes: setproctitle finds its room through it
        os.environ.clear()
        os.environ.update(env)
        get_settings.cache_clear()  # the host's settings come from its own environment
        sys.argv = ["llm-batch", *argv]
        # As `python -m llm_batch.cli.main <argv>` would (by name: the CLI is the layer above).
        code = importlib.import_module("llm_batch.cli.main").main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    except BaseException:  # noqa: BLE001 - the child reports and exits; nothing may return to the loop
        traceback.print_exc()
    finally:
        with suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
            logging.shutdown()
        os._exit(code)


def _title(argv: list[str]) -> None:
    """What ps shows for the host: its command, not the starter's (setproctitle comes with
    Airflow, where warm engines run)."""
    try:
        from setproctitle import setproctitle  # optional
    except ImportError:
        return
    setproctitle(" ".join([sys.executable, "-m", "llm_batch.cli.main", *argv]))


def _main() -> int:
    parser = argparse.ArgumentParser(prog="python -m llm_batch.runtime.host_starter", description=__doc__.splitlines()[0])
    parser.add_argument("--socket", type=Path, required=True)
    parser.add_argument("--pid-file", type=Path, required=True)
    parser.add_argument("--idle-seconds", type=float, default=300.0)
    parser.add_argument("--preload", action="append", metavar="MODULE",
                        help="a module to import before forking, once per module (default: what a host imports)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return serve(args.socket, args.pid_file, args.idle_seconds, tuple(args.preload or PRELOAD))


if __name__ == "__main__":
    sys.exit(_main())
