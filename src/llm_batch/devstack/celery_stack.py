"""The production shape on one machine: Celery workers with no shared disk.

``llm-batch up --executor celery --workers N`` starts the services (PostgreSQL, Redis as
Celery's broker, SeaweedFS S3), the control plane as ``Stack`` does (with the CeleryExecutor)
and N Celery workers, each with a home of its own under ``$LLM_BATCH_HOME/celery`` that no
other component opens. Layout, ports and the S3 secret are kept in ``celery/shape.json``
(mode 0600). Nothing here imports Airflow (``worker_hostname`` is imported by Airflow in the
workers). See docs/production-shape.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from llm_batch.core.config import Settings, get_settings
from llm_batch.devstack.pg_server import server_root
from llm_batch.devstack.s3_server import PORT_NAMES, S3ServerError, WeedServer, free_ports
from llm_batch.devstack.stack import (
    AIRFLOW_DB,
    COMPONENTS,
    JOBS_DB,
    SUPERVISOR,
    Stack,
    StackError,
    UpResult,
    _server,
    free_port,
    read_json,
    write_private,
)
from llm_batch.infra.processes import alive, read_pid, signal_group
from llm_batch.runtime.warm_engines import stop_hosts

SHAPE_DIR = "celery"
BUCKET = "llm-batch"
S3_ACCESS_KEY = "llmbatch"
WORKER_PREFIX = "celery-worker-"
# With warm engines a worker runs a second task, whose Airflow start-up overlaps the running
# shard and which then waits for the engine's slot: the engine never waits on Airflow between
# two shards. A dedicated engine per shard allows one task only (two would load two).
WARM_ENGINES_PER_WORKER = 1
WAITING_TASKS_PER_WORKER = 1
# What the workers' environment must not carry from the control plane's: files of its home.
_CONTROL_ONLY = ("AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE", "LLM_BATCH_MODEL_CACHE",
                 "LLM_BATCH_LOCAL_ROOTS", "LLM_BATCH_RECURRING_SPECS")


def worker_hostname(environ: Mapping[str, str] | None = None) -> str:
    """Airflow's ``hostname_callable`` in the workers: the worker's name, else the machine's."""
    return (os.environ if environ is None else environ).get("LLM_BATCH_WORKER_NAME") or socket.getfqdn()


def worker_concurrency(settings: Settings) -> int:
    return WARM_ENGINES_PER_WORKER + WAITING_TASKS_PER_WORKER if settings.warm_engines else 1


def redis_binary() -> str:
    found = shutil.which("redis-server")
    if not found:
        raise StackError("redis-server not found (Celery's broker): install it, e.g. "
                         "`apt-get install redis-server` (scripts/test.sh does)")
    return found


