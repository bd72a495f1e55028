"""The embedded stack's database: PostgreSQL for a new home, SQLite kept by a home that ran on
it, chosen per home and recorded in stack.json; its PostgreSQL server asks for a password."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.exc import OperationalError

from llm_batch.core.config import Settings
from llm_batch.devstack.stack import DATABASE_ENV, Stack, StackError, database_state
from llm_batch.infra.user_paths import internal_areas


def test_a_new_home_runs_on_postgres_with_the_job_store_beside_airflow(tmp_path):
    stack = Stack.create(Settings(home=tmp_path / "home"), 18090)
    assert stack.database == "postgres"
    state = json.loads((tmp_path / "home" / "stack.json").read_text())
    assert stat.S_IMODE((tmp_path / "home" / "stack.json").stat().st_mode) == 0o600  # holds the password
    port, password = state["postgres"]["port"], state["postgres"]["password"]
    assert stack.settings.database_url.endswith(f"@127.0.0.1:{port}/llm_batch")
    env = stack.env()
    assert env["LLM_BATCH_DATABASE_URL"] == stack.settings.database_url  # the components' job store
    assert env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"].endswith(f"@127.0.0.1:{port}/airflow")
    assert password in env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"]
    assert "AIRFLOW__DATABASE__SQL_ALCHEMY_CONNECT_ARGS" not in env  # SQLite's busy timeout
    # The same home again: the same server, port and password.
    assert Stack.create(Settings(home=tmp_path / "home"), 18090).settings.database_url == stack.settings.database_url


def test_a_home_that_ran_on_sqlite_keeps_it_until_told(tmp_path):
    home = tmp_path / "home"
    (home / "airflow").mkdir(parents=True)
    (home / "airflow" / "airflow.db").touch()  # a stack from before stack.json
    stack = Stack.create(Settings(home=home), 18090)
    assert stack.database == "sqlite"
    assert stack.settings.database_url == f"sqlite:///{home / 'jobs.db'}"
    assert stack.env()["AIRFLOW__DATABASE__SQL_ALCHEMY_CONNECT_ARGS"].endswith("CONNECT_ARGS")
    # Told (flag or environment), it switches, and the choice is kept.
    assert Stack.create(Settings(home=home), 18090, "postgres").database == "postgres"
    assert Stack.create(Settings(home=home), 18090).database == "postgres"
    assert Stack.create(Settings(home=home), 18090, environ={DATABASE_ENV: "sqlite"}).database == "sqlite"
    with pytest.raises(StackError, match="unknown stack database 'mysql'"):
        database_state(home, environ={DATABASE_ENV: "mysql"})


def test_the_stack_files_are_never_a_user_path(tmp_path):
    areas = internal_areas(Settings(home=tmp_path))
    for name in ("stack.json", "postgres", "celery", "airflow", "api-key"):
        assert (tmp_path / name).resolve() in areas


def test_its_postgres_asks_for_the_password(tmp_path):
    stack = Stack.create(Settings(home=tmp_path / "home"), 18090)
    stack.services_up(timeout=60)
    try:
        assert stack.services_status() == {"postgres": True}
        with create_engine(stack.settings.database_url).connect() as connection:
            assert connection.execute(text("SELECT current_database()")).scalar() == "llm_batch"
        no_password = stack.settings.database_url.replace(f":{stack.postgres().password}@", "@")
        assert no_password != stack.settings.database_url
        with pytest.raises(OperationalError, match="password"):
            create_engine(no_password).connect()
    finally:
        stack.services_down()
    assert stack.services_status() == {"postgres": None}


def test_down_stops_the_server_after_a_switch_to_sqlite(tmp_path):
    home = tmp_path / "home"
    on_postgres = Stack.create(Settings(home=home), 18090)
    on_postgres.services_up(timeout=60)
    on_sqlite = Stack.create(Settings(home=home), 18090, "sqlite")
    on_sqlite.services_down()
    assert not on_postgres.postgres().running()


def test_the_cli_finds_the_home_stack_store(tmp_path):
    from llm_batch.devstack.home import job_store_url

    settings = Settings(home=tmp_path / "home")
    # No stack made yet: the settings' default (nothing written to the home).
    assert job_store_url(settings=settings, environ={}) == f"sqlite:///{tmp_path / 'home' / 'jobs.db'}"
    assert not (tmp_path / "home" / "stack.json").exists()
    url = Stack.create(settings).settings.database_url  # what `up` makes
    assert job_store_url(settings=settings, environ={}) == url and url.startswith("postgresql")
    assert job_store_url("sqlite:///x.db", settings=settings, environ={}) == "sqlite:///x.db"
    # LLM_BATCH_DATABASE_URL names a store: the settings read from that environment win.
    named = {"LLM_BATCH_DATABASE_URL": "sqlite:////elsewhere.db"}
    elsewhere = Settings(home=tmp_path / "home", database_url=named["LLM_BATCH_DATABASE_URL"])
    assert job_store_url(settings=elsewhere, environ=named) == "sqlite:////elsewhere.db"


def test_the_postgres_folder_is_the_homes(tmp_path):
    stack = Stack.create(Settings(home=tmp_path / "home"), 18090)
    root = Path(json.loads((tmp_path / "home" / "stack.json").read_text())["postgres"]["root"])
    assert root == stack.postgres().root
    assert root == tmp_path / "home" / "postgres" or root.name.startswith("llm-batch-pg-")  # as root: a temp folder


def test_api_key_says_so_when_the_stack_s_store_does_not_answer(tmp_path, capsys):
    from llm_batch.cli.main import main

    settings = Settings(home=tmp_path / "home")
    Stack.create(settings)  # made, never started
    assert main(["api-key", "create", "erin"], settings=settings) == 1
    err = capsys.readouterr().err
    assert "the job store does not answer" in err and "llm-batch status" in err
    assert "Traceback" not in err


def test_a_home_deleted_and_made_again_at_its_path_gets_a_new_database(tmp_path):
    import shutil

    home = tmp_path / "home"
    first = Stack.create(Settings(home=home), 18090)
    first.services_up(timeout=60)
    first.services_down()
    first_root = first.postgres().root
    shutil.rmtree(home)  # (as root the cluster lives in the temp dir and outlives the home)
    again = Stack.create(Settings(home=home), 18090)
    # Inside the home (deleted with it), or as root a new folder beside the old cluster.
    assert again.postgres().root != first_root or first_root.is_relative_to(home)
    again.services_up(timeout=60)  # a new password, a new cluster: it lets the stack in
    try:
        with create_engine(again.settings.database_url).connect() as connection:
            assert connection.execute(text("SELECT 1")).scalar() == 1
    finally:
        again.services_down()


def test_the_stack_runs_warm_engines_unless_told_not_to(tmp_path):
    """Warm by default on the embedded stack (a small job pays no engine start); a home's
    explicit choice wins, and the components and the pool's slots follow the stack's."""
    from llm_batch.airflow.lanes import runner_pool_specs

    warm = Stack.create(Settings(home=tmp_path / "home"), 18090, "sqlite")
    assert warm.settings.warm_engines and warm.env()["LLM_BATCH_WARM_ENGINES"] == "true"
    told = Stack.create(Settings(home=tmp_path / "home", warm_engines=False), 18090, "sqlite")
    assert not told.settings.warm_engines and told.env()["LLM_BATCH_WARM_ENGINES"] == "false"
    slots = {spec.name: spec.slots for spec in runner_pool_specs(warm.settings)}
    assert slots[warm.settings.local_pool] == warm.settings.local_pool_slots * warm.settings.warm_engine_seats
