"""The task code Airflow's long-lived worker processes import once before they fork tasks:
the Celery workers (llm_batch.airflow.celery_config) and the embedded stack's
LocalExecutor (llm_batch.devstack.local_executor). Every name real, a failure only logged."""

from __future__ import annotations

import importlib
import logging
import subprocess
import sys
from pathlib import Path

import pytest
from airflow.providers.celery.executors.default_celery import DEFAULT_CELERY_CONFIG

from llm_batch.airflow import celery_config, preload
from llm_batch.core.config import Settings
from llm_batch.devstack.celery_stack import CeleryStack
from llm_batch.devstack.stack import Stack


def test_the_celery_configuration_is_airflow_s():
    assert celery_config.CELERY_CONFIG is DEFAULT_CELERY_CONFIG


@pytest.mark.parametrize("runner", ["local", "kubernetes"])
def test_every_preloaded_module_exists(runner):
    names = preload.preload_modules(runner)
    assert {"llm_batch.infra.jobstore", "llm_batch.pipeline.steps"} <= set(names)
    for name in names:
        importlib.import_module(name)


def test_a_module_that_fails_to_import_is_only_logged(monkeypatch, caplog):
    monkeypatch.setattr(preload, "TASK_MODULES", ("llm_batch.no_such_module", "llm_batch.pipeline.steps"))
    with caplog.at_level(logging.WARNING, logger="llm_batch.airflow.preload"):
        celery_config._preload(sender=None)
        assert preload.preload("local") == ["llm_batch.pipeline.steps", "llm_batch.airflow.operators.local"]
    assert "not preloaded llm_batch.no_such_module" in caplog.text


def test_the_shape_and_compose_name_the_celery_configuration(tmp_path):
    shape = CeleryStack.create(Settings(home=tmp_path / "home"), 18080, workers=1)
    option = shape.worker_env(1)["AIRFLOW__CELERY__CELERY_CONFIG_OPTIONS"]
    module, _, attr = option.rpartition(".")
    assert getattr(importlib.import_module(module), attr) is DEFAULT_CELERY_CONFIG
    compose = Path(__file__).resolve().parents[2] / "docker-compose.yaml"
    assert f"AIRFLOW__CELERY__CELERY_CONFIG_OPTIONS: {option}" in compose.read_text()


def test_the_embedded_stack_s_executor_preloads_then_starts_airflow_s(tmp_path):
    """`llm-batch up` names the subclass; Airflow's executor loader resolves it as a local
    executor; start() has the task code imported before the workers fork."""
    env = Stack(Settings(home=tmp_path / "home"), 18081).env()
    assert env["AIRFLOW__CORE__EXECUTOR"] == "llm_batch.devstack.local_executor.LocalExecutor"
    probe = f"""
import sys
from airflow.executors.executor_loader import ExecutorLoader
from airflow.executors.local_executor import LocalExecutor
cls, _ = ExecutorLoader.import_executor_cls(ExecutorLoader.get_executor_names()[0])
assert issubclass(cls, LocalExecutor) and cls.is_local, cls
executor = cls(parallelism=1)
assert "llm_batch.infra.jobstore" not in sys.modules
executor.start()
try:
    assert "llm_batch.infra.jobstore" in sys.modules and "llm_batch.airflow.operators.local" in sys.modules
finally:
    executor.end()
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]
