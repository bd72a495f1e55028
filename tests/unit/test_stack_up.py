"""``llm-batch up`` on a partly running stack starts only what is missing, and its
supervisor starts again a component that dies (llm_batch.devstack.stack, llm_batch.devstack.supervisor).

Real processes, not Airflow: ``up`` starts the real supervisor process, which starts each
component as a small process (own process group, pid file, log) exactly as the real ones
are; the api-server is a tiny HTTP server answering ``/api/v2/monitor/health`` from a file
the test writes, the others are ``sleep``. Migration and provisioning (Airflow's DB and REST
API) are stubbed; tests/e2e runs the real stack.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from llm_batch.core.config import Settings
from llm_batch.devstack import stack as stack_module
from llm_batch.devstack.stack import COMPONENTS, SUPERVISOR, Stack, StackError, free_port
from llm_batch.devstack.supervisor import read_restarts

ROOT = Path(__file__).resolve().parents[2]

# The fake api-server: GET /api/v2/monitor/health answers the JSON in argv[2].
FAKE_API_SERVER = """
import http.server, sys
port, answer = int(sys.argv[1]), sys.argv[2]
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = open(answer, "rb").read()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
http.server.ThreadingHTTPServer(("127.0.0.1", port), Health).serve_forever()
"""
HEALTHY = {name: {"status": "healthy"} for name in ("metadatabase", "scheduler", "triggerer", "dag_processor")}


class FakeStack(Stack):
    """The real Stack with small processes as components and Airflow's side stubbed."""

    @property
    def health_file(self) -> Path:
        return self.settings.home / "health.json"

    def command(self, component: str) -> list[str]:
        if component == "api-server":
            return [sys.executable, "-c", FAKE_API_SERVER, str(self.port), str(self.health_file)]
        return ["sleep", "600"]

    def supervisor_command(self) -> list[str]:
        # The supervisor rebuilds this class: importable from the repository's root.
        boot = f"import sys; sys.path.insert(0, {str(ROOT)!r}); from llm_batch.devstack.supervisor import main; main()"
        return [sys.executable, "-c", boot, f"{__name__}:FakeStack"]

    def migrate(self, env: dict[str, str]) -> None:
        (self.settings.home / "migrated").touch()

    def provision(self, timeout: float) -> None:
        pass


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[FakeStack]:
    fake = FakeStack(Settings(home=tmp_path), free_port())
    fake.health_file.write_text(json.dumps(HEALTHY))
    yield fake
    fake.down(grace=2)


def kill(stack: Stack, *names: str) -> None:
    """kill -9 of each process group, in order (the supervisor first, or it starts the others again)."""
    for name in names:
        os.killpg(stack.pid_of(name), signal.SIGKILL)
        deadline = time.monotonic() + 10
        while stack.pid_of(name) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert stack.pid_of(name) is None


