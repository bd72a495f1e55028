"""The production shape on one machine: Celery workers with no shared disk.

``llm-batch up --executor celery --workers N`` starts, each as its own process group:

- the **services**, the only things the components share: PostgreSQL (the wheel's binaries,
  ``llm_batch.devstack.pg_server``; database ``airflow`` is Airflow's metadata DB and Celery's result
  backend, ``llm_batch`` the job store), Redis (Celery's broker: Debian's ``redis-server``)
  and SeaweedFS S3 (``llm_batch.devstack.s3_server``; bucket ``llm-batch``: every job file, the work
  area and uploads);
- the **control plane**: Airflow's api-server, scheduler, dag-processor and triggerer with
  the CeleryExecutor (``llm_batch.devstack.stack.Stack``'s start, health wait and provisioning), with
  ``LLM_BATCH_HOME`` = the CLI's home;
- **N Celery workers** (``airflow celery worker``, ``worker_concurrency``), each with a home of its own
  (``$LLM_BATCH_HOME/celery/worker-<n>``: its ``LLM_BATCH_HOME``, ``AIRFLOW_HOME``, task logs,
  model cache), which no other component opens. Each names itself ``celery-worker-<n>``
  (``AIRFLOW__CORE__HOSTNAME_CALLABLE``: the task instances' ``hostname`` says which worker
  ran them). The stack's supervisor (``llm_batch.devstack.supervisor``) starts them with the control
  plane, and starts again one that dies.

What a component writes goes to PostgreSQL, S3 or its own home, never to a folder another
reads. Layout, ports and the S3 secret are kept in ``$LLM_BATCH_HOME/celery/shape.json``
(mode 0600) so ``up`` again (or ``down``) finds the same services. See docs/production-shape.md.

Only imported by the CLI, the tests and the benchmark; nothing here imports Airflow
(``worker_hostname`` is imported by Airflow in the workers).
"""

from __future__ import annotations

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
from dataclasses import dataclass
from pathlib import Path

from llm_batch.core.config import Settings, get_settings
from llm_batch.devstack.pg_server import (
    PostgresError,
    PostgresServer,
    find_postgres_bin,
    reachable_bin,
    server_root,
    server_user,
)
from llm_batch.devstack.s3_server import PORT_NAMES, S3ServerError, WeedServer, free_ports
from llm_batch.devstack.stack import (
    AIRFLOW_DB,
    COMPONENTS,
    JOBS_DB,
    Stack,
    StackError,
    UpResult,
    free_port,
    write_private,
)
from llm_batch.infra.processes import alive, read_pid, signal_group, stop_group
from llm_batch.runtime.warm_engines import stop_hosts

SHAPE_DIR = "celery"
BUCKET = "llm-batch"
S3_ACCESS_KEY = "llmbatch"
WORKER_PREFIX = "celery-worker-"
# Tasks a worker runs at once: one per engine, and with warm engines one more, whose Airflow
# start-up (dispatch, task process, Execution API) overlaps the running shard and which then
# waits for the engine's slot (llm_batch.runtime.warm_engines): the engine never waits on Airflow
# between two shards. A dedicated engine per shard allows one only (two would load two).
WARM_ENGINES_PER_WORKER = 1
WAITING_TASKS_PER_WORKER = 1
# What the workers' environment must not carry from the control plane's: files of its home.
_CONTROL_ONLY = ("AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE", "LLM_BATCH_MODEL_CACHE",
                 "LLM_BATCH_LOCAL_ROOTS", "LLM_BATCH_RECURRING_SPECS")


def worker_hostname(environ: Mapping[str, str] | None = None) -> str:
    """Airflow's ``hostname_callable`` in the workers: the worker's name (``celery-worker-<n>``,
    from ``environ``, default this process's environment), recorded as each task instance's
    ``hostname``; the machine's name elsewhere."""
    return (os.environ if environ is None else environ).get("LLM_BATCH_WORKER_NAME") or socket.getfqdn()


def worker_concurrency(settings: Settings) -> int:
    if settings.warm_engines:
        return WARM_ENGINES_PER_WORKER + WAITING_TASKS_PER_WORKER
    return 1


def redis_binary() -> str:
    found = shutil.which("redis-server")
    if not found:
        raise StackError("redis-server not found (Celery's broker): install it, e.g. "
                         "`apt-get install redis-server` (scripts/test.sh does)")
    return found


