"""The batch API under test: create_app() mounted at /batch, in the real Airflow test env.

Users (Airflow's simple auth manager): alice and bob (role user), vic (viewer), root
(admin). Each gets a real Airflow JWT; alice, bob and an admin also get llm-batch API keys.
Runs are really triggered in Airflow's metadata DB (``airflow_dags_in_db``); tests that
need a run to make progress drive the job store the way the pipeline does.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

# Before anything imports airflow (tests/fixtures/airflow.py set the rest of the env).
os.environ.setdefault("AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS", "alice:user,bob:user,vic:viewer,root:admin")
os.environ.setdefault("AIRFLOW__CORE__AUTH_MANAGER", "airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager")
os.environ.setdefault("LLM_ENGINE_DISABLE_VERSION_CHECK", "true")  # no PyPI lookup from tests
os.environ.setdefault("AIRFLOW__API_AUTH__JWT_SECRET", "llm-batch-tests-only-" + "x" * 64)

ROLES = {"alice": "user", "bob": "user", "vic": "viewer", "root": "admin"}


@dataclass(frozen=True)
class Credentials:
    tokens: dict[str, str]  # Airflow JWTs by user name
    keys: dict[str, str]  # llm-batch API keys by owner ("admin-key" is an admin key)

    def jwt(self, user: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.tokens[user]}"}

    def key(self, owner: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[owner]}"}


@pytest.fixture(scope="session")
def auth_manager(airflow_db):
    from airflow.api_fastapi.app import create_auth_manager

    manager = create_auth_manager()
    manager.init()
    return manager


@pytest.fixture(scope="session")
def api_store():
    from llm_batch.infra.jobstore import get_job_store

    return get_job_store()


def app_on(store, auth_manager, settings=None):
    """The plugin's app itself (create_app) on ``store``, with Airflow's auth manager (and the
    ``settings`` a test passes)."""
    from llm_batch.api.app import create_app

    api = create_app(settings=settings, store=store)
    api.state.auth_manager = auth_manager
    return api


def mounted(api, auth_manager):
    """``api`` mounted at /batch, as airflow api-server serves it."""
    from fastapi import FastAPI

    outer = FastAPI()
    outer.state.auth_manager = auth_manager
    outer.mount("/batch", api)
    return outer


@pytest.fixture(scope="session")
def batch_api(auth_manager, api_store, airflow_dags_in_db):
    return app_on(api_store, auth_manager)


@pytest.fixture(scope="session")
def batch_app(batch_api, auth_manager):
    return mounted(batch_api, auth_manager)


@pytest.fixture(scope="session")
def creds(auth_manager, api_store) -> Credentials:
    from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser

    tokens = {
        name: auth_manager.generate_jwt(SimpleAuthManagerUser(username=name, role=role), expiration_time_in_seconds=3600)
        for name, role in ROLES.items()
    }
    keys = {owner: api_store.create_api_key(owner, f"{owner} test key")[1] for owner in ("alice", "bob")}
    keys["admin-key"] = api_store.create_api_key("ops", "admin test key", is_admin=True)[1]
    return Credentials(tokens=tokens, keys=keys)


@pytest.fixture()
def client(batch_app) -> Iterator:
    from fastapi.testclient import TestClient

    with TestClient(batch_app, base_url="http://testserver/batch", raise_server_exceptions=False) as test_client:
        yield test_client


@pytest.fixture()
def cli() -> Callable[[str, str], Callable[[list[str]], int]]:
    """``cli(url, key)``: ``llm-batch`` commands run in this process against the batch API at
    ``url`` with ``key`` (the variables a user would set, given to each command)."""
    from llm_batch.cli.main import main

    def of(url: str, key: str) -> Callable[[list[str]], int]:
        env = {"LLM_BATCH_API_URL": url, "LLM_BATCH_API_KEY": key}
        return lambda argv: main(argv, env=env)

    return of


def chat_lines(n: int, model: str = "tiny-random-llama") -> bytes:
    import orjson

    return b"".join(
        orjson.dumps(
            {
                "custom_id": f"req-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {"model": model, "messages": [{"role": "user", "content": f"say {i}"}], "max_tokens": 4},
            }
        )
        + b"\n"
        for i in range(n)
    )


def dag_run_of(job_id: str):
    """The batch_inference run the API triggered for `job_id`, from Airflow's metadata DB."""
    from airflow.models.dagrun import DagRun
    from airflow.utils.session import create_session

    from llm_batch.api.dag_trigger import run_id_for

    with create_session() as session:
        run = session.query(DagRun).filter(DagRun.dag_id == "batch_inference", DagRun.run_id == run_id_for(job_id)).one_or_none()
        return None if run is None else {"run_id": run.run_id, "conf": dict(run.conf or {}), "state": str(run.state)}


