"""llm_batch_operators.celery_config: Airflow's Celery configuration as it is, and the task code a
worker imports once before its pool forks (every name real, a failure only logged)."""

from __future__ import annotations

import importlib
import logging
from pathlib import Path

import pytest
from airflow.providers.celery.executors.default_celery import DEFAULT_CELERY_CONFIG

from llm_batch_operators import celery_config
from llm_batch.celery_stack import CeleryStack
from llm_batch.config import Settings


def test_the_configuration_is_airflow_s():
    assert celery_config.CELERY_CONFIG is DEFAULT_CELERY_CONFIG


@pytest.mark.parametrize("runner", ["local", "kubernetes"])
def test_every_preloaded_module_exists(runner):
    names = celery_config.preload_modules(runner)
    assert "llm_batch.jobstore" in names
    for name in names:
        importlib.import_module(name)


def test_a_module_that_fails_to_import_is_only_logged(monkeypatch, caplog):
    monkeypatch.setattr(celery_config, "TASK_MODULES", ("llm_batch.no_such_module",))
    with caplog.at_level(logging.WARNING, logger="llm_batch_operators.celery_config"):
        celery_config._preload(sender=None)
    assert "not preloaded llm_batch.no_such_module" in caplog.text


def test_the_shape_and_compose_name_it(tmp_path):
    shape = CeleryStack.create(Settings(home=tmp_path / "home"), 18080, workers=1)
    option = shape.worker_env(1)["AIRFLOW__CELERY__CELERY_CONFIG_OPTIONS"]
    module, _, attr = option.rpartition(".")
    assert getattr(importlib.import_module(module), attr) is DEFAULT_CELERY_CONFIG
    compose = Path(__file__).resolve().parents[2] / "docker-compose.yaml"
    assert f"AIRFLOW__CELERY__CELERY_CONFIG_OPTIONS: {option}" in compose.read_text()
