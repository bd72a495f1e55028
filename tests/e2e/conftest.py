"""The real embedded stack for end-to-end tests: one per session, shared by every test.

``e2e_stack`` starts api-server, scheduler, dag-processor and triggerer as processes
(``llm_batch.devstack.stack.Stack``) on a free 127.0.0.1 port under the session's temporary
LLM_BATCH_HOME, with the tiny random model prepared and eager vLLM (fast start-up). A
failing test prints the tails of the component logs and of its job's task logs.
"""

from __future__ import annotations

import os
import re
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fixtures.engine import TINY_MODEL

# Every job of the e2e tests: the tiny model (output is noise, structure is real).
MODEL = TINY_MODEL
# The e2e tests' one engine configuration beside the default: a sequence or two at a time, so
# results come one after another and a hold point finds a shard mid-run. One shared value:
# each configuration is an engine of its own to start (the stack keeps both warm).
FEW_SEQS = {"engine_args": {"max_num_seqs": 2}}
# The stack's Airflow users beside its admin (LLM_BATCH_AIRFLOW_USERS).
AIRFLOW_USERS = {"alice": "user", "bob": "user", "vic": "viewer"}


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    report = yield
    setattr(item, f"report_{report.when}", report)
    return report


# The in-process Airflow test settings (tests/fixtures/airflow.py) must not reach a real
# stack's components: unit-test mode changes scheduling (e.g. DAGs start unpaused).
NOT_IN_PROCESS_AIRFLOW: dict[str, str | None] = {
    "AIRFLOW__CORE__UNIT_TEST_MODE": None, "AIRFLOW__CORE__PLUGINS_FOLDER": None, "AIRFLOW_HOME": None}

# What the e2e stack's components get over the suite's environment (the suite's warm engines
# are the stack's default too).
E2E_ENV: dict[str, str | None] = {
    **NOT_IN_PROCESS_AIRFLOW,
    # The real stack checks models at create, as a user's does.
    "LLM_BATCH_CHECK_MODELS_AT_SUBMIT": "true",
    # A killed shard retries after 2 s instead of 10.
    "LLM_BATCH_SHARD_RETRY_DELAY_SECONDS": "2",
    "AIRFLOW__CORE__PARALLELISM": "4",
    # The default configuration, FEW_SEQS and another model's stay warm side by side (the
    # tests' order switches between them; each switch would otherwise start an engine).
    "LLM_BATCH_WARM_ENGINE_CONFIGS": "3",
    "LLM_BATCH_WARM_ENGINE_IDLE_SECONDS": "300",  # the default, not the in-process tests' 600
    # A task lost with a stopped scheduler is failed (and retried) after 45 s, not 5 min.
    "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT": "45",
    # The webhook tests' receiver listens on loopback, which only an admin's allow-list opens.
    "LLM_BATCH_WEBHOOK_ALLOWED_HOSTS": "127.0.0.1",
    # A database error in Airflow's own API says what it was (its class and message) in the
    # response a failing test prints, instead of an id to look up in a log CI does not keep.
    "AIRFLOW__API__EXPOSE_STACKTRACE": "True",
    # A live job still for 20 s counts as stuck (not 30 min): tests/e2e/test_prometheus.py
    # provokes one and waits for the shipped alert rule to fire.
    "LLM_BATCH_ALERT_JOB_STUCK_S": "20",
    # Airflow users beside the stack's admin, for the tests of who may change whose runs
    # (test_run_owners.py), as a deployment names them.
    "LLM_BATCH_AIRFLOW_USERS": ",".join(f"{name}:{role}" for name, role in AIRFLOW_USERS.items()),
}


def settings_with(env: dict[str, str | None], **fields: Any) -> Any:
    """The Settings a process reads from the suite's environment with ``env`` over it (and
    ``fields`` over both)."""
    from llm_batch.core.config import Settings

    given = {name.removeprefix("LLM_BATCH_").lower(): value for name, value in env.items()
             if name.startswith("LLM_BATCH_") and value is not None}
    return Settings(**{**given, **fields})