def wait_for(what: str, check, timeout: float = 15):
    deadline = time.monotonic() + timeout
    while not (found := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
    return found


def others(pids: dict[str, int | None], component: str) -> dict[str, int | None]:
    return {c: pid for c, pid in pids.items() if c != component}


def test_a_killed_component_is_started_again_by_the_supervisor(stack, monkeypatch, capsys):
    stack.up(timeout=30)
    before = stack.running()
    assert all(before.values()) and stack.supervisor_pid()
    os.kill(before["scheduler"], signal.SIGKILL)  # the leader only, as a crash would

    after = wait_for("the scheduler started again", lambda: (s := stack.running())["scheduler"] not in
                     (None, before["scheduler"]) and s)
    assert others(after, "scheduler") == others(before, "scheduler")
    assert read_restarts(stack).keys() == {"scheduler"}
    assert read_restarts(stack)["scheduler"]["restarts"] == 1
    assert read_restarts(stack)["scheduler"]["reason"] == "killed by SIGKILL"
    from llm_batch.cli.main import main

    monkeypatch.setattr("llm_batch.devstack.home.home_stack", lambda settings=None: stack)
    main(["status"])
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert f"running (pid {after['scheduler']})" in lines["scheduler"]
    assert "1 restart, last " in lines["scheduler"] and lines["scheduler"].endswith(": killed by SIGKILL")
    assert "restart" not in lines["triggerer"]
    assert f"running (pid {stack.supervisor_pid()})" in lines[SUPERVISOR]

    stack.down(grace=2)  # the supervisor first: nothing comes back
    assert stack.supervisor_pid() is None and not any(stack.running().values())


def test_up_starts_only_the_dead_component(stack, monkeypatch, capsys):
    first = stack.up(timeout=30)
    assert first.started == COMPONENTS and (stack.settings.home / "migrated").exists()
    before = stack.running()
    assert all(before.values())
    (stack.settings.home / "migrated").unlink()

    kill(stack, SUPERVISOR, "scheduler")  # nothing left to start it again but `up`
    # Through the CLI: the line says what was started and what was already running.
    from llm_batch.cli.main import main

    monkeypatch.setattr(Stack, "create", classmethod(lambda cls, *args, **kwargs: stack))
    assert main(["up", "--timeout", "30"]) == 0
    out = capsys.readouterr().out
    assert "Components:         started: scheduler; already running: api-server, dag-processor, triggerer" in out

    after = stack.running()
    assert others(after, "scheduler") == others(before, "scheduler")
    assert after["scheduler"] and after["scheduler"] != before["scheduler"]
    assert stack.supervisor_pid()  # a new one
    assert not (stack.settings.home / "migrated").exists()  # survivors' DB is left alone too

    again = stack.up(timeout=30)  # all running: nothing is touched
    assert (again.started, again.already_running) == ((), COMPONENTS)
    assert stack.running() == after


def test_a_component_alive_but_unhealthy_is_restarted(stack, monkeypatch):
    stack.up(timeout=30)
    before = stack.running()
    monkeypatch.setattr(stack_module, "NOT_ANSWERING_AFTER_S", 0.0)
    # Airflow's own DB failing makes every heartbeat look unhealthy: no restart helps then.
    stack.health_file.write_text(json.dumps({name: {"status": "unhealthy"} for name in HEALTHY}))
    assert stack.not_answering(before) == ()
    stack.health_file.write_text(json.dumps({**HEALTHY, "triggerer": {"status": "unhealthy"}}))
    result = stack.up(timeout=30)
    assert (result.started, result.restarted) == ((), ("triggerer",))
    after = stack.running()
    assert after["triggerer"] != before["triggerer"]
    assert others(after, "triggerer") == others(before, "triggerer")
    assert read_restarts(stack)["triggerer"]["reason"] == "killed by SIGTERM"  # up's stop, the supervisor's start


def test_a_config_change_needs_restart(stack):
    stack.up(timeout=30)
    before = stack.running()
    # `llm-batch up` again, from a shell whose configuration changed.
    stack = dataclasses.replace(stack, environ={**os.environ, "LLM_BATCH_MAX_REQUESTS": "12"})
    # A running supervisor would start it again with the configuration it started with.
    kill(stack, SUPERVISOR, "triggerer")
    with pytest.raises(StackError, match=r"configuration changed .*\(LLM_BATCH_MAX_REQUESTS\); starting "
                       r"supervisor, triggerer .*llm-batch up --restart"):
        stack.up(timeout=30)
    assert stack.running()["triggerer"] is None and stack.supervisor_pid() is None  # nothing mixed in

    result = stack.up(timeout=30, restart=True)
    assert result.started == COMPONENTS
    after = stack.running()
    assert all(after.values()) and not set(after.values()) & set(before.values())
    assert stack.up(timeout=30).config_changed == ()  # the new configuration is the one recorded


def test_the_stack_reads_the_users_dags_and_specs_under_its_home(tmp_path):
    """Two local DAG bundles (the repo's dags/ and $LLM_BATCH_HOME/dags) and the user's
    spec folder, all made by the stack so the user only drops files in."""
    env = Stack(Settings(home=tmp_path)).env()
    bundles = json.loads(env["AIRFLOW__DAG_PROCESSOR__DAG_BUNDLE_CONFIG_LIST"])
    assert [(b["name"], b["kwargs"]["path"]) for b in bundles] == [
        ("dags-folder", str(stack_module.repo_dags_folder())), ("user-dags", str(tmp_path / "dags"))]
    assert env["LLM_BATCH_USER_RECURRING_SPECS"] == str(tmp_path / "recurring")
    assert (tmp_path / "dags").is_dir() and (tmp_path / "recurring").is_dir()


def test_recurring_reads_the_repo_examples_and_the_users_folder(tmp_path):
    """dags/recurring.py makes a DAG of each spec in both folders; LLM_BATCH_RECURRING_SPECS overrides both."""
    import subprocess  # optional

    import yaml  # optional

    examples = sorted(p for p in (ROOT / "dags" / "recurring_specs").iterdir() if p.suffix in (".yaml", ".yml"))
    user = tmp_path / "recurring"
    user.mkdir()
    spec = yaml.safe_load(examples[0].read_text())
    repo_dag = f"recurring__{spec['name']}"
    (user / "mine.yaml").write_text(yaml.safe_dump({**spec, "name": "mine"}))
    probe = ("import runpy, sys; g = runpy.run_path(sys.argv[1]); "
             "print(sorted(k for k in g if k.startswith('recurring__')))")

    def dag_ids(**extra: str) -> list[str]:
        env = {**os.environ, "LLM_BATCH_HOME": str(tmp_path), "AIRFLOW_HOME": str(tmp_path / "airflow"), **extra}
        env.pop("LLM_BATCH_RECURRING_SPECS", None) if "LLM_BATCH_RECURRING_SPECS" not in extra else None
        out = subprocess.run([sys.executable, "-c", probe, str(ROOT / "dags" / "recurring.py")], env=env,
                             capture_output=True, text=True, timeout=120, check=True).stdout
        return eval(out.strip().splitlines()[-1])  # noqa: S307 - our own probe's printed list

    both = dag_ids(LLM_BATCH_USER_RECURRING_SPECS=str(user))
    assert "recurring__mine" in both and repo_dag in both
    assert len(both) == len(examples) + 1
    assert dag_ids(LLM_BATCH_USER_RECURRING_SPECS=str(user), LLM_BATCH_RECURRING_SPECS=str(user)) == ["recurring__mine"]


def test_a_deployment_names_its_airflow_users_beside_the_stacks_admin(tmp_path):
    """LLM_BATCH_AIRFLOW_USERS: Airflow's simple auth manager users (name:role), the stack's
    admin always first and always admin; a pair that is no owner name and role is refused."""
    from pydantic import ValidationError

    def users(value: str | None) -> str:
        settings = Settings(home=tmp_path) if value is None else Settings(home=tmp_path, airflow_users=value)
        return Stack(settings).env()["AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS"]

    assert users(None) == "admin:admin"
    assert users("alice:user, vic:viewer,olga:OP,admin:viewer") == "admin:admin,alice:user,vic:viewer,olga:OP"
    for bad in ("alice", "alice:owner", "Alice:user", "a b:user"):
        with pytest.raises(ValidationError, match="airflow_users"):
            Settings(home=tmp_path, airflow_users=bad)
