"""llm_batch.devstack.celery_stack without starting anything: the layout, ports and environments of
the production shape (the processes themselves: tests/shape/test_celery_shape.py)."""

from __future__ import annotations

import dataclasses
import os
import stat
from pathlib import Path

import pytest

from llm_batch.core.config import Settings, settings_from_env
from llm_batch.devstack.celery_stack import CeleryStack, worker_hostname


@pytest.fixture
def shape(tmp_path: Path) -> CeleryStack:
    return CeleryStack.create(Settings(home=tmp_path / "home", warm_engines=False), 18080, workers=2)




def test_the_shape_is_kept_private_and_stable(shape: CeleryStack) -> None:
    state_file = shape.shape_dir / "shape.json"
    assert stat.S_IMODE(state_file.stat().st_mode) == 0o600  # holds the S3 secret
    again = CeleryStack.create(Settings(home=shape.settings.home, warm_engines=False), 18080)
    assert again.state == shape.state and again.workers == 2
    more = CeleryStack.create(Settings(home=shape.settings.home, warm_engines=False), 18080, workers=3)
    assert more.workers == 3 and len(more.state["ports"]["worker_logs"]) == 3
    assert more.state["ports"]["postgres"] == shape.state["ports"]["postgres"]


def test_everything_shared_is_a_service_never_a_path(shape: CeleryStack) -> None:
    env = shape.env()
    assert env["AIRFLOW__CORE__EXECUTOR"] == "CeleryExecutor"
    assert env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"].startswith("postgresql+psycopg2://")
    assert env["AIRFLOW__CELERY__RESULT_BACKEND"] == "db+" + env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"]
    assert env["AIRFLOW__CELERY__BROKER_URL"].startswith("redis://127.0.0.1:")
    assert env["LLM_BATCH_DATABASE_URL"].startswith("postgresql+psycopg2://") and "/llm_batch" in env["LLM_BATCH_DATABASE_URL"]
    assert env["LLM_BATCH_WORK_URI"].startswith("s3://") and env["LLM_BATCH_FILES_URI"].startswith("s3://")
    assert env["LLM_BATCH_LOCAL_POOL_SLOTS"] == "2"  # one shard per worker at a time
    assert "llm-batch" in env["LLM_BATCH_ALLOWED_BUCKETS"].split(",")  # storage confines internal URIs too
    assert shape.settings.database_url == env["LLM_BATCH_DATABASE_URL"]  # the CLI's key goes to that store


def test_each_worker_has_a_home_of_its_own(shape: CeleryStack, tmp_path: Path) -> None:
    # `llm-batch up` run with a control-plane model cache: it must not reach the workers.
    shape = dataclasses.replace(shape, environ={**os.environ, "LLM_BATCH_MODEL_CACHE": str(tmp_path / "control-models")})
    control = shape.env()
    envs = {n: shape.worker_env(n) for n in (1, 2)}
    homes = {envs[n]["LLM_BATCH_HOME"] for n in envs}
    assert len(homes) == 2 and str(shape.settings.home) not in homes
    for n, env in envs.items():
        home = Path(env["LLM_BATCH_HOME"])
        assert env["AIRFLOW_HOME"] == str(home / "airflow")
        assert env["LLM_BATCH_WORKER_NAME"] == f"celery-worker-{n}"
        assert env["AIRFLOW__CORE__HOSTNAME_CALLABLE"] == "llm_batch.devstack.celery_stack.worker_hostname"
        # Nothing names a file of another component's home.
        for name, value in env.items():
            for other in [shape.airflow_home, *(Path(envs[m]["LLM_BATCH_HOME"]) for m in envs if m != n)]:
                assert str(other) not in value, (n, name, value)
        assert "LLM_BATCH_MODEL_CACHE" not in env  # the default: <its home>/models
        for name in ("AIRFLOW__CORE__EXECUTOR", "AIRFLOW__CELERY__BROKER_URL", "LLM_BATCH_DATABASE_URL",
                     "LLM_BATCH_WORK_URI", "AIRFLOW__API_AUTH__JWT_SECRET", "AIRFLOW__CORE__EXECUTION_API_SERVER_URL"):
            assert env[name] == control[name], name
    assert envs[1]["AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT"] != envs[2]["AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT"]


def test_worker_hostname_names_the_worker() -> None:
    assert worker_hostname({"LLM_BATCH_WORKER_NAME": "celery-worker-7"}) == "celery-worker-7"
    assert worker_hostname({})


def test_the_worker_command_is_airflow_s(shape: CeleryStack) -> None:
    command = shape.worker_command(1)
    assert command[1:5] == ["-m", "airflow", "celery", "worker"]
    assert "--concurrency" in command and command[command.index("--concurrency") + 1] == "1"


def test_with_warm_engines_a_second_task_per_worker_waits_for_its_one_engine(tmp_path: Path) -> None:
    # The settings of a deployment that sets only these (not the suite's pool of two slots).
    given = settings_from_env({"LLM_BATCH_HOME": str(tmp_path / "home"), "LLM_BATCH_WARM_ENGINES": "true"})
    warm = CeleryStack.create(given, 18080, workers=2)
    command, env = warm.worker_command(1), warm.worker_env(1)
    assert command[command.index("--concurrency") + 1] == "2" == env["AIRFLOW__CELERY__WORKER_CONCURRENCY"]
    assert env["LLM_BATCH_WARM_ENGINE_SLOTS"] == "1"  # one engine per worker machine
    assert env["LLM_BATCH_LOCAL_POOL_SLOTS"] == "4"  # the pool lets both tasks of each worker run
    # ... the second waiting for the engine, not sharing it (one seat), in the workers and
    # in the pool the control plane makes (no more slots than the workers run tasks).
    assert env["LLM_BATCH_WARM_ENGINE_SEATS"] == "1"
    assert warm.settings.local_shard_slots == 4
    assert Settings(warm_engine_slots=int(env["LLM_BATCH_WARM_ENGINE_SLOTS"])).warm_engine_slots == 1
