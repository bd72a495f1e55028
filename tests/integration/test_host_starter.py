"""The host starter (``llm_batch.runtime.host_starter``): real starter processes forking real
``llm-batch engine-host`` processes, the way warm engines start. The starters here import only
the CLI (``preload``), so no vLLM and no engine: what is tested is the fork itself (the host's
own session, folder, environment, log and title, one starter per environment, reuse, a
failing host, bad requests of any bytes, the idle exit, ``stop_hosts``). The warm-engine tests run their real engines
through the default starter (tests/engine/test_warm_*.py)."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import orjson
import psutil
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_batch.infra.processes import alive, read_pid
from llm_batch.runtime.host_starter import start_host, starter_key
from llm_batch.runtime.warm_engines import Slot, host_environment, socket_dir, starters_dir, stop_hosts
from tests.fuzzing import examples

LIGHT = ("llm_batch.cli.main", "llm_batch.cli.engine_service")
TIMEOUT_S = 30


def _host_argv(slot: Slot, idle_seconds: float = 60) -> list[str]:
    return ["engine-host", "--socket", str(slot.socket), "--pid-file", str(slot.pid_file), "--idle-seconds",
            str(idle_seconds), "--lock", str(slot.seat_locks(1)[0])]


def _greeting(slot: Slot) -> int:
    """The pid a listening host greets with."""
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.connect(str(slot.socket))
                with conn.makefile("rb") as lines:
                    return int(orjson.loads(lines.readline())["host"])
        except (OSError, ValueError):
            assert time.monotonic() < deadline, f"no host on {slot.socket}"
            time.sleep(0.1)


def _wait_exit(host) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while host.poll() is None:
        assert time.monotonic() < deadline, f"pid {host.pid} did not exit"
        time.sleep(0.1)


def _start(home: Path, slot: Slot, env: dict[str, str], argv: list[str] | None = None, idle_seconds: float = 60):
    return start_host(starters_dir(home), socket_dir(home), argv or _host_argv(slot), env, home, slot.log,
                      idle_seconds, preload=LIGHT)


@pytest.fixture
def home(tmp_path: Path):
    (tmp_path / "engines").mkdir()
    yield tmp_path
    stop_hosts(tmp_path)


def test_hosts_fork_from_one_starter_into_their_own_session_folder_and_environment(home):
    env = host_environment() | {"AIRFLOW_CTX_DAG_ID": "probe-1"}  # a task's variable: keys no starter
    first, second = Slot(home, "a" * 16, 0), Slot(home, "b" * 16, 0)
    started = _start(home, first, env)
    assert _greeting(first) == started.pid == read_pid(first.pid_file)
    starter_pid = read_pid(starters_dir(home) / f"{starter_key(env)}.pid")
    host = psutil.Process(started.pid)
    assert host.ppid() == starter_pid != os.getpid()
    assert os.getsid(started.pid) == started.pid  # its own session: a kill of its group is its own
    assert Path(host.cwd()) == home
    assert "llm_batch.cli.main engine-host --socket" in " ".join(host.cmdline())  # what ps shows: the host
    assert "warm engine listening on" in first.log.read_text()

    # Another task's variables: the same starter forks the second host.
    again = _start(home, second, host_environment() | {"AIRFLOW_CTX_DAG_ID": "probe-2"})
    assert _greeting(second) == again.pid != started.pid
    assert psutil.Process(again.pid).ppid() == starter_pid

    # Each child runs under the environment asked for (its settings read from it), not the starter's.
    listing = Slot(home, "f" * 16, 0)
    probe = home / "probe-model-cache"
    listed = _start(home, listing, env | {"LLM_BATCH_MODEL_CACHE": str(probe)}, argv=["models", "list"])
    _wait_exit(listed)
    assert f"model cache: {probe}" in listing.log.read_text()

    # A variable read at import time keys a starter of its own.
    third = Slot(home, "c" * 16, 0)
    other = _start(home, third, host_environment() | {"OMP_NUM_THREADS": "1"})
    assert _greeting(third) == other.pid
    assert psutil.Process(other.pid).ppid() not in (starter_pid, os.getpid())
    assert len(list(starters_dir(home).glob("*.pid"))) == 2

    stop_hosts(home)
    for pid in (started.pid, again.pid, other.pid, starter_pid):
        assert not alive(pid)
    assert not list(starters_dir(home).glob("*.pid"))


def test_a_failing_host_reports_in_its_log_and_the_starter_goes_on(home):
    slot = Slot(home, "d" * 16, 0)
    broken = _start(home, slot, host_environment(), argv=["engine-host", "--idle-seconds", "1"])  # no socket given
    _wait_exit(broken)
    assert "--socket, --lock and --pid-file" in slot.log.read_text()
    started = _start(home, slot, host_environment())
    assert _greeting(slot) == started.pid


def test_an_idle_starter_exits_and_the_next_start_brings_a_new_one(home):
    slot = Slot(home, "e" * 16, 0)
    env = host_environment()
    pid_file = starters_dir(home) / f"{starter_key(env)}.pid"
    started = _start(home, slot, env, argv=_host_argv(slot, idle_seconds=1), idle_seconds=1)
    first = read_pid(pid_file)
    assert _greeting(slot) == started.pid
    deadline = time.monotonic() + TIMEOUT_S
    while alive(first) or alive(started.pid):
        assert time.monotonic() < deadline, "the idle starter or host did not exit"
        time.sleep(0.2)
    assert not pid_file.exists()
    _start(home, slot, env)
    assert _greeting(slot) and read_pid(pid_file) not in (None, first)


def test_the_starter_key_is_what_is_read_at_import_time():
    env = {"PATH": "/bin", "OMP_NUM_THREADS": "2", "HF_HUB_CACHE": "/h", "LLM_BATCH_HOME": "/a",
           "AIRFLOW_CTX_DAG_ID": "x", "PYTEST_CURRENT_TEST": "t"}
    # Run-time settings, a task's context, and what vLLM's import or an engine set in the task's process.
    assert starter_key(env) == starter_key(env | {"LLM_BATCH_HOME": "/b", "AIRFLOW_CTX_DAG_ID": "y",
                                                  "PYTEST_CURRENT_TEST": "u", "LD_PRELOAD": "libgomp.so",
                                                  "KMP_INIT_AT_FORK": "FALSE", "LOCAL_WORLD_SIZE": "1"})
    for name, value in (("OMP_NUM_THREADS", "1"), ("VLLM_LOGGING_LEVEL", "DEBUG"), ("HF_HUB_CACHE", "/other"),
                        ("PATH", "/usr/bin"), ("PYTHONPATH", "/src")):
        assert starter_key(env) != starter_key(env | {name: value}), name


def test_bad_requests_get_no_host_and_the_starter_goes_on(home):
    slot = Slot(home, "9" * 16, 0)
    env = host_environment()
    first = _start(home, slot, env)
    assert _greeting(slot) == first.pid
    starter = psutil.Process(read_pid(starters_dir(home) / f"{starter_key(env)}.pid"))
    path = starter.cmdline()[starter.cmdline().index("--socket") + 1]
    for request in (b"not json\n", b"[1, 2]\n", b'{"argv": [1, {"a": 2}]}\n', b'{"argv": [], "env": 3}\n',
                    b'{"argv": ["x"], "env": {}, "cwd": "/", "log": "/no/such/folder/x.log"}\n', b"\n"):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(path)
            conn.sendall(request)
            conn.settimeout(TIMEOUT_S)
            assert conn.recv(100) == b"", request  # closed without a pid
    assert starter.is_running() and starter.children() == [psutil.Process(first.pid)]
    second = Slot(home, "8" * 16, 0)
    started = _start(home, second, env)
    assert _greeting(second) == started.pid


JSON = st.recursive(st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                    max_leaves=12)
FIELDS = st.fixed_dictionaries({}, optional={"argv": JSON, "env": JSON, "cwd": JSON, "log": JSON})


@pytest.fixture(scope="module")
def starter_socket(tmp_path_factory):
    """A live starter's socket (of a home of the module's own)."""
    home = tmp_path_factory.mktemp("starter-home")
    (home / "engines").mkdir()
    slot, env = Slot(home, "7" * 16, 0), host_environment()
    _start(home, slot, env)
    starter = psutil.Process(read_pid(starters_dir(home) / f"{starter_key(env)}.pid"))
    yield starter, starter.cmdline()[starter.cmdline().index("--socket") + 1]
    stop_hosts(home)


@settings(max_examples=examples(150), deadline=None, database=None)
@given(payload=st.one_of(st.binary(max_size=200), JSON.map(orjson.dumps), FIELDS.map(orjson.dumps)))
def test_any_request_bytes_leave_the_starter_serving(starter_socket, payload):
    starter, path = starter_socket
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(path)
        conn.sendall(payload.replace(b"\n", b" ") + b"\n")
        conn.settimeout(TIMEOUT_S)
        answer = conn.recv(100)
    assert answer == b"" or "pid" in orjson.loads(answer)  # nothing, or a host for a request it could run
    assert starter.is_running() and starter.status() != psutil.STATUS_ZOMBIE
