"""docker-compose.yaml and Dockerfile: they parse, and everything they name is real.

No Docker engine runs here. The file is read with ``docker compose config`` when a compose
client is installed, else as YAML with compose's ``${VAR:-default}`` interpolation done
here. Then: every LLM_BATCH_* name it sets is one the project reads (and the values load
into Settings), every command of the project's image is a real ``airflow`` / ``llm-batch``
command line (parsed by their own argument parsers), the SeaweedFS flags exist in ``weed``,
and the pieces agree with each other (database, buckets, credentials, pools).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "docker-compose.yaml"
PACKAGE_DIRS = ("src", "dags")
AIRFLOW_SERVICES = ("airflow-init", "airflow-apiserver", "airflow-scheduler",
                    "airflow-dag-processor", "airflow-triggerer", "airflow-worker")
_VARIABLE = re.compile(r"\$\$|\$\{(\w+)(?::?-([^}]*))?\}")


def _interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's interpolation: ${VAR}, ${VAR:-default}, $$ -> $."""
    if isinstance(value, str):
        return _VARIABLE.sub(lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1)) or (m.group(2) or ""), value)
    if isinstance(value, dict):
        return {k: _interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [_interpolate(v, env) for v in value]
    return value


def _compose_client() -> bool:
    if not shutil.which("docker"):
        return False
    return subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0


def load_compose(env: dict[str, str] | None = None) -> dict[str, Any]:
    """The resolved compose model; ``env`` are the variables a user would set."""
    env = env or {}
    if _compose_client():
        clean = {k: v for k, v in os.environ.items() if not k.startswith(("LLM_BATCH_", "S3_", "AIRFLOW"))}
        out = subprocess.run(["docker", "compose", "-f", str(COMPOSE), "config", "--format", "json"],
                             capture_output=True, text=True, env={**clean, **env}, cwd=REPO)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)
    model = _interpolate(yaml.safe_load(COMPOSE.read_text()), env)
    for service in model["services"].values():  # the shapes `docker compose config` gives
        if isinstance(service.get("command"), str):
            service["command"] = shlex.split(service["command"])
        if isinstance(service.get("entrypoint"), str):
            service["entrypoint"] = shlex.split(service["entrypoint"])
        service["environment"] = {k: str(v) for k, v in (service.get("environment") or {}).items()}
    return model


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load_compose()


def _environment(compose: dict[str, Any], service: str) -> dict[str, str]:
    return {k: str(v) for k, v in compose["services"][service]["environment"].items()}


# -- structure