@dataclass(frozen=True)
class CeleryStack(Stack):
    workers: int = 2

    @classmethod
    def create(cls, settings: Settings | None = None, port: int | None = None,
               workers: int | None = None, extra_env: Mapping[str, str | None] | None = None) -> CeleryStack:
        """The shape of ``settings.home``, the settings pointed at its job store and storage."""
        settings = settings or get_settings()
        port = port or int(os.environ.get("LLM_BATCH_API_PORT", "8080"))
        state = _ensure_state(settings.home / SHAPE_DIR, workers)
        pg = state["ports"]["postgres"]
        shaped = settings.model_copy(update={
            "database_url": f"postgresql+psycopg2://postgres@127.0.0.1:{pg}/{JOBS_DB}",
            "work_uri": f"s3://{BUCKET}/work",
            "files_uri": f"s3://{BUCKET}/files",
            "s3_endpoint_url": f"http://127.0.0.1:{state['ports']['s3']['s3']}",
            # Storage confines every s3:// URI, the internal ones too, to the allowed buckets.
            "allowed_buckets": sorted({*settings.allowed_buckets, BUCKET}),
            # As configured, else what the workers run at once.
            "local_pool_slots": (settings.local_pool_slots if "local_pool_slots" in settings.model_fields_set
                                 else state["workers"] * worker_concurrency(settings)),
            "warm_engine_seats": 1,  # as the workers are told (shared_env)
        })
        return cls(shaped, port, "postgres", extra_env=dict(extra_env or {}), workers=state["workers"])

    @staticmethod
    def exists(settings: Settings | None = None) -> bool:
        return ((settings or get_settings()).home / SHAPE_DIR / "shape.json").exists()

    # -- layout -------------------------------------------------------------------------

    @property
    def shape_dir(self) -> Path:
        return self.settings.home / SHAPE_DIR

    @property
    def state(self) -> dict:
        return json.loads((self.shape_dir / "shape.json").read_text())

    def worker_name(self, n: int) -> str:
        return f"{WORKER_PREFIX}{n}"

    def worker_home(self, n: int) -> Path:
        return self.shape_dir / self.worker_name(n)

    def worker_names(self) -> tuple[str, ...]:
        return tuple(self.worker_name(n) for n in range(1, self.workers + 1))

    def worker_log(self, n: int) -> Path:
        return self.worker_home(n) / "airflow" / "logs" / "celery-worker.log"

    @property
    def pg_root(self) -> Path:
        return Path(self.state["postgres_root"])

    def airflow_db_url(self) -> str:
        return f"postgresql+psycopg2://postgres@127.0.0.1:{self.state['ports']['postgres']}/{AIRFLOW_DB}"

    def pid_file(self, component: str) -> Path:
        """The control plane's in its home; the services' and workers' in the shape's."""
        if component in (*COMPONENTS, SUPERVISOR):
            return super().pid_file(component)
        return self.shape_dir / "run" / f"{component}.pid"

    # -- environment --------------------------------------------------------------------

    def shared_env(self) -> dict[str, str]:
        """What every component of the shape is told: where the services are (never a path)."""
        s = self.settings
        return {
            "LLM_BATCH_DATABASE_URL": s.database_url,
            "LLM_BATCH_WORK_URI": s.work_uri,
            "LLM_BATCH_FILES_URI": s.files_uri,
            "LLM_BATCH_S3_ENDPOINT_URL": s.s3_endpoint_url or "",
            "LLM_BATCH_ALLOWED_BUCKETS": ",".join(s.allowed_buckets),
            "LLM_BATCH_LOCAL_POOL_SLOTS": str(s.local_pool_slots),
            "AWS_ACCESS_KEY_ID": S3_ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": self.state["s3_secret"],
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
            # The api-server does not see the workers' model caches (each prepares its own).
            "LLM_BATCH_CHECK_MODELS_AT_SUBMIT": "false",
            "AIRFLOW__CORE__EXECUTOR": "CeleryExecutor",
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": self.airflow_db_url(),
            "AIRFLOW__CELERY__BROKER_URL": f"redis://127.0.0.1:{self.state['ports']['redis']}/0",
            "AIRFLOW__CELERY__RESULT_BACKEND": "db+" + self.airflow_db_url(),
            "AIRFLOW__CELERY__WORKER_CONCURRENCY": str(worker_concurrency(s)),
            # Each worker imports the task code once, before its tasks fork (airflow/celery_config.py).
            "AIRFLOW__CELERY__CELERY_CONFIG_OPTIONS": "llm_batch.airflow.celery_config.CELERY_CONFIG",
            # The workers' concurrency and the pools cap what runs, not the executor: it frees
            # a slot only once the result backend reports the task's end, seconds late, and
            # held the next shard back that long (docs/benchmarks.md, Celery shape overhead).
            "AIRFLOW__CORE__PARALLELISM": "32",
            "LLM_BATCH_WARM_ENGINE_SLOTS": str(WARM_ENGINES_PER_WORKER),
            # A worker's second task waits for its engine instead of sharing it: the shape's
            # overhead was measured so; seats (docs/worker.md) were measured on one machine only.
            "LLM_BATCH_WARM_ENGINE_SEATS": str(s.warm_engine_seats),
            # A running task outlives a restart of the (only) api-server: stopped after this
            # many failed heartbeats (one per 5 s at least), not Airflow's 3.
            "AIRFLOW__WORKERS__MAX_FAILED_HEARTBEATS": "24",
        }

    def env(self) -> dict[str, str]:
        env = super().env()
        for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"):
            env.pop(name, None)
        env.update(self.shared_env())
        return env

    def worker_env(self, n: int) -> dict[str, str]:
        """The shape's environment with the worker's own home and name, none of the control plane's files."""
        env = self.env()
        for name in _CONTROL_ONLY:
            env.pop(name, None)
        home = self.worker_home(n)
        env.update({
            "LLM_BATCH_HOME": str(home),
            "AIRFLOW_HOME": str(home / "airflow"),
            "LLM_BATCH_WORKER_NAME": self.worker_name(n),
            "AIRFLOW__CORE__HOSTNAME_CALLABLE": "llm_batch.devstack.celery_stack.worker_hostname",
            # Its own task-log server port (two workers on one machine); the api-server
            # cannot read these logs (they stay in the worker's home): see docs/production-shape.md.
            "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(self.state["ports"]["worker_logs"][n - 1]),
        })
        return env

    # -- up / down ----------------------------------------------------------------------

    def up(self, timeout: float = 300.0, restart: bool = False) -> UpResult:
        """``Stack.up`` (its supervisor starts the workers too), then until each started worker is ready."""
        if restart:
            self.down()
        started = self._stopped_workers()
        result = super().up(timeout=timeout, restart=False)
        for n, offset in started.items():
            self.wait_worker_ready(n, timeout, offset)
        return replace(result, started=result.started + tuple(self.worker_name(n) for n in started),
                       already_running=result.already_running + tuple(
                           self.worker_name(n) for n in range(1, self.workers + 1) if n not in started))

    def supervised(self) -> tuple[str, ...]:
        return COMPONENTS + self.worker_names()

    def launch(self, component: str) -> subprocess.Popen:
        if not component.startswith(WORKER_PREFIX):
            return super().launch(component)
        n = int(component.removeprefix(WORKER_PREFIX))
        log = self.worker_log(n)
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            out.write(f"\n==== {component} started {time.strftime('%Y-%m-%dT%H:%M:%S')}\n".encode())
        return self.spawn(component, self.worker_command(n), self.worker_env(n), log, self.worker_home(n) / "airflow")

    def down(self, grace: float = 20.0) -> None:
        """The supervisor, the workers (their task runners' process groups too), the control
        plane, then the services."""
        self.stop_process(SUPERVISOR, grace)
        self.stop_together(self.worker_names(), grace, _process_groups)
        for n in range(1, self.workers + 1):
            stop_hosts(self.worker_home(n))
        super().down(grace)

    def services_status(self) -> dict[str, int | bool | None]:
        return {**super().services_status(), "redis": self.pid_of("redis"), "s3": self.pid_of("s3"),
                **{name: self.pid_of(name) for name in self.worker_names()}}

    # -- services -----------------------------------------------------------------------

    def postgres(self):
        return _server({"root": self.state["postgres_root"], "port": self.state["ports"]["postgres"]})

    def _weed(self, pid: int):
        return WeedServer(self.settings.s3_endpoint_url or "", S3_ACCESS_KEY, self.state["s3_secret"],
                          self.shape_dir / "s3" / "weed.log", pid)

    def s3_client(self):
        return self._weed(0).client()

    def services_up(self, timeout: float = 120.0) -> None:
        super().services_up(timeout)  # PostgreSQL
        if self.pid_of("redis") is None:
            folder = self.shape_dir / "redis"
            # Queued task messages survive a broker restart (append-only file in its folder).
            self.spawn("redis", [redis_binary(), "--bind", "127.0.0.1", "--port", str(self.state["ports"]["redis"]),
                                 "--dir", str(folder), "--appendonly", "yes", "--save", "", "--protected-mode", "yes"],
                       None, folder / "redis.log", folder)
        self._wait_redis(timeout)
        try:
            pid = self.pid_of("s3")
            if pid is None:
                weed = WeedServer.start(self.shape_dir / "s3", S3_ACCESS_KEY, self.state["s3_secret"],
                                        self.state["ports"]["s3"], timeout=timeout)
                self.pid_file("s3").write_text(str(weed.pid))
            else:
                weed = self._weed(pid)
                weed.wait_until_serving(None, timeout)
            weed.ensure_bucket(BUCKET)
        except S3ServerError as exc:
            raise StackError(str(exc)) from None

    def _wait_redis(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        last: Exception | str = "no answer"
        while time.monotonic() < deadline:
            if self.pid_of("redis") is None:
                raise StackError(f"redis-server exited; see {self.shape_dir / 'redis' / 'redis.log'}")
            try:
                with socket.create_connection(("127.0.0.1", self.state["ports"]["redis"]), timeout=2) as conn:
                    conn.sendall(b"PING\r\n")
                    if conn.recv(64).startswith(b"+PONG"):
                        return
            except OSError as exc:
                last = exc
            time.sleep(0.2)
        raise StackError(f"redis-server did not answer within {timeout:.0f}s ({last})")

    def stop_service(self, name: str) -> None:
        """Stop one service as an outage would ("postgres": every connection dropped; "s3", "redis": SIGKILL)."""
        if name == "postgres":
            self.postgres().stop()
            return
        if name not in ("s3", "redis"):
            raise ValueError(f"no service {name!r}: postgres, redis or s3")
        self.stop_process(name, 0.0)

    def services_down(self) -> None:
        # weed takes ~25 s on SIGTERM and keeps nothing in memory: SIGKILL. Redis writes its
        # append-only file as it goes.
        self.stop_process("s3", 0.0)
        self.stop_process("redis", 10.0)
        with contextlib.suppress(Exception):  # no wheel any more: nothing of ours can run
            self.postgres().stop()

    # -- workers ------------------------------------------------------------------------

    def worker_command(self, n: int) -> list[str]:
        return [sys.executable, "-m", "airflow", "celery", "worker", "--concurrency", str(worker_concurrency(self.settings)),
                "--celery-hostname", f"{self.worker_name(n)}@%h", "--without-mingle", "--without-gossip"]

    def _stopped_workers(self) -> dict[int, int]:
        """The workers that do not run -> their log's size (where a new start's lines begin)."""
        return {n: self.worker_log(n).stat().st_size if self.worker_log(n).exists() else 0
                for n in range(1, self.workers + 1) if self.pid_of(self.worker_name(n)) is None}

    def workers_up(self, timeout: float) -> list[int]:
        started = self._stopped_workers()
        for n in started:
            self.start_component(self.worker_name(n))
        for n, offset in started.items():
            self.wait_worker_ready(n, timeout, offset)
        return list(started)

    def wait_worker_ready(self, n: int, timeout: float, offset: int = 0) -> None:
        """Until the worker's log says Celery is ``ready`` (after `offset`: this start's lines)."""
        deadline = time.monotonic() + timeout
        log = self.worker_log(n)
        while time.monotonic() < deadline:
            if self.pid_of(self.worker_name(n)) is None:
                raise StackError(f"{self.worker_name(n)} exited during start-up; see {log}")
            with open(log, "rb") as f:
                f.seek(offset)
                if b" ready." in f.read():
                    return
            time.sleep(0.5)
        raise StackError(f"{self.worker_name(n)} was not ready within {timeout:.0f}s; see {log}")

    def kill_worker(self, n: int) -> int:
        """kill -9 of everything worker `n` runs (each task runner has a process group of its
        own), as when its machine dies; returns its pid."""
        pid = read_pid(self.pid_file(self.worker_name(n)))
        if not pid or not alive(pid):
            raise StackError(f"{self.worker_name(n)} is not running")
        for group in _process_groups(pid):
            signal_group(group, signal.SIGKILL)
        return pid

    def prepare_model(self, name: str) -> None:
        """``llm-batch models prepare NAME`` in every worker's own model cache (as an image would
        ship it), the workers' at once (each its own cache: nothing shared)."""
        running = {}
        for n in range(1, self.workers + 1):
            log = self.worker_home(n) / "models-prepare.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            with open(log, "ab") as out:
                running[n] = (log, subprocess.Popen(
                    [sys.executable, "-m", "llm_batch.cli.main", "models", "prepare", name],
                    env=self.worker_env(n), stdout=out, stderr=subprocess.STDOUT, cwd=self.worker_home(n)))
        failed = [n for n, (_, proc) in running.items() if proc.wait()]
        if failed:
            raise StackError(f"models prepare {name} failed for "
                             + ", ".join(f"{self.worker_name(n)} (see {running[n][0]})" for n in failed))


def _descendants(root: int) -> list[int]:
    import psutil  # optional

    try:
        return [root, *(child.pid for child in psutil.Process(root).children(recursive=True))]
    except psutil.Error:
        return [root]


def _process_groups(root: int) -> list[int]:
    """The process groups of `root` and its descendants, `root`'s own first."""
    groups = [root]
    for pid in _descendants(root):
        with contextlib.suppress(OSError):  # gone meanwhile
            if (group := os.getpgid(pid)) not in groups:
                groups.append(group)
    return groups


def _ensure_state(shape_dir: Path, workers: int | None) -> dict:
    """shape.json: the services' ports (picked free once), the S3 secret, the worker count
    (``workers``, else the kept one, 2 at first), PostgreSQL's folder."""
    path = shape_dir / "shape.json"
    state = read_json(path)
    if state is not None and (workers is None or workers == state["workers"]):
        if workers is None or len(state["ports"]["worker_logs"]) >= workers:
            return state
    if state is None:
        ports = free_ports(2 + len(PORT_NAMES))
        state = {
            "workers": workers or 2,
            "ports": {"postgres": ports[0], "redis": ports[1],
                      "s3": dict(zip(PORT_NAMES, ports[2:], strict=True)), "worker_logs": []},
            "s3_secret": secrets.token_urlsafe(24),
            "postgres_root": str(server_root(shape_dir / "postgres")),
        }
    state["workers"] = workers or state["workers"]
    while len(state["ports"]["worker_logs"]) < state["workers"]:
        state["ports"]["worker_logs"].append(free_port())
    write_private(path, json.dumps(state, indent=1))
    return state