# Package scope: the stack (four Airflow components polling and parsing) is stopped once the
# e2e tests are done, so the engine, shape and unit tests after them have the cores.
@pytest.fixture(scope="package")
def e2e_stack(tiny_model_dir: Path, llm_batch_home: Path) -> Iterator[Any]:
    """The stack of the session's home (its settings: ``e2e_stack.settings``, its job store
    the stack's PostgreSQL), configured by ``E2E_ENV``; the e2e spec in the home's own
    folder ($LLM_BATCH_HOME/recurring), where a user's would be."""
    from llm_batch.devstack.stack import STATE_FILE, Stack, free_port

    _recurring_spec(llm_batch_home)
    stack = Stack.create(settings_with(E2E_ENV), free_port(), extra_env=E2E_ENV)
    try:
        stack.up(timeout=300)
    except Exception:
        print(stack_logs(stack))
        stack.down()
        raise
    yield stack
    try:
        stack.down()
    finally:
        # The session's home is the other tests' too: without the stack's state file, the
        # CLI's job store is the home's default again, not the stopped stack's (devstack.home).
        (stack.settings.home / STATE_FILE).unlink(missing_ok=True)


@pytest.fixture(scope="package")
def cli_env(e2e_stack) -> dict[str, str]:
    """The environment of an ``llm-batch`` process of the stack's user: the stack's
    configuration, its port (the CLI finds the API there) and its job store."""
    return {**e2e_stack.inherited_env(), "LLM_BATCH_API_PORT": str(e2e_stack.port),
            "LLM_BATCH_DATABASE_URL": e2e_stack.settings.database_url}


