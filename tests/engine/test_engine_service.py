"""Engine services (``llm_batch.runtime.warm_engines``): warm engines on TCP, as a Deployment's pods
run them, taking the small shards of the Kubernetes runner.

The hosts are real ``llm-batch engine-host --listen`` processes on 127.0.0.1 with the real
engine; the shard tasks are the real ``KubernetesShardOperator`` (its routing sends these
shards to the service: no pod is made), with the real job store. This test plays the
Deployment's part where one is needed: it starts a new host after one was killed.

Covered: two jobs' shards at once on one engine, each exactly once; cancel of one job;
kill -9 of the host mid-shard and SIGTERM (a rollout) mid-shard, each followed by the
retry on a fresh host: exactly once; and what an attacker on the network could send: no or a
wrong token, garbage, a huge line, a silent connection, another model, paths outside the
allowed roots. Each is refused with a usage exit and the host goes on serving.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import orjson
import pytest
from pydantic import SecretStr

pytest.importorskip("airflow.providers.cncf.kubernetes")

from airflow.sdk.exceptions import AirflowException  # noqa: E402

from llm_batch.airflow.operators.kubernetes import EngineServiceShardOperator, KubernetesShardOperator  # noqa: E402
from llm_batch.core import exit_codes  # noqa: E402
from llm_batch.core.config import Settings, get_settings  # noqa: E402
from llm_batch.core.layout import JobLayout  # noqa: E402
from llm_batch.devstack.stack import free_port  # noqa: E402
from llm_batch.infra.progress import ShardState, read_progress  # noqa: E402
from llm_batch.infra.results import count_results  # noqa: E402
from llm_batch.pipeline.shard_task import ShardTask  # noqa: E402
from llm_batch.runtime.warm_engines import MAX_REQUEST_BYTES, REQUEST_TIMEOUT_S  # noqa: E402
from tests.engine.test_warm_engine import _assert_exactly_once, _hold, _wait_results  # noqa: E402
from tests.engine.test_worker_process import _shard as make_shard  # noqa: E402

pytestmark = [pytest.mark.engine, pytest.mark.airflow]

MODEL = "tiny-random-llama"
MODEL_CONFIG = orjson.dumps({"model": MODEL, "max_context_length": 512}).decode()
TOKEN = "s3cret-engine-token"
TIMEOUT_S = 240
# A shard to act on mid-way: held after its first results (the worker's hold point, below),
# with more requests than the engine runs at once (max_num_seqs), so the hold lands mid-shard
# by construction, not by the machine's speed.
LONG = (800, 16)


class PortTaken(AssertionError):
    """Another process bound the host's free port while its model loaded."""


class Host:
    """One engine service pod's process; ``restart()`` is the Deployment bringing it back.
    ``settings``: the Airflow workers' (their shard tasks route to this service), whose
    variables the pod gets too."""

    def __init__(self, home, port: int):
        self.home, self.port = home, port
        self.log = home / f"engine-service-{port}.log"
        self.process: subprocess.Popen | None = None
        self.settings = get_settings().model_copy(update={
            "engine_services": {MODEL: f"127.0.0.1:{port}"}, "engine_token": SecretStr(TOKEN),
            "cancel_grace_seconds": 30, "engine_service_max_requests": LONG[0]})
        self.env = {"LLM_BATCH_ENGINE_SERVICES": orjson.dumps(self.settings.engine_services).decode(),
                    "LLM_BATCH_CANCEL_GRACE_SECONDS": "30", "LLM_BATCH_ENGINE_SERVICE_MAX_REQUESTS": str(LONG[0])}

    def start(self, token: str = TOKEN) -> subprocess.Popen:
        """Start the host and wait until it says it listens (it binds its port only once its
        model is loaded: a connect alone could reach whoever took the port meanwhile)."""
        env = {**os.environ, **self.env, "LLM_BATCH_ENGINE_TOKEN": token}
        logged = self.log.stat().st_size if self.log.exists() else 0
        with open(self.log, "ab") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "llm_batch.cli.main", "engine-host", "--listen", f"127.0.0.1:{self.port}",
                 "--model", MODEL, "--seats", "2", "--preload", '{"max_context_length": 512}'], env=env, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True)
        deadline = time.monotonic() + 180
        while f"listening on 127.0.0.1:{self.port}" not in (said := self.log.read_bytes()[logged:].decode(errors="replace")):
            if self.process.poll() is not None:
                raise (PortTaken if "Address already in use" in said else AssertionError)(said[-2000:])
            assert time.monotonic() < deadline, "the engine service did not listen"
            time.sleep(0.2)
        return self.process

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(30)