def test_the_stack_has_its_services(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert {"postgres", "s3", "s3-init", *AIRFLOW_SERVICES} <= set(services)
    for name in AIRFLOW_SERVICES:
        assert services[name]["build"]["dockerfile"] == "Dockerfile"
        depends = services[name]["depends_on"]
        assert depends["postgres"]["condition"] == "service_healthy"
        if name != "airflow-init":
            assert depends["airflow-init"]["condition"] == "service_completed_successfully"
            assert depends["s3-init"]["condition"] == "service_completed_successfully"
            assert services[name]["user"] == "50000:0"
    assert services["s3-init"]["depends_on"]["s3"]["condition"] == "service_healthy"
    published = [str(p.get("published", p) if isinstance(p, dict) else p) for p in services["airflow-apiserver"]["ports"]]
    assert any(p.startswith("8080") for p in published)


def test_dockerfile_builds_on_airflow_with_the_project_extras(compose: dict[str, Any]) -> None:
    import tomllib

    dockerfile = (REPO / "Dockerfile").read_text()
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    base = re.search(r"^ARG AIRFLOW_IMAGE=(\S+)", dockerfile, re.M).group(1)
    assert base.startswith("apache/airflow:3.3.2")
    assert "apache-airflow==3.3.2" in pyproject["project"]["optional-dependencies"]["airflow"]
    extras = compose["services"]["airflow-scheduler"]["build"]["args"]["LLM_BATCH_EXTRAS"].split(",")
    assert "airflow" in extras and "vllm" not in extras
    assert set(extras) <= set(pyproject["project"]["optional-dependencies"])
    ignored = (REPO / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored


# -- environment

def _names_the_project_reads() -> set[str]:
    from llm_batch.core.config import Settings

    names = {f"LLM_BATCH_{field.upper()}" for field in Settings.model_fields}
    for folder in PACKAGE_DIRS:
        for path in (REPO / folder).rglob("*.py"):
            names.update(re.findall(r"LLM_BATCH_[A-Z0-9_]+", path.read_text()))
    return names


def test_every_llm_batch_name_is_read_by_the_project(compose: dict[str, Any]) -> None:
    known = _names_the_project_reads()
    for name, service in compose["services"].items():
        set_here = {k for k in service.get("environment", {}) if k.startswith("LLM_BATCH_")}
        assert set_here <= known, f"{name} sets names nothing reads: {sorted(set_here - known)}"


@pytest.mark.parametrize("runner", ["local", "kubernetes"])
def test_the_environment_loads_into_settings(runner: str) -> None:
    from llm_batch.core.config import settings_from_env
    from llm_batch.infra import storage

    # The settings the service reads from its environment, not this test process's.
    settings = settings_from_env(_environment(load_compose({"LLM_BATCH_SHARD_RUNNER": runner}), "airflow-scheduler"))
    assert settings.shard_runner == runner  # one variable picks the runner
    assert settings.database_url.startswith("postgresql")
    # Internal URIs pass the same confinement as user ones (buckets must be allowed).
    for uri in (settings.work_uri, settings.files_uri):
        assert storage.check(uri, settings=settings) == uri


def test_the_pieces_agree(compose: dict[str, Any]) -> None:
    from sqlalchemy.engine import make_url

    env = _environment(compose, "airflow-scheduler")
    configs = compose["configs"]
    # The job store database is created by the postgres init script.
    url = make_url(env["LLM_BATCH_DATABASE_URL"])
    init_sql = configs["postgres-job-store"]["content"]
    assert f"CREATE DATABASE {url.database} OWNER {url.username}" in init_sql
    assert f"CREATE USER {url.username} WITH PASSWORD '{url.password}'" in init_sql
    assert url.host == "postgres"
    # The S3 identity is the one in the AWS_* credentials.
    identity = json.loads(configs["seaweedfs-s3"]["content"])["identities"][0]["credentials"][0]
    assert (identity["accessKey"], identity["secretKey"]) == (env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"])
    assert env["LLM_BATCH_S3_ENDPOINT_URL"] == "http://s3:8333"
    # Every bucket the settings name is created by s3-init.
    script = compose["services"]["s3-init"]["command"][-1]
    created = set(re.search(r"for bucket in ([^;]+);", script).group(1).split())
    named = {env[k].removeprefix("s3://").split("/")[0] for k in ("LLM_BATCH_WORK_URI", "LLM_BATCH_FILES_URI")}
    assert named | set(env["LLM_BATCH_ALLOWED_BUCKETS"].split(",")) <= created


def test_pools_are_the_ones_the_dag_uses(compose: dict[str, Any]) -> None:
    from llm_batch.airflow.lanes import pool_specs
    from llm_batch.core.config import settings_from_env

    # The settings the compose services run with, not this test process's.
    settings = settings_from_env(_environment(compose, "airflow-scheduler"))
    pools = json.loads(compose["configs"]["airflow-pools"]["content"])
    expected = {p.name: {"slots": p.slots, "description": p.description, "include_deferred": True}
                for p in pool_specs(settings)}
    assert pools == expected


# -- commands

def _shell_commands(script: str) -> list[list[str]]:
    """The airflow / llm-batch command lines of a shell script (one command a line)."""
    found = []
    for line in script.splitlines():
        words = shlex.split(line, comments=True)
        if words and words[0] == "exec":
            words = words[1:]
        if words and words[0] in ("airflow", "llm-batch"):
            found.append(words)
    return found


def _project_command_lines(compose: dict[str, Any]) -> list[list[str]]:
    lines = []
    for name in AIRFLOW_SERVICES:
        service = compose["services"][name]
        command = service.get("command") or []
        entrypoint = service.get("entrypoint")
        if entrypoint and Path(entrypoint[0]).name in ("bash", "sh"):
            assert command[0] == "-c", f"{name}: a shell entrypoint runs one -c script"
            script_lines = _shell_commands(command[1])
            assert script_lines, f"{name}: its script runs no airflow/llm-batch command"
            lines += script_lines
        else:
            # The Airflow image's entrypoint runs `airflow <command>`.
            assert command, f"{name} has no command"
            lines.append(["airflow", *command])
        test = (service.get("healthcheck") or {}).get("test") or []
        if test[:1] == ["CMD-SHELL"]:
            lines += _shell_commands(test[1])
    return lines


_AIRFLOW_PARSE = """
import json, sys
from airflow.cli.cli_parser import get_parser
parser, bad = get_parser(), []
for argv in json.loads(sys.argv[1]):
    try:
        parser.parse_args(argv)
    except SystemExit:
        bad.append(argv)
print(json.dumps(bad))
"""


def test_every_command_is_a_real_airflow_or_llm_batch_command(compose: dict[str, Any], tmp_path: Path) -> None:
    from llm_batch.cli.main import build_parser

    lines = _project_command_lines(compose)
    commands = {tuple(line[:2]) for line in lines}
    assert {("airflow", "api-server"), ("airflow", "scheduler"), ("airflow", "dag-processor"),
            ("airflow", "triggerer"), ("airflow", "db"), ("airflow", "celery")} <= commands

    for line in (line for line in lines if line[0] == "llm-batch"):
        build_parser().parse_args(line[1:])  # SystemExit on an unknown command or flag

    airflow_lines = [line[1:] for line in lines if line[0] == "airflow"]
    env = {**os.environ, "AIRFLOW_HOME": str(tmp_path), "AIRFLOW__CORE__LOAD_EXAMPLES": "False"}
    out = subprocess.run([sys.executable, "-c", _AIRFLOW_PARSE, json.dumps(airflow_lines)],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [], out.stderr[-2000:]


def test_seaweedfs_flags_exist(compose: dict[str, Any]) -> None:
    from tests.fixtures.s3 import weed_binary

    command = compose["services"]["s3"]["command"]
    assert command[0] == "server"
    help_text = subprocess.run([weed_binary(), "server", "-h"], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True).stdout
    for flag in command[1:]:
        name = flag.split("=")[0]
        assert re.search(rf"^\s+{re.escape(name)}\b", help_text, re.M), f"weed server has no flag {name}"


# -- the Celery shape (docs/production-shape.md)

def _named_volumes(service: dict[str, Any]) -> set[str]:
    """The named volumes (not bind mounts) a service mounts."""
    names = set()
    for volume in service.get("volumes") or []:
        source = volume.get("source") if isinstance(volume, dict) else str(volume).split(":")[0]
        kind = volume.get("type", "volume") if isinstance(volume, dict) else (
            "bind" if source.startswith((".", "/", "$")) else "volume")
        if kind == "volume" and source:
            names.add(source)
    return names


def test_the_celery_executor_has_its_broker_and_workers(compose: dict[str, Any]) -> None:
    from sqlalchemy.engine import make_url

    services = compose["services"]
    assert "redis" in services and services["redis"]["healthcheck"]["test"][-2:] == ["redis-cli", "ping"]
    for name in AIRFLOW_SERVICES:
        env = _environment(compose, name)
        assert env["AIRFLOW__CORE__EXECUTOR"] == "CeleryExecutor", name
        assert make_url(env["AIRFLOW__CELERY__BROKER_URL"].replace("redis://:@", "redis://")).host == "redis"
        # Celery's results go to Airflow's metadata DB, the database every component reads.
        backend = env["AIRFLOW__CELERY__RESULT_BACKEND"].removeprefix("db+")
        assert make_url(backend).database == make_url(env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"]).database
        assert make_url(backend).host == "postgres"
        if name != "airflow-init":
            assert services[name]["depends_on"]["redis"]["condition"] == "service_healthy"
    worker = services["airflow-worker"]
    assert worker["command"][:2] == ["celery", "worker"]
    assert "inspect ping" in worker["healthcheck"]["test"][1]


def test_workers_share_no_volume_with_anything(compose: dict[str, Any]) -> None:
    """A worker's home, model cache and task logs are its own: only PostgreSQL, S3 and the
    broker are shared (the DAG files are the image's code, mounted read-only in spirit)."""
    services = compose["services"]
    worker = _named_volumes(services["airflow-worker"])
    assert worker == set(), f"airflow-worker mounts named volumes {worker}: replicas would share them"
    env = _environment(compose, "airflow-worker")
    assert env["LLM_BATCH_WORK_URI"].startswith("s3://") and env["LLM_BATCH_FILES_URI"].startswith("s3://")
    assert env["LLM_BATCH_DATABASE_URL"].startswith("postgresql")