@dataclass(frozen=True)
class CeleryStack(Stack):
    workers: int = 2

    # -- construction -------------------------------------------------------------------

    @classmethod
    def create(cls, settings: Settings | None = None, port: int | None = None,
               workers: int | None = None, extra_env: Mapping[str, str | None] | None = None) -> CeleryStack:
        """The shape of ``settings.home`` (its layout made or read from shape.json); the
        settings the CLI process uses are pointed at the shape's job store and storage.
        ``extra_env``: as ``Stack``'s."""
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

    @classmethod
    def from_env(cls) -> CeleryStack:
        return cls.create()

    @staticmethod
    def exists(settings: Settings | None = None) -> bool:
        """Whether ``settings.home`` has a Celery shape (shape.json)."""
        return ((settings or get_settings()).home / SHAPE_DIR / "shape.json").exists()

    # -- layout -------------------------------------------------------------------------

    @property
    def shape_dir(self) -> Path:
        return self.settings.home / SHAPE_DIR

    @property
    def state(self) -> dict:
        return json.loads((self.shape_dir / "shape.json").read_text())

    @property
    def shape_run_dir(self) -> Path:
        return self.shape_dir / "run"

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

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.state['ports']['redis']}/0"

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
            "AIRFLOW__CELERY__BROKER_URL": self.redis_url,
            "AIRFLOW__CELERY__RESULT_BACKEND": "db+" + self.airflow_db_url(),
            "AIRFLOW__CELERY__WORKER_CONCURRENCY": str(worker_concurrency(s)),
            # Airflow's Celery configuration; each worker imports the task code once, its
            # tasks (forked from it) do not (src/llm_batch/airflow/celery_config.py).
            "AIRFLOW__CELERY__CELERY_CONFIG_OPTIONS": "llm_batch.airflow.celery_config.CELERY_CONFIG",
            # The workers' concurrency and the pools cap what runs. The executor's own cap
            # (the embedded stack's 4) must not: it frees a slot only once the result backend
            # reports the task's end, seconds after the task has ended, and held the next
            # shard back that long (docs/benchmarks.md, Celery shape overhead).
            "AIRFLOW__CORE__PARALLELISM": "32",
            "LLM_BATCH_WARM_ENGINE_SLOTS": str(WARM_ENGINES_PER_WORKER),
            # A worker's second task waits for its engine instead of sharing it: the shape's
            # overhead was measured so; seats (docs/worker.md) were measured on one machine only.
            "LLM_BATCH_WARM_ENGINE_SEATS": str(s.warm_engine_seats),
            # A running task outlives a restart of the (only) api-server: its supervisor stops
            # it after this many failed heartbeats (one per 5 s at least), not Airflow's 3.
            "AIRFLOW__WORKERS__MAX_FAILED_HEARTBEATS": "24",
        }

    def env(self) -> dict[str, str]:
        env = super().env()
        for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"):
            env.pop(name, None)
        env.update(self.shared_env())
        return env

    def worker_env(self, n: int) -> dict[str, str]:
        """A worker's environment: the shape's, with its own home and name; nothing that
        names a file of the control plane's home."""
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
        """Services, then ``Stack.up``: its supervisor starts the control plane's and the
        workers that do not run; waits until each worker it started is ready."""
        if restart:
            self.down()
        started = [n for n in range(1, self.workers + 1) if self._pid(self.worker_name(n)) is None]
        offsets = {n: self.worker_log(n).stat().st_size if self.worker_log(n).exists() else 0 for n in started}
        result = super().up(timeout=timeout, restart=False)
        for n in started:
            self.wait_worker_ready(n, timeout, offsets[n])
        return UpResult(
            started=result.started + tuple(self.worker_name(n) for n in started),
            restarted=result.restarted,
            already_running=result.already_running + tuple(
                self.worker_name(n) for n in range(1, self.workers + 1) if n not in started),
            config_changed=result.config_changed,
        )

    def supervised(self) -> tuple[str, ...]:
        return COMPONENTS + self.worker_names()

    def pid_file(self, component: str) -> Path:
        return self._pid_file(component) if component.startswith(WORKER_PREFIX) else super().pid_file(component)

    def launch(self, component: str) -> subprocess.Popen:
        if not component.startswith(WORKER_PREFIX):
            return super().launch(component)
        n = int(component.removeprefix(WORKER_PREFIX))
        home = self.worker_home(n)
        (home / "airflow" / "logs").mkdir(parents=True, exist_ok=True)
        self.shape_run_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.worker_log(n), "ab")  # noqa: SIM115 (owned by the child)
        log.write(f"\n==== {component} started {time.strftime('%Y-%m-%dT%H:%M:%S')}\n".encode())
        log.flush()
        proc = subprocess.Popen(self.worker_command(n), env=self.worker_env(n), stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=home / "airflow",
                                start_new_session=True)
        self._pid_file(component).write_text(str(proc.pid))
        return proc

    def down(self, grace: float = 20.0) -> None:
        """The supervisor, the workers (a warm shutdown, SIGKILL after `grace`), the control
        plane, then the services."""
        self.stop_supervisor(grace)
        pids = [pid for n in range(1, self.workers + 1) if (pid := read_pid(self._pid_file(self.worker_name(n))))]
        # Airflow puts each task's runner in a process group of its own: collect them first.
        groups = {g for pid in pids for g in _process_groups(pid)}
        for pid in pids:
            signal_group(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for pid in pids:
            while alive(pid) and time.monotonic() < deadline:
                time.sleep(0.2)
        for group in groups:
            signal_group(group, signal.SIGKILL)
        for n in range(1, self.workers + 1):
            self._pid_file(self.worker_name(n)).unlink(missing_ok=True)
            stop_hosts(self.worker_home(n))
        super().down(grace)  # the control plane, then the services

    def _pid_file(self, name: str) -> Path:
        return self.shape_run_dir / f"{name}.pid"

    def _pid(self, name: str) -> int | None:
        pid = read_pid(self._pid_file(name))
        return pid if pid and alive(pid) else None

    def services_status(self) -> dict[str, int | bool | None]:
        """Services and workers: a pid (or True for PostgreSQL) when running, else None."""
        state: dict[str, int | bool | None] = {
            "postgres": True if self._pg().running() else None,
            "redis": self._pid("redis"),
            "s3": self._pid("s3"),
        }
        for n in range(1, self.workers + 1):
            state[self.worker_name(n)] = self._pid(self.worker_name(n))
        return state

    # -- services -----------------------------------------------------------------------

    def _pg(self):
        root = self.pg_root
        return PostgresServer(root, self.state["ports"]["postgres"], reachable_bin(find_postgres_bin(), server_user(), root))

    def _weed(self, pid: int):
        return WeedServer(self.settings.s3_endpoint_url or "", S3_ACCESS_KEY, self.state["s3_secret"],
                          self.shape_dir / "s3" / "weed.log", pid)

    def s3_client(self):
        """A boto3 client of the shape's S3 server (checks, benchmarks)."""
        return self._weed(0).client()

    def services_up(self, timeout: float = 120.0) -> None:
        self.shape_run_dir.mkdir(parents=True, exist_ok=True)
        try:
            if not self._pg().running():
                PostgresServer.start(self.pg_root, self.state["ports"]["postgres"], durable=True)
            pg = self._pg()
            for database in (AIRFLOW_DB, JOBS_DB):
                pg.create_database(database)
        except PostgresError as exc:
            raise StackError(f"PostgreSQL did not start: {exc}") from None
        if self._pid("redis") is None:
            self._start_redis()
        self._wait_redis(timeout)
        try:
            pid = self._pid("s3")
            if pid is None:
                weed = WeedServer.start(self.shape_dir / "s3", S3_ACCESS_KEY, self.state["s3_secret"],
                                        self.state["ports"]["s3"], timeout=timeout)
                self._pid_file("s3").write_text(str(weed.pid))
            else:
                weed = self._weed(pid)
                weed.wait_until_serving(None, timeout)
            weed.ensure_bucket(BUCKET)
        except S3ServerError as exc:
            raise StackError(str(exc)) from None

    def _start_redis(self) -> None:
        folder = self.shape_dir / "redis"
        folder.mkdir(parents=True, exist_ok=True)
        log = open(folder / "redis.log", "ab")  # noqa: SIM115 (owned by the child)
        # Queued task messages survive a broker restart (append-only file in its folder).
        command = [redis_binary(), "--bind", "127.0.0.1", "--port", str(self.state["ports"]["redis"]),
                   "--dir", str(folder), "--appendonly", "yes", "--save", "", "--protected-mode", "yes"]
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                cwd=folder, start_new_session=True)
        self._pid_file("redis").write_text(str(proc.pid))

    def _wait_redis(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        last: Exception | str = "no answer"
        while time.monotonic() < deadline:
            if self._pid("redis") is None:
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
        """Stop one service ("postgres": a fast shutdown, dropping every connection; "s3",
        "redis": SIGKILL) as an outage would; ``services_up`` (or ``up``) starts it again
        with the same ports and data."""
        if name == "postgres":
            self._pg().stop()
            return
        if name not in ("s3", "redis"):
            raise ValueError(f"no service {name!r}: postgres, redis or s3")
        self._stop_process(name, 0.0)

    def services_down(self) -> None:
        # weed takes ~25 s on SIGTERM and keeps nothing in memory: SIGKILL. Redis writes its
        # append-only file as it goes.
        self._stop_process("s3", 0.0)
        self._stop_process("redis", 10.0)
        try:
            self._pg().stop()
        except Exception:  # noqa: BLE001 (no wheel any more: nothing of ours can run)
            pass

    def _stop_process(self, name: str, grace: float) -> None:
        """SIGTERM the process group in ``name``'s pid file, SIGKILL after `grace`."""
        pid = read_pid(self._pid_file(name))
        if pid:
            stop_group(pid, grace)
        self._pid_file(name).unlink(missing_ok=True)

    # -- workers ------------------------------------------------------------------------

    def worker_command(self, n: int) -> list[str]:
        return [sys.executable, "-m", "airflow", "celery", "worker", "--concurrency", str(worker_concurrency(self.settings)),
                "--celery-hostname", f"{self.worker_name(n)}@%h", "--without-mingle", "--without-gossip"]

    def start_worker(self, n: int) -> int:
        """Start worker `n` (its own process group) unless it runs; returns its pid."""
        return self.start_component(self.worker_name(n))

    def workers_up(self, timeout: float) -> list[int]:
        """Start the workers that do not run; wait until each started one is ready."""
        started = [n for n in range(1, self.workers + 1) if self._pid(self.worker_name(n)) is None]
        offsets = {n: self.worker_log(n).stat().st_size if self.worker_log(n).exists() else 0 for n in started}
        for n in started:
            self.start_worker(n)
        for n in started:
            self.wait_worker_ready(n, timeout, offsets[n])
        return started

    def wait_worker_ready(self, n: int, timeout: float, offset: int = 0) -> None:
        """Until the worker's log says Celery is ``ready`` (after `offset`: this start's lines)."""
        deadline = time.monotonic() + timeout
        log = self.worker_log(n)
        while time.monotonic() < deadline:
            if self._pid(self.worker_name(n)) is None:
                raise StackError(f"{self.worker_name(n)} exited during start-up; see {log}")
            with open(log, "rb") as f:
                f.seek(offset)
                if b" ready." in f.read():
                    return
            time.sleep(0.5)
        raise StackError(f"{self.worker_name(n)} was not ready within {timeout:.0f}s; see {log}")

    def kill_worker(self, n: int) -> int:
        """kill -9 of everything worker `n` runs, as when its machine dies: the Celery worker's
        process group (main process, pool, the tasks' supervisors) and the group of each task
        runner (Airflow gives each its own) with the shard's ``llm-batch worker`` (its own
        group too). Returns the worker's pid."""
        pid = read_pid(self._pid_file(self.worker_name(n)))
        if not pid or not alive(pid):
            raise StackError(f"{self.worker_name(n)} is not running")
        for group in _process_groups(pid):
            signal_group(group, signal.SIGKILL)
        return pid

    def prepare_model(self, name: str) -> None:
        """``llm-batch models prepare NAME`` in every worker's own model cache (what a worker
        image would ship)."""
        for n in range(1, self.workers + 1):
            log = self.worker_home(n) / "models-prepare.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            with open(log, "ab") as out:
                done = subprocess.run([sys.executable, "-m", "llm_batch.cli.main", "models", "prepare", name],
                                      env=self.worker_env(n), stdout=out, stderr=subprocess.STDOUT,
                                      cwd=self.worker_home(n))
            if done.returncode:
                raise StackError(f"models prepare {name} failed for {self.worker_name(n)}; see {log}")


def _descendants(root: int) -> list[int]:
    """`root` and every process below it (from /proc, Linux)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return found


def _process_groups(root: int) -> list[int]:
    """The process groups of `root` and its descendants, `root`'s own first."""
    groups = [root]
    for pid in _descendants(root):
        try:
            group = os.getpgid(pid)
        except OSError:
            continue
        if group not in groups:
            groups.append(group)
    return groups


def _ensure_state(shape_dir: Path, workers: int | None) -> dict:
    """shape.json: ports of the services (picked free once), the S3 secret, the worker count
    (``workers`` given: kept or changed; else the kept one, 2 at first), PostgreSQL's folder."""
    path = shape_dir / "shape.json"
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        state = None
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