@pytest.fixture(scope="module")
def host(tiny_model_dir, llm_batch_home):
    for tries_left in reversed(range(3)):
        service = Host(llm_batch_home, free_port())
        try:
            service.start()
            break
        except PortTaken:
            if not tries_left:
                raise
    yield service
    service.stop()


def _job(n: int, max_tokens: int = 8) -> tuple[JobLayout, dict]:
    """A job of ``n`` chat requests in the store, and its one shard's task."""
    from llm_batch.infra.jobstore import get_job_store

    layout = make_shard(get_settings().home, n, max_tokens)[0]
    get_job_store(get_settings().database_url).create_job(
        id=layout.job_id, dialect="airflow", endpoint="/v1/chat/completions", model=MODEL, owner="alice",
        max_runtime_sec=3600)
    shard = layout.shard(0)
    task = ShardTask(job_id=layout.job_id, shard=0, requests_uri=shard.requests, results_uri=shard.results,
                     progress_uri=shard.progress, cancel_marker=layout.cancel_marker,
                     endpoint="/v1/chat/completions", model_config_json=MODEL_CONFIG,
                     deadline="2099-01-01T00:00:00+00:00", gpu_type="nvidia-ampere-a10", requests=n)
    return layout, task.model_dump()


class Attempt(threading.Thread):
    """One shard task attempt (KubernetesShardOperator.execute) in a thread, on an Airflow
    worker with ``settings``."""

    def __init__(self, shard_task: dict, settings: Settings):
        super().__init__(daemon=True)
        self.operator = KubernetesShardOperator(task_id="run_shard", shard_task=shard_task)
        self.operator.llm_settings = settings
        self.outcome: dict | None = None
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self.outcome = self.operator.execute({})
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            self.error = exc

    def result(self) -> dict:
        self.join(TIMEOUT_S)
        assert not self.is_alive(), "the shard task did not end"
        if self.error is not None:
            raise self.error
        return self.outcome


def test_two_jobs_shards_run_at_once_on_the_service_and_no_pod_is_made(host):
    (first, first_task), (second, second_task) = _job(12), _job(5)
    attempts = [Attempt(first_task, host.settings), Attempt(second_task, host.settings)]
    assert all(isinstance(a.operator.pod_operator(), EngineServiceShardOperator) for a in attempts)
    assert [a.result()["state"] for a in attempts] == ["done", "done"]
    _assert_exactly_once(first, 12)
    _assert_exactly_once(second, 5)
    assert read_progress(second.shard(0).progress).state == ShardState.DONE
    # Preloaded before it listened: both shards found the engine warm.
    log = host.log.read_text()
    assert log.index("preloaded") < log.index("engine service for model") and log.count("already loaded") >= 2
    assert host.process.poll() is None, "the service should stay up for the next jobs"


def test_cancel_stops_one_jobs_shard_and_not_the_other(host):
    from llm_batch.infra.jobstore import get_job_store

    (cancelled, cancelled_task), (kept, kept_task) = _job(*LONG), _job(6)
    _hold(cancelled, 4)
    running = Attempt(cancelled_task, host.settings)
    _wait_results(cancelled, 4)
    beside = Attempt(kept_task, host.settings)
    get_job_store(get_settings().database_url).request_cancel(cancelled.job_id)
    assert running.result()["state"] == "cancelled"
    assert beside.result()["state"] == "done"
    assert 4 <= count_results(cancelled.shard(0).results) < LONG[0]
    _assert_exactly_once(kept, 6)


@pytest.mark.parametrize("stop", ["kill -9", "SIGTERM"])
def test_host_lost_mid_shard_then_the_retry_on_a_fresh_host_gives_exactly_once(host, stop):
    layout, task = _job(*LONG)
    _hold(layout, 8)
    first = Attempt(task, host.settings)
    _wait_results(layout, 8)
    if stop == "kill -9":
        os.killpg(host.process.pid, signal.SIGKILL)
    else:  # a rollout: the host stops its shards (results flushed) and exits
        host.process.send_signal(signal.SIGTERM)
    with pytest.raises(AirflowException):  # the attempt failed: Airflow retries it
        first.result()
    assert host.process.wait(60) is not None
    lost_at = count_results(layout.shard(0).results)
    assert lost_at < LONG[0]
    host.start()  # the Deployment's new pod
    assert Attempt(task, host.settings).result()["state"] == "done"
    _assert_exactly_once(layout, LONG[0])
    assert read_progress(layout.shard(0).progress).resumed >= lost_at