# The usage of each simulated request.
PROMPT_TOKENS, COMPLETION_TOKENS, CACHED_TOKENS = 9, 4, 3


def simulate_run(store, job_id: str, ok: int, failed: int, cancel_after: int | None = None) -> None:
    """Move a job through the pipeline's states and counters the way the DAG does, with an
    output file object (and, for Scale, the JSON array at the user's output path)."""
    import orjson

    from llm_batch.core.config import get_settings
    from llm_batch.core.jobs import JobStatus
    from llm_batch.core.layout import JobLayout
    from llm_batch.infra import storage

    job = store.get_job(job_id)
    total = ok + failed
    store.transition(job_id, JobStatus.VALIDATING)
    store.set_counts(job_id, total=total, completed=0, succeeded=0, failed=0)
    store.transition(job_id, JobStatus.RUNNING)
    # Shard 0's watcher reports its first result (the rows' sum is the job's live counts).
    yield_point = store.report_shard(job_id, 0, state="running", total=total, done=1, succeeded=1,
                                     prompt_tokens=PROMPT_TOKENS, completion_tokens=COMPLETION_TOKENS,
                                     cached_prompt_tokens=CACHED_TOKENS, engine_seconds=2.0)
    yield yield_point  # the caller looks at live counts here
    store.add_counts(job_id, completed=total - 1, succeeded=ok - 1, failed=failed)
    store.transition(job_id, JobStatus.FINALIZING)
    # What merge sets: the sum of the output lines' usage.
    store.set_usage(job_id, prompt_tokens=PROMPT_TOKENS * ok, completion_tokens=COMPLETION_TOKENS * ok,
                    cached_prompt_tokens=CACHED_TOKENS * ok, reasoning_tokens=0)
    layout = JobLayout(get_settings().work_uri, job_id)
    results = [{"id": f"r{i}", "custom_id": f"req-{i}", "response": {"status_code": 200, "body": {}}} for i in range(ok)]
    storage.write_bytes(layout.output_jsonl, b"".join(orjson.dumps(r) + b"\n" for r in results))
    output = store.create_file(
        owner=job.owner, purpose="batch_output", filename=f"{job_id}_output.jsonl",
        bytes=storage.size(layout.output_jsonl), uri=layout.output_jsonl, kind="output", job_id=job_id,
    )
    store.set_outputs(job_id, output_file_id=output.id)
    if job.array_output_uri:
        storage.write_bytes(job.array_output_uri, orjson.dumps([{"text": "", "num_completion_tokens": 0}] * total))
    store.transition(job_id, JobStatus.SUCCEEDED)


@pytest.fixture(scope="session")
def live_server(batch_app) -> Iterator[str]:
    """The /batch app on a real HTTP port (uvicorn in a thread), for the unmodified SDKs."""
    import threading
    import time

    import uvicorn

    server = uvicorn.Server(uvicorn.Config(batch_app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test API server did not start")
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


@pytest.fixture(scope="module")
def airflow_api(batch_api, auth_manager):
    """Airflow's REST API app (no plugin app in a test process) behind the guard, as the plugin
    puts it in the api-server."""
    from airflow.api_fastapi.app import create_app
    from fastapi.testclient import TestClient

    from llm_batch.api import run_guard

    app = create_app(apps="core")
    app.state.auth_manager = auth_manager
    with TestClient(run_guard.RunOwnerGuard(app), raise_server_exceptions=False) as client:
        yield client
