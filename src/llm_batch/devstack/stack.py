"""The embedded stack: Airflow's components as local processes on the stack's database.

``up`` starts the database server, migrates Airflow's DB, starts the supervisor (which starts
api-server, scheduler, dag-processor and triggerer, each in its own process group with a pid
file and a log under ``$LLM_BATCH_HOME/airflow``), waits for health and provisions the DAG,
its pools and the CLI's API key; ``down`` stops every group. Not ``airflow standalone``:
SIGTERM orphans its children. Only imported by the CLI; Airflow runs in child processes.
See docs/embedded.md.
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
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Mapping
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
    free_port,
    reachable_bin,
    server_root,
    server_user,
)
from llm_batch.infra.api_client import send_with_retries
from llm_batch.infra.jobstore import get_job_store
from llm_batch.infra.processes import alive, read_pid, signal_group, stop_recorded
from llm_batch.runtime.warm_engines import stop_hosts

COMPONENTS = ("api-server", "scheduler", "dag-processor", "triggerer")
DATABASES = ("postgres", "sqlite")
DATABASE_ENV = "LLM_BATCH_STACK_DATABASE"
AIRFLOW_DB = "airflow"  # PostgreSQL's database for Airflow's metadata
JOBS_DB = "llm_batch"  # and the job store's
STATE_FILE = "stack.json"
ADMIN_USER = "admin"
# Where each heartbeating component appears in /api/v2/monitor/health.
HEALTH_KEYS = {"scheduler": "scheduler", "dag-processor": "dag_processor", "triggerer": "triggerer"}
# A component younger than this is never "not answering": it has no heartbeat yet (Airflow
# calls one older than 30 s unhealthy) and an api-server needs a while to answer.
NOT_ANSWERING_AFTER_S = 120.0
# The environment the components read, fingerprinted to notice a configuration change.
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

    started: tuple[str, ...] = ()
    restarted: tuple[str, ...] = ()  # alive but not answering
    already_running: tuple[str, ...] = ()
    config_changed: tuple[str, ...] = ()  # variables changed since the running ones started

    def summary(self) -> str:
        labels = {"started": self.started, "restarted (not answering)": self.restarted,
                  "already running": self.already_running}
        return "; ".join(f"{label}: {', '.join(names)}" for label, names in labels.items() if names)


def repo_dags_folder() -> Path:
    """dags/ of this checkout (the project installs in editable mode from its checkout)."""
    return Path(__file__).resolve().parents[3] / "dags"


def read_json(path: Path, default: Any = None) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return default


def database_state(home: Path, database: str | None = None,
                   environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The home's ``stack.json`` (mode 0600): its database (``database``, else
    ``LLM_BATCH_STACK_DATABASE`` of ``environ``, else the home's) and PostgreSQL's port,
    folder and password, made once and kept."""
    path = home / STATE_FILE
    state = read_json(path, {})
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
    """Write ``text`` to ``path`` atomically, mode 0600 from the start (it may be a secret)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)
    os.replace(tmp, path)


@dataclass(frozen=True)
class Stack:
    """``environ``: the environment the components inherit (None: this process's);
    ``extra_env``: variables over it (None: unset)."""

    settings: Settings
    port: int = 8080
    database: str = "sqlite"
    environ: Mapping[str, str] | None = field(default=None, compare=False, repr=False)  # secrets
    extra_env: Mapping[str, str | None] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def create(cls, settings: Settings | None = None, port: int | None = None, database: str | None = None,
               environ: Mapping[str, str] | None = None, extra_env: Mapping[str, str | None] | None = None) -> Stack:
        """The stack of ``settings.home`` on its database, the settings pointed at its job store."""
        settings = settings or get_settings()
        parent = {**(os.environ if environ is None else environ),
                  **{k: v for k, v in (extra_env or {}).items() if v is not None}}
        port = port or int(parent.get("LLM_BATCH_API_PORT", "8080"))
        state = database_state(settings.home, database, parent)
        if state["database"] == "postgres":
            settings = settings.model_copy(update={"database_url": _server(state["postgres"]).url(JOBS_DB)})
        if "warm_engines" not in settings.model_fields_set:
            # A small job here pays no engine start (LLM_BATCH_WARM_ENGINES=0: a worker per shard).
            settings = settings.model_copy(update={"warm_engines": True})
        return cls(settings, port, state["database"], environ, dict(extra_env or {}))

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
    def api_key_file(self) -> Path:
        return self.settings.home / API_KEY_FILE

    def inherited_env(self) -> dict[str, str]:
        env = dict(os.environ if self.environ is None else self.environ)
        for name, value in self.extra_env.items():
            if value is None:
                env.pop(name, None)
            else:
                env[name] = value
        return env

    def env(self) -> dict[str, str]:
        """Airflow configuration for every component (they must agree) over what they inherit."""
        secret_file = self.airflow_home / "jwt_secret"
        if not secret_file.exists():
            write_private(secret_file, secrets.token_urlsafe(32))
        # The user's own DAGs (a second bundle) and recurring specs (dags/recurring.py), to fill.
        user_dags, user_specs = self.settings.home / "dags", self.settings.home / "recurring"
        for folder in (user_dags, user_specs):
            folder.mkdir(parents=True, exist_ok=True)
        # The repo's dags/ (Airflow's default bundle name, so DAGS_FOLDER still names it) and the user's.
        local = "airflow.dag_processing.bundles.local.LocalDagBundle"
        bundles = [{"name": "dags-folder", "classpath": local, "kwargs": {"path": str(repo_dags_folder())}},
                   {"name": "user-dags", "classpath": local, "kwargs": {"path": str(user_dags)}}]
        env = self.inherited_env()
        # vLLM-CPU refuses to start without a KV-cache size; 2 GiB suits a laptop.
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        env.update(
            {
                "AIRFLOW_HOME": str(self.airflow_home),
                "LLM_BATCH_HOME": str(self.settings.home),
                "AIRFLOW__CORE__DAGS_FOLDER": str(repo_dags_folder()),
                "AIRFLOW__DAG_PROCESSOR__DAG_BUNDLE_CONFIG_LIST": json.dumps(bundles),
                "LLM_BATCH_USER_RECURRING_SPECS": str(user_specs),
                "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
                # The task code imported once before the LocalExecutor forks (local_executor.py).
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
                # Per-stack task-log ports (not 8793/8794): two stacks on one machine do not collide.
                "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(self.log_server_ports()[0]),
                "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(self.log_server_ports()[1]),
            }
        )
        if self.database == "sqlite":
            # A writer waits up to 60 s for SQLite's lock, not 5 (metadata_db.py).
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
        return _server(database_state(self.settings.home, self.database)["postgres"])

    def services_up(self, timeout: float = 120.0) -> None:
        """On PostgreSQL, its server (started unless it runs) with the two databases."""
        if self.database != "postgres":
            return
        try:
            server = self.postgres()
            if not server.running():
                PostgresServer.start(server.root, server.port, durable=True, password=server.password)
            for name in (AIRFLOW_DB, JOBS_DB):
                server.create_database(name)
        except PostgresError as exc:
            raise StackError(f"PostgreSQL did not start: {exc}") from None
        except OperationalError as exc:
            raise StackError(f"PostgreSQL in {server.root} does not let the stack in ({str(exc.orig).strip()}): "
                             f"was its {STATE_FILE} replaced? Restore it, or remove that folder for a new, empty "
                             "database") from None

    def services_down(self) -> None:
        """Stop the home's PostgreSQL server if it has one (also after a switch to SQLite)."""
        state = read_json(self.settings.home / STATE_FILE, {})
        if "postgres" in state:
            with contextlib.suppress(PostgresError, OSError):  # no wheel any more: nothing of ours runs
                _server(state["postgres"]).stop()

    def services_status(self) -> dict[str, int | bool | None]:
        """Each service: True or a pid when it runs, None when stopped."""
        if self.database != "postgres":
            return {}
        return {"postgres": True if self.postgres().running() else None}

    def log_server_ports(self) -> tuple[int, int]:
        """The (worker, triggerer) log-server ports: picked free once, kept in the run folder."""
        ports_file = self.run_dir / "log-ports.json"
        with contextlib.suppress(TypeError, ValueError):
            worker, trigger = read_json(ports_file)
            return int(worker), int(trigger)
        ports = (free_port(), free_port())
        ports_file.parent.mkdir(parents=True, exist_ok=True)
        ports_file.write_text(json.dumps(ports))
        return ports

    # -- processes ----------------------------------------------------------------------

    def command(self, component: str) -> list[str]:
        airflow = [sys.executable, "-m", "airflow"]
        if component == "api-server":
            return [*airflow, "api-server", "--host", "127.0.0.1", "--port", str(self.port)]
        return [*airflow, component]

    def pid_file(self, component: str) -> Path:
        return self.run_dir / f"{component}.pid"

    def pid_of(self, name: str) -> int | None:
        pid = read_pid(self.pid_file(name))
        return pid if pid and alive(pid) else None

    def running(self) -> dict[str, int | None]:
        return {component: self.pid_of(component) for component in COMPONENTS}

    def supervised(self) -> tuple[str, ...]:
        return COMPONENTS

    def spawn(self, name: str, command: list[str], env: Mapping[str, str] | None, log: Path,
              cwd: Path) -> subprocess.Popen:
        """Start ``command`` in a process group of its own, its pid in `name`'s pid file."""
        log.parent.mkdir(parents=True, exist_ok=True)
        self.pid_file(name).parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            proc = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True, cwd=cwd)
        self.pid_file(name).write_text(str(proc.pid))
        return proc

    def stop_process(self, name: str, grace: float) -> None:
        stop_recorded(self.pid_file(name), grace)

    def stop_together(self, names: Iterable[str], grace: float,
                      groups: Callable[[int], Iterable[int]] = lambda pid: (pid,)) -> None:
        """SIGTERM the process groups of ``names``, SIGKILL them (and ``groups`` below each) after ``grace``."""
        names = tuple(names)
        pids = [pid for name in names if (pid := read_pid(self.pid_file(name)))]
        doomed = {group for pid in pids for group in groups(pid)}
        for pid in pids:
            signal_group(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for pid in pids:
            while alive(pid) and time.monotonic() < deadline:
                time.sleep(0.2)
        for group in doomed:
            signal_group(group, signal.SIGKILL)
        for name in names:
            self.pid_file(name).unlink(missing_ok=True)

    def admin_password(self) -> str:
        if not self.passwords_file.exists():
            write_private(self.passwords_file, json.dumps({ADMIN_USER: secrets.token_urlsafe(12)}))
        return json.loads(self.passwords_file.read_text())[ADMIN_USER]

    def up(self, timeout: float = 180.0, restart: bool = False) -> UpResult:
        """Start what is missing (the supervisor does, after the hung ones are stopped), wait
        until healthy, provision. Nothing running: a clean start; ``restart``: stop all first
        (applies a configuration change, which survivors otherwise refuse: StackError)."""
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
            # A running supervisor starts components with the configuration it started with.
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
        self.control_plane_down()  # stale pid files, leftovers of dead process groups
        (self.run_dir / "log-ports.json").unlink(missing_ok=True)  # pick free ones again
        self.restarts_file.unlink(missing_ok=True)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.admin_password()
        env = self.env()
        self.migrate(env)
        self.config_file.write_text(json.dumps(self.config_fingerprint(env), indent=1, sort_keys=True))

    def migrate(self, env: dict[str, str]) -> None:
        log = self.log_dir / "db-migrate.log"
        with open(log, "ab") as out:
            if subprocess.run([sys.executable, "-m", "airflow", "db", "migrate"], env=env, stdout=out,
                              stderr=subprocess.STDOUT).returncode:
                raise StackError(f"airflow db migrate failed; see {log}")

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
        """Variables set, unset or changed since the running components started (empty when unknown)."""
        started_with = read_json(self.config_file)
        if started_with is None:
            return ()
        now = self.config_fingerprint()
        return tuple(sorted(n for n in started_with.keys() | now.keys() if started_with.get(n) != now.get(n)))

    def not_answering(self, state: dict[str, int | None]) -> tuple[str, ...]:
        """Live components, up for NOT_ANSWERING_AFTER_S, that do not answer: the api-server's
        health check within 10 s, or the heartbeats it calls unhealthy (only while it reads the
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
        with self.component_lock(component):
            return self.pid_of(component) or self.launch(component).pid

    def launch(self, component: str) -> subprocess.Popen:
        """Start one component (the caller holds its lock and has checked that it does not run)."""
        # cwd = the Airflow home: from the repository root the plugin's package is seen twice
        # (the editable install and ./llm_batch.egg-info), an import error for Airflow.
        return self.spawn(component, self.command(component), self.env(), self.log_dir / f"{component}.log",
                          self.airflow_home)

    def stop_component(self, component: str, grace: float = 20.0) -> None:
        """Stop one component's process group; the supervisor starts it again."""
        with self.component_lock(component):
            self.stop_process(component, grace)

    @contextmanager
    def component_lock(self, name: str, blocking: bool = True) -> Iterator[bool]:
        """Held while a process starts or stops `name`, so it is never started twice; False when
        not blocking and another process holds it. Re-entrant within a process."""
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
        """The supervisor process: it rebuilds this stack with ``create()``."""
        return [sys.executable, "-m", "llm_batch.devstack.supervisor", f"{type(self).__module__}:{type(self).__qualname__}"]

    def supervisor_pid(self) -> int | None:
        return self.pid_of(SUPERVISOR)

    @property
    def restarts_file(self) -> Path:
        return self.run_dir / "restarts.json"

    def supervise(self, timeout: float = 60.0) -> None:
        """Start the supervisor unless it runs, then wait until every supervised process runs."""
        log = self.log_dir / f"{SUPERVISOR}.log"
        if not self.supervisor_pid():
            env = {**self.inherited_env(), "LLM_BATCH_HOME": str(self.settings.home),
                   "LLM_BATCH_API_PORT": str(self.port)}
            self.spawn(SUPERVISOR, self.supervisor_command(), env, log, self.airflow_home)
        deadline = time.monotonic() + timeout
        while missing := [name for name in self.supervised() if not self.pid_of(name)]:
            if not self.supervisor_pid():
                raise StackError(f"the supervisor exited; see {log}")
            if time.monotonic() > deadline:
                raise StackError(f"the supervisor did not start {', '.join(missing)} within {timeout:.0f}s; see {log}")
            time.sleep(0.2)

    # -- what the DAG and the CLI need once Airflow answers ------------------------------

    def airflow_token(self, user: str = ADMIN_USER) -> str:
        """An Airflow access token of `user`: the admin, or one of the deployment's users."""
        password = self.admin_password() if user == ADMIN_USER else json.loads(self.passwords_file.read_text())[user]
        response = send_with_retries(lambda: httpx.post(
            f"{self.base_url}/auth/token", json={"username": user, "password": password}, timeout=30))
        response.raise_for_status()
        return response.json()["access_token"]

    def provision(self, timeout: float) -> None:
        """Once the batch DAG is parsed: unpause it and housekeeping (recurring DAGs stay paused
        for their owner), make its pools, the CLI's key and the operators' default connection."""
        with httpx.Client(base_url=f"{self.base_url}/api/v2", timeout=30,
                          headers={"Authorization": f"Bearer {self.airflow_token()}"}) as client:
            def api(method: str, path: str, **kwargs: Any) -> httpx.Response:
                return send_with_retries(lambda: client.request(method, path, **kwargs))

            def put(collection: str, key: str, body: dict[str, Any]) -> None:
                created = api("POST", f"/{collection}", json=body)
                if created.status_code == 409:  # kept from an earlier `up`: apply the settings
                    api("PATCH", f"/{collection}/{key}", json=body).raise_for_status()
                else:
                    created.raise_for_status()

            self._wait_for_dag(client, timeout)
            api("PATCH", f"/dags/{BATCH_DAG_ID}", json={"is_paused": False}).raise_for_status()
            housekeeping = api("PATCH", f"/dags/{HOUSEKEEPING_DAG_ID}", json={"is_paused": False})
            if housekeeping.status_code != 404:  # parsed a moment later: the next `up` gets it
                housekeeping.raise_for_status()
            for pool in runner_pool_specs(self.settings):
                put("pools", pool.name, {"name": pool.name, "slots": pool.slots, "description": pool.description,
                                         "include_deferred": False})
            # The key may have been remade: the connection is kept current.
            put("connections", "llm_batch_default", {
                "connection_id": "llm_batch_default", "conn_type": "http", "host": self.base_url,
                "password": self.ensure_api_key(),
                "description": "llm-batch API of the embedded stack (made by llm-batch up)"})

    def _wait_for_dag(self, api: httpx.Client, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if api.get(f"/dags/{BATCH_DAG_ID}").status_code == 200:
                return
            time.sleep(1)
        raise StackError(f"the DAG {BATCH_DAG_ID} was not parsed within {timeout:.0f}s; "
                         f"see {self.log_dir}/dag-processor.log and {self.log_dir}/dag_processor/")

    def ensure_api_key(self) -> str:
        """The CLI's admin API key: the stored one if the job store still accepts it, else a new one."""
        store = get_job_store(self.settings.database_url)
        stored = ""
        with contextlib.suppress(OSError):
            stored = self.api_key_file.read_text().strip()
        if stored and store.authenticate_api_key(stored):
            return stored
        _, plaintext = store.create_api_key(ADMIN_USER, "llm-batch CLI (made by llm-batch up)", is_admin=True)
        write_private(self.api_key_file, plaintext + "\n")
        return plaintext

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        last = "no answer yet"
        while time.monotonic() < deadline:
            if dead := [c for c, pid in self.running().items() if pid is None]:
                raise StackError(f"{', '.join(dead)} exited during start-up; see {self.log_dir}/<component>.log")
            try:
                health = self.monitor_health()
                if all(v.get("status") == "healthy" for k, v in health.items()
                       if isinstance(v, dict) and k in ("metadatabase", "scheduler")):
                    return
                last = json.dumps(health)
            except NO_ANSWER as exc:
                last = str(exc)
            time.sleep(1)
        raise StackError(f"the stack did not become healthy within {timeout:.0f}s (last: {last}); "
                         f"logs in {self.log_dir}")

    def down(self, grace: float = 20.0) -> None:
        self.control_plane_down(grace)
        self.services_down()

    def control_plane_down(self, grace: float = 20.0) -> None:
        self.stop_process(SUPERVISOR, grace)  # first: it would start again what is stopped here
        stop_hosts(self.settings.home)
        self.stop_together(COMPONENTS, grace)


def _server(pg: dict[str, Any]) -> PostgresServer:
    """The PostgreSQL server of a state's ``{"root", "port", "password"}``."""
    root = Path(pg["root"])
    return PostgresServer(root, pg["port"], reachable_bin(find_postgres_bin(), server_user(), root), pg.get("password"))