def _ask(port: int, payload: bytes, wait_s: float = 30) -> list[dict]:
    """Send ``payload`` raw, as anyone on the network could; the host's answer lines."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait_s) as conn:
        try:
            conn.sendall(payload)
        except OSError:
            pass  # the host closed on a huge line before we finished: its answer is still there
        return [orjson.loads(line) for line in conn.makefile("rb").read().splitlines()]


def _argv(layout: JobLayout, **changes: str) -> list[str]:
    shard = layout.shard(0)
    flags = {"--job-id": layout.job_id, "--shard": "0", "--requests": shard.requests, "--results": shard.results,
             "--endpoint": "/v1/chat/completions", "--model-config": MODEL_CONFIG, **changes}
    return ["worker", *[part for flag, value in flags.items() for part in (flag, value)]]


def test_what_an_attacker_sends_is_refused_and_the_host_keeps_serving(host):
    layout, task = _job(2)
    good = _argv(layout)
    refused = {
        "no token": orjson.dumps({"argv": good}) + b"\n",
        "wrong token": orjson.dumps({"token": "guess", "argv": good}) + b"\n",
        "token not a string": orjson.dumps({"token": ["s3cret"], "argv": good}) + b"\n",
        "not json": b"GET / HTTP/1.1\r\n\r\n",
        "a json array": b"[1, 2]\n",
        "not a worker command": orjson.dumps({"token": TOKEN, "argv": ["rm", "-rf", "/"]}) + b"\n",
        "another model": orjson.dumps({"token": TOKEN, "argv": _argv(
            layout, **{"--model-config": '{"model": "smollm2-135m-instruct"}'})}) + b"\n",
        "results outside the allowed roots": orjson.dumps({"token": TOKEN, "argv": _argv(
            layout, **{"--results": "/etc/llm-batch-results"})}) + b"\n",
        "requests from the system's files": orjson.dumps({"token": TOKEN, "argv": _argv(
            layout, **{"--requests": "/etc/passwd"})}) + b"\n",
    }
    for what, payload in refused.items():
        answer = _ask(host.port, payload)
        assert answer[0].keys() == {"host"}, what
        assert answer[-1] == {"exit": exit_codes.USAGE}, (what, answer)
    wrong = _ask(host.port, refused["wrong token"])
    assert any("token" in line.get("log", "") for line in wrong), wrong
    assert not any(TOKEN in str(line) for line in wrong)
    other = _ask(host.port, refused["another model"])
    assert any("serves model" in line.get("log", "") for line in other), other
    assert not os.path.exists("/etc/llm-batch-results")

    # A line past MAX_REQUEST_BYTES: refused, unless the host's close (with our bytes unread)
    # reset the connection before its answer arrived.
    try:
        huge = _ask(host.port, b"{" + b" " * (MAX_REQUEST_BYTES + 16) + b"\n")
    except ConnectionResetError:
        huge = [{"exit": exit_codes.USAGE}]
    assert huge[-1] == {"exit": exit_codes.USAGE}, huge

    # A connection that never says anything is closed after REQUEST_TIMEOUT_S.
    started = time.monotonic()
    assert _ask(host.port, b"", wait_s=REQUEST_TIMEOUT_S + 20)[-1] == {"exit": exit_codes.USAGE}
    assert time.monotonic() - started < REQUEST_TIMEOUT_S + 15

    assert host.process.poll() is None
    assert Attempt(task, host.settings).result()["state"] == "done"
    _assert_exactly_once(layout, 2)


def test_a_service_refuses_to_listen_without_a_token(llm_batch_home):
    env = {k: v for k, v in os.environ.items() if k != "LLM_BATCH_ENGINE_TOKEN"}
    done = subprocess.run([sys.executable, "-m", "llm_batch.cli.main", "engine-host", "--listen",
                           f"127.0.0.1:{free_port()}", "--model", MODEL], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == exit_codes.USAGE
    assert "token" in done.stderr
