"""Warm engines: long-lived engine processes (``llm-batch engine-host``) that run the shards
of many jobs in turn, one per model configuration and pool slot on the machine, each shard
with the same ``run_worker`` as a dedicated worker (docs/worker.md, "Warm engines").

Protocol, over a Unix socket only this user can open: the host greets each connection with
``{"host": pid}`` (how a client tells a live host from a killed one whose vLLM processes
still hold the socket); the client sends one line ``{"argv": [the worker's arguments]}``;
the host answers ``{"log": line}`` lines, then ``{"exit": code}``. The client closing its end
stops the shard (``StopReason.ABANDONED``). A client holds a seat's lock (flock) while its
shard runs and the slot's lock while it reaches or starts the host; a host about to exit
idle takes every seat's lock first.

Engine services: the same host on TCP (``serve_service``), a Deployment per model and GPU
type (``llm-batch engine-service manifest``) whose pods take the small shards of many jobs
(``service_for``); the request line carries the service's token too, and the host keeps the
seats itself. Trust: the token (``LLM_BATCH_ENGINE_TOKEN``), the model it serves, the host's
own allowed roots; the connection is not encrypted (docs/orchestration.md, "Engine services").
"""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import logging
import math
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
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from llm_batch.core import exit_codes
from llm_batch.core.config import Settings, parse_address
from llm_batch.core.model_config import engine_fields
from llm_batch.infra.log_context import LOG_FORMAT, JobIdFilter, bind_job
from llm_batch.infra.processes import read_pid, stop_group, stop_recorded
from llm_batch.runtime.host_starter import StartedHost, start_host

if TYPE_CHECKING:
    from vllm import LLM

    from llm_batch.infra.model_resolution import ResolvedModel
    from llm_batch.pipeline.shard_task import ShardTask

log = logging.getLogger("llm_batch.runtime.warm_engines")

# How often a client waiting for a free seat tries again: the most a handover between two
# shards on one engine costs.
SLOT_RETRY_S = 0.05
# How long a new host may take to open its socket (the engine loads with the first shard).
HOST_START_S = 120.0
# A client's exit code when its host went away without answering (as if killed).
HOST_GONE = -signal.SIGKILL
_LOGGERS = ("llm_batch", "vllm")
# Engine services (TCP): the most a request line may hold, how soon after the greeting it
# must arrive, and how long a send to a client that stopped reading may block.
MAX_REQUEST_BYTES = 1 << 20
REQUEST_TIMEOUT_S = 10.0
SEND_TIMEOUT_S = 30.0
# Connections a service holds beyond its seats; more are turned away, and their tasks retry.
MAX_WAITING = 32
SERVICE_CONNECT_S = 10.0
DEFAULT_PORT = 8700


class WarmEngineError(RuntimeError):
    pass


# The environment (inherited from the starting task) a host's shards run under.
HOST_ENVIRONMENT = ("LLM_BATCH_", "VLLM_", "AWS_", "HF_", "TRANSFORMERS_")
# Set at run time in a process that ran an engine (vLLM: its IPC names, fresh per engine) or
# prepared a model (llm-batch: offline hubs): they describe that process, not a host's shards,
# so a host started from it neither inherits them (another engine's shared-memory names) nor
# is keyed by them (each would key a new host of the same configuration).
SET_BY_ENGINES = frozenset({"VLLM_DIST_IDENT", "VLLM_OBJECT_STORAGE_SHM_BUFFER_NAME", "VLLM_WORKER_MULTIPROC_METHOD",
                            "VLLM_DISABLE_SHARED_EXPERTS_STREAM", "VLLM_ENABLE_V1_MULTIPROCESSING",
                            "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"})