class AirflowAPI:
    """Airflow's REST API (/api/v2) on the stack, as the stack's admin. Requests go through
    the CLI's ``send_with_retries``, as users' clients (the CLI, ``up``) do: a stack a user
    keeps on SQLite answers 500 "database is locked" when a write waits past SQLite's busy
    timeout. (The stack's default, PostgreSQL, is held to no 5xx without retries:
    test_stack_up.py's concurrent triggers.)"""

    def __init__(self, stack: Any):
        self.api = f"{stack.base_url}/api/v2"
        self.headers = {"Authorization": f"Bearer {stack.airflow_token()}"}

    def send(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        from llm_batch.infra.api_client import send_with_retries

        return send_with_retries(lambda: httpx.request(method, f"{self.api}{path}", headers=self.headers,
                                                       timeout=30, **kwargs))

    def call(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self.send(method, path, **kwargs)
        assert response.status_code < 300, f"{method} {path}: {response.status_code} {response.text[:2000]}"
        return response.json()

    def wait_parsed(self, dag_id: str, timeout: float = 180) -> None:
        wait_until(f"{dag_id} parsed", lambda: self.send("GET", f"/dags/{dag_id}").status_code == 200, timeout)

    def trigger(self, dag_id: str, conf: dict[str, Any]) -> str:
        """Start a run of `dag_id` under a new run id chosen here, so a retried request is
        safe: a 409 can only be an earlier try of this one that committed."""
        run_id = f"manual__e2e_{uuid.uuid4().hex[:12]}"
        response = self.send("POST", f"/dags/{dag_id}/dagRuns",
                             json={"dag_run_id": run_id, "logical_date": None, "conf": conf})
        assert response.status_code < 300 or response.status_code == 409, (
            f"POST /dags/{dag_id}/dagRuns: {response.status_code} {response.text[:2000]}")
        return run_id


@pytest.fixture(scope="package")
def airflow(e2e_stack) -> AirflowAPI:
    return AirflowAPI(e2e_stack)


RECURRING_SPEC = "e2e_every_minute"
RECURRING_REQUESTS = 4


def _recurring_spec(home: Path) -> Path:
    """The user's spec folder with one spec scheduled every minute on a small input in the
    user root (an admin's spec may name any folder there)."""
    folder = home / "recurring"
    folder.mkdir(exist_ok=True)
    (home / "data" / "specs").mkdir(parents=True, exist_ok=True)
    batch = long_batch(home / "data" / "specs" / "recurring-input.jsonl", RECURRING_REQUESTS, first_tokens=8, step=2)
    (folder / f"{RECURRING_SPEC}.yaml").write_text(
        f"name: {RECURRING_SPEC}\n"
        'schedule: "* * * * *"\n'
        f"input_uri: {batch}\n"
        f"model: {MODEL}\n"
        "params: {labels: {suite: e2e}}\n"
    )
    return folder


@pytest.fixture
def batch_client(e2e_stack):
    from llm_batch.infra.api_client import BatchClient

    with BatchClient(f"{e2e_stack.base_url}/batch", e2e_stack.ensure_api_key()) as client:
        yield client


@pytest.fixture
def job_logs(request, e2e_stack) -> Iterator[list[str]]:
    """Tests append their job ids; on failure the stack's and those jobs' logs are printed, and
    those of its jobs still running are cancelled: the stack is shared, and a job left holding
    the pool's slot would fail the tests after it too."""
    job_ids: list[str] = []
    yield job_ids
    report = getattr(request.node, "report_call", None)
    if report is not None and report.failed:
        print(stack_logs(e2e_stack, job_ids))
        _cancel_unfinished(e2e_stack, job_ids)


def _cancel_unfinished(stack: Any, job_ids: list[str]) -> None:
    from llm_batch.infra.api_client import BatchClient

    with BatchClient(f"{stack.base_url}/batch", stack.ensure_api_key()) as client:
        for job_id in job_ids:
            try:
                if not client.job(job_id).terminal:
                    client.cancel(job_id)
            except Exception as exc:  # noqa: BLE001 (best effort; the failure is already reported)
                print(f"could not cancel {job_id}: {exc}")


def stack_logs(stack: Any, job_ids: list[str] = (), lines: int = 40) -> str:
    parts = []
    for log in sorted(stack.log_dir.glob("*.log")):
        parts.append(f"===== {log.name} (last {lines} lines)\n{_tail(log, lines)}")
    for job_id in job_ids:
        for log in sorted(stack.log_dir.glob(f"dag_id=*/run_id=*{job_id}*/task_id=*/**/*.log")):
            parts.append(f"===== {log.relative_to(stack.log_dir)}\n{_tail(log, lines)}")
    return "\n".join(parts)


def _tail(path: Path, lines: int) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"(unreadable: {exc})"


def wait_until(what: str, check: Callable[[], Any], timeout: float, poll: float = 1.0) -> Any:
    """Poll `check` until it returns something truthy; AssertionError naming `what` after
    `timeout` seconds (with the last value seen)."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")


def long_batch(path: Path, count: int, *, first_tokens: int = 60, step: int = 6) -> Path:
    """A JSONL chat batch whose requests finish one after another: request i generates
    exactly ``first_tokens + i * step`` tokens (ignore_eos), so results land in input order
    over time and a job can be stopped mid-run with some requests done and some not."""
    import orjson

    with path.open("wb") as out:
        for i in range(count):
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": f"request {i}: count slowly"}],
                "max_tokens": first_tokens + i * step,
                "ignore_eos": True,
                "temperature": 0,
            }
            line = {"custom_id": f"req-{i:04d}", "method": "POST", "url": "/v1/chat/completions", "body": body}
            out.write(orjson.dumps(line) + b"\n")
    return path


def read_jsonl(data: bytes) -> list[dict[str, Any]]:
    import orjson

    return [orjson.loads(line) for line in data.splitlines() if line.strip()]


def shard_pids(stack: Any, job_id: str) -> list[int]:
    """Process groups running a shard of ``job_id``: its ``llm-batch worker`` processes or,
    with warm engines (the stack's default), each warm engine host with a seat taken (the
    e2e tests run one job at a time, so those are its shards')."""
    return worker_pids(job_id) + busy_engine_hosts(stack)


def busy_engine_hosts(stack: Any) -> list[int]:
    """Pids of the stack's warm engine hosts that run a shard (a seat's lock is held)."""
    from llm_batch.infra.processes import read_pid
    from llm_batch.runtime.warm_engines import engines_dir

    busy = []
    for pid_file in engines_dir(stack.settings.home).glob("*.pid"):
        seats = pid_file.parent.glob(f"{pid_file.stem}.seat*.lock")
        if any(_lock_held(seat) for seat in seats) and (pid := read_pid(pid_file)):
            busy.append(pid)
    return busy


def _lock_held(path: Path) -> bool:
    import fcntl

    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops a lock taken here


def worker_pids(job_id: str) -> list[int]:
    """Pids of `llm-batch worker` processes running a shard of `job_id`."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"worker" in argv and job_id.encode() in argv:
            pids.append(int(proc.name))
    return pids


def hold_shards(job_id: str, after_results: int) -> None:
    """Each shard of ``job_id`` holds (its first attempt) once ``after_results`` of its results
    are checkpointed, until ``release_shards``: a fault then lands mid-shard by construction
    (the worker's hold point, llm_batch.runtime.worker.HoldPoint)."""
    import orjson

    from llm_batch.core.config import get_settings
    from llm_batch.core.layout import JobLayout
    from llm_batch.infra import storage

    storage.write_bytes(JobLayout(get_settings().work_uri, job_id).hold_marker,
                        orjson.dumps({"after_results": after_results}))


def release_shards(job_id: str) -> None:
    from llm_batch.core.config import get_settings
    from llm_batch.core.layout import JobLayout
    from llm_batch.infra import storage

    storage.delete(JobLayout(get_settings().work_uri, job_id).hold_marker)


def shard_held(job_id: str, shard: int, after_results: int) -> bool:
    """Whether the shard's published progress shows it running with its hold's results done."""
    from llm_batch.core.config import get_settings
    from llm_batch.core.layout import JobLayout
    from llm_batch.infra import storage
    from llm_batch.infra.progress import ShardState, read_progress

    try:
        progress = read_progress(JobLayout(get_settings().work_uri, job_id).shard(shard).progress)
    except (storage.StorageError, ValueError):  # not written yet
        return False
    return progress.state == ShardState.RUNNING and progress.done >= after_results


# The real browser of the UI tests.
CHROMIUM = "/usr/bin/chromium"
SHOTS = Path(__file__).resolve().parents[2] / "docs" / "ui"  # the screenshots docs/ui.md shows
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture
def browser_context(tmp_path):
    """A headless chromium (Debian's, driven by Playwright) that may reach only the stack's host."""
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: scripts/setup.sh installs it (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(tmp_path / "profile"), executable_path=CHROMIUM, args=ARGS, headless=True,
            accept_downloads=True, viewport={"width": 1400, "height": 900})
        # Nothing may come from the internet: any request off the stack's host fails the test.
        off_host: list[str] = []
        context.on("request", lambda r: None if r.url.startswith(("http://127.0.0.1", "data:", "blob:"))
                   else off_host.append(r.url))
        yield context
        context.close()
        assert not off_host, off_host


def jobs_frame(page):
    """The Batch jobs page inside Airflow's UI (an iframe of /batch/ui/jobs)."""
    try:
        return page.wait_for_selector('iframe[src*="/batch/ui/jobs"]', timeout=60_000).content_frame()
    except Exception:
        page.screenshot(path="/tmp/ui_page_no_iframe.png")
        raise


def logged_in(browser_context, base: str, password: str):
    """A new page, logged in to Airflow's UI as the stack's admin."""
    page = browser_context.new_page()
    page.goto(base + "/", wait_until="domcontentloaded")
    page.wait_for_selector('input[name="username"]', timeout=60_000)
    page.fill('input[name="username"]', "admin")
    page.fill('input[name="password"]', password)
    page.click('button[type="submit"]')
    page.wait_for_url(re.compile(r"^(?!.*/auth/login).*$"), timeout=60_000)
    return page