def host_environment(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The variables of ``environ`` (default this process's) a host is started with."""
    environ = os.environ if environ is None else environ
    return {name: value for name, value in environ.items() if name not in SET_BY_ENGINES}


def engine_key(model_config: dict[str, Any], environ: dict[str, str] | None = None, lora: bool = False) -> str:
    """Shards of equal model configurations (their ``engine_fields``: labels, say, load nothing)
    and host environments (``HOST_ENVIRONMENT`` of ``host_environment(environ)``) share engines:
    none runs on a host of an older one.
    Shards whose lines name adapters (``lora``: the engine has LoRA on) have hosts of their own,
    so a job's base and adapter shards run at once, neither reloading the other's engine."""
    host_env = {name: value for name, value in host_environment(environ).items() if name.startswith(HOST_ENVIRONMENT)}
    identity = {"model_config": engine_fields(model_config), "environment": host_env} | ({"lora": True} if lora else {})
    return hashlib.sha256(orjson.dumps(identity, option=orjson.OPT_SORT_KEYS)).hexdigest()[:16]


@dataclass(frozen=True)
class Slot:
    """One host's files: lock, pid and log in the home; its socket in a short private folder
    (a Unix socket's path must stay under ~100 bytes)."""

    home: Path
    key: str
    index: int

    @property
    def name(self) -> str:
        return f"{self.key}-{self.index}"

    @property
    def lock(self) -> Path:
        return engines_dir(self.home) / f"{self.name}.lock"

    def seat_locks(self, seats: int) -> list[Path]:
        return [engines_dir(self.home) / f"{self.name}.seat{seat}.lock" for seat in range(seats)]

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


def starters_dir(home: Path) -> Path:
    """The host starters' lock, pid and log files (a folder of their own: not a slot's)."""
    return home / "engines" / "starters"


def socket_dir(home: Path) -> Path:
    """``$TMPDIR/llm-batch-<uid>/<hash of the home>``, 0700 and ours (checked: someone else
    could have made it in a shared temp dir)."""
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
    """A shard on a warm engine, as its task supervises it: ``pid`` (the local host's; None
    for an engine service), ``poll()``, ``wait()`` and ``returncode`` as on a ``Popen``;
    ``detach()`` stops the shard and leaves the host warm."""

    def __init__(self, conn: socket.socket, seat_fd: int | None, pid: int | None, on_line: Callable[[str], None]):
        self.pid = pid
        self.returncode: int | None = None
        self._conn = conn
        self._seat_fd = seat_fd
        self._on_line = on_line
        self._reader = threading.Thread(target=self._read, name="warm-engine-reader", daemon=True)
        self._reader.start()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._reader.join(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired("warm engine shard", timeout or 0)
        return self.returncode

    def detach(self) -> None:
        """The host stops the shard (flushing its finished results)."""
        with suppress(OSError):
            self._conn.shutdown(socket.SHUT_RDWR)

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
            if self._seat_fd is not None:
                os.close(self._seat_fd)  # the seat is free again
            self.returncode = code


def start_shard(settings: Settings, model_config: dict[str, Any], worker_args: list[str],
                on_line: Callable[[str], None], lora: bool = False) -> WarmShard:
    """Hand a shard (``ShardTask.worker_args()``) to a warm engine of its model on this
    machine (one with LoRA on for a shard whose lines name adapters: ``lora``), starting one
    if the free slot has none."""
    key = engine_key(model_config, lora=lora)
    engines = max(1, settings.warm_engine_slots or settings.local_pool_slots)
    slot, seat, seat_fd = _take_seat(settings.home, key, engines, settings.warm_engine_seats)
    try:
        with _holding(slot.lock):  # nobody else starts the slot's host meanwhile
            conn, pid = _try_connect(slot) or _start_host(slot, settings)
            with suppress(OSError):  # used now: the last configuration another one evicts
                os.utime(slot.pid_file)
        conn.sendall(orjson.dumps({"argv": worker_args}) + b"\n")
    except BaseException:
        os.close(seat_fd)
        raise
    on_line(f"shard on warm engine {slot.name}, seat {seat} (pid {pid})")
    return WarmShard(conn, seat_fd, pid, on_line)


def prewarm(settings: Settings, model_config: dict[str, Any], lora: bool = False) -> bool:
    """Start the warm engine a job's first shard will take (the first slot of its model, as
    ``_take_seat`` tries first; ``lora``: one with LoRA on), loading ``model_config`` at once,
    so that a cold start overlaps the job's planning and scheduling; takes no seat. False: a
    host is up already."""
    slot = Slot(settings.home, engine_key(model_config, lora=lora), 0)
    with _holding(slot.lock):
        reached = _try_connect(slot)
        (reached or _start_host(slot, settings, preload=model_config, lora=lora))[0].close()
    return reached is None


def service_for(task: ShardTask, settings: Settings) -> tuple[str, int] | None:
    """The engine service that takes this shard, or None (it gets a pod of its own)."""
    if not settings.engine_services or task.nodes_per_worker != 1:
        return None
    if task.requests is None or task.requests > settings.engine_service_max_requests:
        return None
    model = str(orjson.loads(task.model_config_json).get("model", ""))
    address = settings.engine_services.get(f"{model}@{task.gpu_type}") or settings.engine_services.get(model)
    return parse_address(address) if address else None


def start_service_shard(address: tuple[str, int], token: str, worker_args: list[str],
                        on_line: Callable[[str], None]) -> WarmShard:
    """Hand a shard to the engine service at ``address``; it keeps the seats, so a shard
    waiting for one there waits in ``wait()`` like a running one."""
    where = f"{address[0]}:{address[1]}"
    conn: socket.socket | None = None
    try:
        conn = socket.create_connection(address, timeout=SERVICE_CONNECT_S)
        _keep_alive(conn)
        pid = int(_read_message(conn)["host"])
        conn.sendall(orjson.dumps({"token": token, "argv": worker_args}) + b"\n")
        conn.settimeout(None)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        if conn is not None:
            conn.close()
        raise WarmEngineError(f"engine service {where} could not be reached: {exc!r}") from None
    on_line(f"shard on engine service {where} (host pid {pid} there)")
    return WarmShard(conn, None, None, on_line)


def _keep_alive(conn: socket.socket) -> None:
    """TCP keepalive: a peer that vanished (a node lost) is noticed within about a minute."""
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, option):
            conn.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


def _take_seat(home: Path, key: str, engines: int, seats: int) -> tuple[Slot, int, int]:
    """A free seat (slot, seat, its lock's descriptor): an idle engine's first."""
    slots = [Slot(home, key, index) for index in range(engines)]
    locks = [slot.seat_locks(seats) for slot in slots]  # once: the wait below polls
    while True:
        for seat in range(seats):
            for slot, seat_locks in zip(slots, locks):
                if (fd := _lock_now(seat_locks[seat])) is not None:
                    return slot, seat, fd
        time.sleep(SLOT_RETRY_S)


@contextmanager
def _holding(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _start_host(slot: Slot, settings: Settings, preload: dict[str, Any] | None = None,
                lora: bool = False) -> tuple[socket.socket, int]:
    """Start the slot's host (its lock held) and connect; it loads ``preload`` (a model_config;
    with LoRA on: ``lora``) before any shard asks."""
    slot.socket.unlink(missing_ok=True)  # a killed host's leftover
    _evict_idle(slot, settings.warm_engine_seats, settings.warm_engine_configs)
    host = _spawn_host(slot, settings, preload, lora)
    deadline = time.monotonic() + HOST_START_S
    while (reached := _try_connect(slot)) is None:
        if host.poll() is not None or time.monotonic() > deadline:
            host.kill()
            raise WarmEngineError(f"warm engine {slot.name} did not start (exit {host.poll()}); "
                                  f"its log: {slot.log}: {_tail(slot.log)}")
        time.sleep(0.2)
    return reached


def _evict_idle(starting: Slot, seats: int, configs: int = 1, grace: float = 10.0) -> None:
    """Stop idle hosts (all seats free) of other model configurations, the least recently
    used configuration first (its pid file's time: its start or its last shard's), until the
    new one makes at most ``configs`` warm."""
    warm: dict[str, list[tuple[Path, int, int]]] = {}  # key -> (pid file, slot index, pid)
    used: dict[str, float] = {}
    for pid_file in engines_dir(starting.home).glob("*.pid"):
        key, _, index = pid_file.stem.rpartition("-")
        with suppress(OSError):
            if key != starting.key and (pid := read_pid(pid_file)):
                used[key] = max(used.get(key, 0.0), pid_file.stat().st_mtime)
                warm.setdefault(key, []).append((pid_file, int(index), pid))
    for key in sorted(warm, key=used.__getitem__):
        if len(warm) < configs:
            return
        hosts = warm[key]
        for pid_file, index, pid in list(hosts):
            if (fds := _lock_all(Slot(starting.home, key, index).seat_locks(seats))) is None:
                continue  # busy: it serves a shard
            try:  # holding its seats: no client can reach it meanwhile
                log.info("stopping idle warm engine %s (pid %d) to make room", pid_file.stem, pid)
                stop_group(pid, grace)
                pid_file.unlink(missing_ok=True)
                hosts.remove((pid_file, index, pid))
            finally:
                for fd in fds:
                    os.close(fd)
        if not hosts:
            del warm[key]


def _try_connect(slot: Slot) -> tuple[socket.socket, int] | None:
    """A connection to a live host and its pid (from its greeting), or None: no socket, or
    a killed host's (reset before a greeting)."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(str(slot.socket))
        # No timeout: a live host greets at once, a broken one has closed its socket.
        return conn, int(_read_message(conn)["host"])
    except (OSError, ValueError, KeyError, TypeError):
        conn.close()
        return None


def _spawn_host(slot: Slot, settings: Settings, preload: dict[str, Any] | None = None,
                lora: bool = False) -> subprocess.Popen[bytes] | StartedHost:
    argv = ["engine-host", "--socket", str(slot.socket), "--pid-file", str(slot.pid_file),
            "--idle-seconds", str(settings.warm_engine_idle_seconds)]
    if preload is not None:
        argv += ["--preload", orjson.dumps(preload).decode(), *(["--preload-lora"] if lora else [])]
    for seat_lock in slot.seat_locks(settings.warm_engine_seats):
        argv += ["--lock", str(seat_lock)]
    log.info("starting warm engine %s: llm-batch %s", slot.name, " ".join(argv))
    if settings.warm_engine_starter:
        try:
            return start_host(starters_dir(slot.home), socket_dir(slot.home), argv, host_environment(), settings.home,
                              slot.log, settings.warm_engine_idle_seconds)
        except OSError as exc:
            log.warning("no host starter (%s): starting the host as a fresh process", exc)
    with open(slot.log, "ab") as out:
        # Its own session: it outlives its task, and a kill reaches vLLM's processes.
        return subprocess.Popen([sys.executable, "-m", "llm_batch.cli.main", *argv], stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                cwd=settings.home, env=host_environment())


def stop_hosts(home: Path, grace: float = 10.0, key: str | None = None) -> None:
    """Stop every warm engine of ``home`` and their starters (``llm-batch down``), or only
    the engines of the configuration ``key`` (``engine_key``: its slots)."""
    hosts = (home / "engines").glob(f"{key}-*.pid" if key else "*.pid")  # none if never made
    for pid_file in [*hosts, *(starters_dir(home).glob("*.pid") if key is None else [])]:  # the starters last
        stop_recorded(pid_file, grace)


# -- the host ------------------------------------------------------------------------------------


class KeptEngine:
    """The host's engine source for ``run_worker``: kept loaded between shards and shared by
    those running at once; reloaded for another configuration once they have ended;
    discarded after a failure once no shard uses it."""

    def __init__(self) -> None:
        self.shared: SharedEngine | None = None
        self._args: dict[str, Any] | None = None
        self.broken = False
        self._users = 0
        self._turn = threading.Condition()

    def get(self, model: ResolvedModel) -> LLM:
        from llm_batch.runtime.engine.runner import start_engine  # vllm

        with self._turn:
            # Another configuration of the model (another endpoint's task) waits for its turn.
            while self._users and self._args != model.engine_args:
                self._turn.wait()
            if self.broken:
                raise WarmEngineError("this warm engine failed and takes no more shards")
            if self.shared is not None and self._args != model.engine_args:
                self._close()
            if self.shared is None:
                self.shared, self._args = SharedEngine(start_engine(model)), model.engine_args
            else:
                log.info("warm engine: model %s already loaded", model.name)
            self._users += 1
            return self.shared.for_shard()

    def release(self, llm: LLM, healthy: bool) -> None:
        llm.llm_engine.close()
        with self._turn:
            self._users -= 1
            self.broken |= not healthy
            if self.broken and not self._users:
                self._close()
            self._turn.notify_all()

    def close(self) -> None:
        with self._turn:
            self._close()

    def _close(self) -> None:
        if self.shared is not None:
            from llm_batch.runtime.engine.runner import stop_engine  # vllm

            with self.shared.lock:
                stop_engine(self.shared.llm)
        self.shared = self._args = None


class SharedEngine:
    """One vLLM engine stepped by several shards' threads, each through its ``EngineView``
    under one lock: a step's finished outputs go to their shard's box (by the request id's
    prefix, unique per runner), and a shard whose box holds outputs gets them without a step."""

    def __init__(self, llm: LLM):
        self.llm = llm
        self.lock = threading.RLock()
        self.boxes: dict[str, list[Any]] = {}

    def for_shard(self) -> LLM:
        return _ShardLLM(self.llm, EngineView(self))  # type: ignore[return-value]

    def step(self) -> None:
        """One engine step (the caller holds the lock)."""
        for output in self.llm.llm_engine.step():
            if output.finished and (box := self.boxes.get(_id_prefix(output.request_id))) is not None:
                box.append(output)


class EngineView:
    """``LLM.llm_engine`` as one shard's ``EngineRunner`` sees it."""

    def __init__(self, shared: SharedEngine):
        self._shared = shared
        self._engine = shared.llm.llm_engine
        self._box: list[Any] = []
        self._prefixes: set[str] = set()
        # The runner feeds under it (rendering uses the tokenizer the steps use too).
        self.submit_lock = shared.lock

    def add_request(self, request_id: str, prompt: Any, params: Any, lora_request: Any = None) -> None:
        with self._shared.lock:
            prefix = _id_prefix(request_id)
            if prefix not in self._prefixes:
                self._prefixes.add(prefix)
                self._shared.boxes[prefix] = self._box
            self._engine.add_request(request_id, prompt, params, lora_request=lora_request)

    def step(self) -> list[Any]:
        """This shard's finished outputs: those an earlier step left, else one more step's."""
        with self._shared.lock:
            if not self._box:
                self._shared.step()
            outputs, self._box[:] = list(self._box), []
            return outputs

    def abort_request(self, request_ids: list[str]) -> None:
        with self._shared.lock:
            self._engine.abort_request(request_ids)

    def close(self) -> None:
        """The shard has ended: outputs of its aborted requests are dropped from now on."""
        with self._shared.lock:
            for prefix in self._prefixes:
                self._shared.boxes.pop(prefix, None)
            self._box.clear()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


class _ShardLLM:
    def __init__(self, llm: LLM, view: EngineView):
        self._llm = llm
        self.llm_engine = view

    def __getattr__(self, name: str) -> Any:
        return getattr(self._llm, name)


def _id_prefix(request_id: str) -> str:
    return request_id.partition("-")[0]


def serve(socket_path: Path, seat_locks: list[Path], pid_file: Path, idle_seconds: float,
          preload: dict[str, Any] | None = None, preload_lora: bool = False) -> int:
    """The host's loop: each connection's shard in a thread of its own, until idle or broken.
    ``preload``: a model_config to load once listening (a shard arriving meanwhile waits for
    it), with LoRA on as adapter shards will want it (``preload_lora``)."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    socket_path.unlink(missing_ok=True)
    listener.bind(str(socket_path))
    os.chmod(socket_path, 0o600)
    bound = os.stat(socket_path).st_ino
    listener.listen(len(seat_locks) + 4)
    pid_file.write_text(str(os.getpid()))
    engine = KeptEngine()
    log.info("warm engine listening on %s, %d seat(s) (exits after %.0f s idle)", socket_path, len(seat_locks),
             idle_seconds)
    loading = [] if preload is None else [threading.Thread(target=_preload_quietly, args=(engine, preload, preload_lora),
                                                           daemon=True, name="preload")]
    for thread in loading:
        thread.start()
    try:
        # Broken: take no more shards (a client starts a new host), let the running ones end.
        _accept_shards(listener, engine, _Door(), idle_seconds, seat_locks, running=loading)
    finally:
        _unlink_if(socket_path, lambda: os.stat(socket_path).st_ino == bound)
        _unlink_if(pid_file, lambda: read_pid(pid_file) == os.getpid())
        engine.close()
    return 0


def serve_service(address: tuple[str, int], seats: int, token: str, model: str,
                  preload: dict[str, Any] | None = None) -> int:
    """An engine service's loop (``llm-batch engine-host --listen``): shards of ``model``
    from clients holding ``token``, at most ``seats`` at once, while the engine is healthy;
    exits 1 once it is broken and its shards have ended (its Deployment starts a fresh one).
    ``preload``: model_config overrides to load before listening (a pod ready only when warm)."""
    if not token:
        raise WarmEngineError("an engine service needs a token (LLM_BATCH_ENGINE_TOKEN): refusing to listen without one")
    engine, door = KeptEngine(), _Door(token, model, seats)
    if preload is not None:
        _preload(engine, {**preload, "model": model})
    listener = socket.create_server(address, backlog=seats + 4)
    # SIGTERM (a rollout): stop the running shards as if their tasks had left, so their
    # retries resume on another pod instead of waiting out this one's grace period.
    signal.signal(signal.SIGTERM, lambda *_: door.closing.set())
    log.info("engine service for model %s listening on %s:%d, %d seat(s)", model, *listener.getsockname()[:2], seats)
    try:
        _accept_shards(listener, engine, door)
    finally:
        engine.close()
    return exit_codes.FAILED if engine.broken else 0


def _accept_shards(listener: socket.socket, engine: KeptEngine, door: _Door, idle_seconds: float = math.inf,
                   seat_locks: list[Path] | None = None, running: list[threading.Thread] | None = None) -> None:
    """Each connection's shard in a thread of its own, until the engine breaks, the door
    closes or no shard has run for ``idle_seconds``; then waits for the running shards (and
    the ``running`` threads given)."""
    listener.settimeout(1.0)
    turns = _ShardTurns()
    running = list(running or [])
    quiet_since = time.monotonic()
    try:
        while not engine.broken and not door.closing.is_set():
            try:
                conn, peer = listener.accept()
            except TimeoutError:
                conn = None
            if len(alive := [thread for thread in running if thread.is_alive()]) < len(running):
                quiet_since = time.monotonic()
            running = alive
            if conn is None:
                # A local host keeps its seats (held until exit): no client is using or entering it.
                if (not running and time.monotonic() - quiet_since >= idle_seconds
                        and _lock_all(seat_locks or []) is not None):
                    log.info("warm engine idle for %.0f s: exiting", idle_seconds)
                    break
            elif door.capacity is not None and len(running) >= door.capacity:
                log.warning("turning away %s: %d shards running or waiting", peer[0], len(running))
                _refuse(conn, f"engine service busy: {len(running)} shards running or waiting")
            else:
                running.append(threading.Thread(target=_serve_connection, args=(conn, engine, turns, door),
                                                daemon=True, name=f"shard-{conn.fileno()}"))
                running[-1].start()
    finally:
        listener.close()
        for thread in running:
            thread.join()


def _preload(engine: KeptEngine, model_config: dict[str, Any], lora: bool = False) -> None:
    from llm_batch.core.model_config import ModelError  # heavy
    from llm_batch.infra.model_resolution import resolve_model  # heavy
    from llm_batch.runtime.worker import shared_lora  # heavy

    try:
        model = resolve_model(model_config)
    except ModelError as exc:
        raise WarmEngineError(f"cannot preload {model_config}: {exc}") from None
    if lora:
        model = shared_lora(model)
    started = time.monotonic()
    engine.release(engine.get(model), healthy=True)
    log.info("model %s preloaded in %.1f s", model.name, time.monotonic() - started)


def _preload_quietly(engine: KeptEngine, model_config: dict[str, Any], lora: bool = False) -> None:
    """A local host's preload: a failure is logged, and the first shard loads (and reports) it."""
    try:
        _preload(engine, model_config, lora)
    except Exception:  # noqa: BLE001 - an early start only: the shard's own load says what is wrong
        log.exception("preloading %s failed; the first shard loads it", model_config.get("model"))


class _Door:
    """What a host checks of a request before it runs the shard. A local host's (no token):
    nothing, as its socket is private and its clients hold the seats. An engine service's,
    whose clients are on the network: the token (in constant time), the model, a free seat
    (the host keeps them), and timeouts on a client that goes quiet."""

    def __init__(self, token: str | None = None, model: str | None = None, seats: int = 1):
        self.closing = threading.Event()  # set: stop the running shards, take no more
        service = token is not None
        self._token = token.encode() if service else None
        self.model = model
        self._seats = threading.BoundedSemaphore(seats) if service else None
        self.capacity = seats + MAX_WAITING if service else None
        # How long a client may take to send its request, and to read what the host sends it.
        self.request_timeout = REQUEST_TIMEOUT_S if service else None
        self.send_timeout = SEND_TIMEOUT_S if service else None

    def gone(self, conn: socket.socket) -> bool:
        """The shard's task has left, or the host is shutting down."""
        return _peer_closed(conn) or self.closing.is_set()

    def refusal(self, request: dict[str, Any]) -> str | None:
        token = request.get("token")
        if self._token is not None and (not isinstance(token, str)
                                        or not hmac.compare_digest(token.encode(), self._token)):
            return "refused: wrong or missing engine service token (LLM_BATCH_ENGINE_TOKEN)"
        return None

    def foreign(self, model_config: dict[str, Any]) -> str | None:
        if self.model is not None and (asked := model_config.get("model")) != self.model:
            return f"this engine service serves model {self.model!r}, not {asked!r} (LLM_BATCH_ENGINE_SERVICES)"
        return None

    @contextmanager
    def seat(self, conn: socket.socket) -> Iterator[bool]:
        """True once a seat is ours (at once on a local host); False if the client left while waiting."""
        if self._seats is None:
            yield True
            return
        while not self._seats.acquire(timeout=0.5):
            if self.gone(conn):
                yield False
                return
        try:
            yield True
        finally:
            self._seats.release()


def _refuse(conn: socket.socket, reason: str) -> None:
    with conn:
        conn.settimeout(REQUEST_TIMEOUT_S)
        forward = _ConnectionLog(conn)
        forward.send({"host": os.getpid()})
        forward.send({"log": reason})
        forward.send({"exit": exit_codes.FAILED})


def _unlink_if(path: Path, ours: Callable[[], bool]) -> None:
    """Remove a file of this host's unless a newer host has made its own there."""
    with suppress(OSError):
        if ours():
            path.unlink()


class _ShardTurns:
    """Attempts at one shard never overlap on a host (both write its results): a retry waits
    for the abandoned attempt to end."""

    def __init__(self) -> None:
        self._running: set[str] = set()
        self._changed = threading.Condition()

    @contextmanager
    def turn(self, shard_results: str) -> Iterator[None]:
        with self._changed:
            while shard_results in self._running:
                self._changed.wait()
            self._running.add(shard_results)
        try:
            yield
        finally:
            with self._changed:
                self._running.discard(shard_results)
                self._changed.notify_all()


def _serve_connection(conn: socket.socket, engine: KeptEngine, turns: _ShardTurns, door: _Door) -> None:
    with conn:
        conn.settimeout(door.request_timeout)
        forward = _ConnectionLog(conn)
        forward.send({"host": os.getpid()})
        from llm_batch.runtime.worker import WorkerUsageError, run_worker  # heavy
        from llm_batch.runtime.worker_args import config_from_argv  # heavy

        loggers = [logging.getLogger(name) for name in _LOGGERS]
        for logger in loggers:
            logger.addHandler(forward)
        code = exit_codes.USAGE
        try:
            try:
                request = _read_message(conn)
                if refusal := door.refusal(request):
                    raise WorkerUsageError(refusal)
                config = config_from_argv(request["argv"])
                if refusal := door.foreign(config.model_config):
                    raise WorkerUsageError(refusal)
                bind_job(config.job_id)  # this thread's lines name it, as a worker's do
            except _NothingSent:
                log.debug("a connection closed before its request (a probe)")
            except (WorkerUsageError, OSError, ValueError, KeyError, TypeError) as exc:
                log.error("not a shard: %s", exc)
            else:
                # A client that stops reading must not hold the shard's thread (and the engine).
                conn.settimeout(door.send_timeout)
                with door.seat(conn) as seated:
                    if not seated:
                        return  # the client left while waiting: nobody to answer
                    with turns.turn(config.results):
                        code = run_worker(config, engine, supervisor_gone=lambda: door.gone(conn))
        finally:
            for logger in loggers:
                logger.removeHandler(forward)
        forward.send({"exit": code})


class _NothingSent(ValueError):
    """The peer closed the connection without a line: a probe (``prewarm``), or a host gone."""


def _read_message(conn: socket.socket) -> dict[str, Any]:
    """One JSON object line (bounded: a service's clients are on the network)."""
    with conn.makefile("rb") as stream:
        line = stream.readline(MAX_REQUEST_BYTES + 1)
    if not line:
        raise _NothingSent("the connection closed before a line")
    if len(line) > MAX_REQUEST_BYTES:
        raise ValueError(f"a line longer than {MAX_REQUEST_BYTES} bytes")
    message = orjson.loads(line)
    if not isinstance(message, dict):
        raise ValueError("not a JSON object")
    return message


class _ConnectionLog(logging.Handler):
    """The log records of the thread that runs the shard, to its task."""

    def __init__(self, conn: socket.socket):
        super().__init__(logging.INFO)
        self.conn = conn
        self.thread = threading.get_ident()
        self.setFormatter(logging.Formatter(LOG_FORMAT))
        self.addFilter(JobIdFilter())

    def emit(self, record: logging.LogRecord) -> None:
        if record.thread == self.thread:
            self.send({"log": self.format(record)})

    def send(self, message: dict[str, Any]) -> None:
        with suppress(OSError):  # the client has gone: the stop check sees it
            self.conn.sendall(orjson.dumps(message) + b"\n")


def _peer_closed(conn: socket.socket) -> bool:
    """The client sends nothing after its request, so readable means closed."""
    try:
        readable, _, _ = select.select([conn], [], [], 0)
        return bool(readable) and conn.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


def _lock_all(paths: list[Path]) -> list[int] | None:
    """Every lock of ``paths`` taken without waiting, or None (and none kept) if one is held."""
    fds: list[int] = []
    for path in paths:
        if (fd := _lock_now(path)) is None:
            for held in fds:
                os.close(held)
            return None
        fds.append(fd)
    return fds


def _lock_now(path: Path) -> int | None:
    """A lock taken without waiting (its open descriptor holds it), or None if held."""
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
