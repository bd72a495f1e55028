"""Warm engines (``llm_batch.runtime.warm_engines``) on the tiny model: shards of different jobs on
one engine in turn, a second task waiting for the busy engine, cancel, a task that goes
away, kill -9 of the host mid-shard (exactly one result per request after the retry), a
request that is not a shard, idle engines of another configuration stopped to make room,
and the idle exit. The engines of two seats have their own module (test_warm_seats.py): a
host of another configuration stops this one's idle host before it loads, so the two kinds
of tests interleaved in one module (pytest-randomly's order) would restart hosts often.

The hosts are real ``llm-batch engine-host`` processes with the real engine, started the
way the local runner starts them (``start_shard``).
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
import uuid
from pathlib import Path

import orjson
import psutil
import pytest

from llm_batch.core import exit_codes
from llm_batch.core.config import get_settings
from llm_batch.core.layout import JobLayout
from llm_batch.infra import storage
from llm_batch.infra.processes import read_pid
from llm_batch.infra.progress import ShardState, read_progress
from llm_batch.infra.results import count_results, read_results
from llm_batch.runtime.warm_engines import HOST_GONE, Slot, engine_key, prewarm, start_shard, stop_hosts
from tests.engine.test_worker_process import _shard as make_shard

pytestmark = pytest.mark.engine

MODEL_CONFIG = {"model": "tiny-random-llama", "max_context_length": 512}
TIMEOUT_S = 240
# window 1: slow enough to act mid-shard.
SLOW = ("--window", "1", "--flush-every-records", "4")


@pytest.fixture(scope="module")
def settings(tiny_model_dir, hosts_home):
    # One slot, one seat, one configuration warm at a time (the default): every shard of these
    # tests goes to the same host, one at a time, unless it has died or another configuration
    # made it leave. The hosts are the module's own (hosts_home).
    return get_settings().model_copy(update={"home": hosts_home, "local_pool_slots": 1, "warm_engine_seats": 1,
                                             "warm_engine_configs": 1, "warm_engine_idle_seconds": 600})


def _shard(n: int, max_tokens: int = 8) -> JobLayout:
    """A local shard of ``n`` chat requests (indexes 1000..) in a job of its own."""
    return make_shard(get_settings().home, n, max_tokens)[0]


def _run(settings, layout: JobLayout, *extra: str, model_config=MODEL_CONFIG):
    """The shard on a warm engine, as the local runner hands it over; its log lines."""
    argv = ["worker", "--job-id", layout.job_id, "--shard", "0", "--work-uri", layout.work_uri,
            "--endpoint", "/v1/chat/completions", "--model-config", orjson.dumps(model_config).decode(),
            "--progress-interval-s", "0.5", *extra]
    lines: list[str] = []
    return start_shard(settings, model_config, argv, lines.append), lines


def _hold(layout: JobLayout, after_results: int) -> None:
    """The shard's first attempt holds after ``after_results`` (the worker's hold point): what
    a test does to it then (kill, cancel, detach, a shard beside it) lands mid-shard by
    construction."""
    storage.write_bytes(layout.hold_marker, orjson.dumps({"after_results": after_results}))


def _release(layout: JobLayout) -> None:
    storage.delete(layout.hold_marker)


def _wait_results(layout: JobLayout, at_least: int, shard=None) -> int:
    deadline = time.monotonic() + TIMEOUT_S
    while (done := count_results(layout.shard(0).results)) < at_least:
        assert shard is None or shard.poll() is None, f"shard ended early with {shard.returncode}"
        assert time.monotonic() < deadline, "timed out waiting for results"
        time.sleep(0.2)
    return done


def _assert_exactly_once(layout: JobLayout, total: int) -> None:
    records = list(read_results(layout.shard(0).results))
    assert [r.index for r in records] == list(range(1000, 1000 + total))
    assert [r.custom_id for r in records] == [f"c{i}" for i in range(total)]
    assert all(r.status_code == 200 for r in records)


def test_a_task_that_comes_while_the_engine_is_busy_waits_then_gets_it(settings):
    # The Celery shape runs two tasks per worker for its one engine: the second waits.
    first, second = _shard(10, max_tokens=16), _shard(3)
    _hold(first, 2)  # still running while the second waits, by construction
    running, _ = _run(settings, first, *SLOW)
    waiting: dict = {}
    handed = threading.Thread(target=lambda: waiting.update(shard=_run(settings, second)[0]))
    handed.start()
    _wait_results(first, 2, running)
    assert handed.is_alive(), "the second shard got the engine's slot while the first ran"
    _release(first)
    assert running.wait(TIMEOUT_S) == exit_codes.DONE
    handed.join(30)
    assert waiting["shard"].wait(TIMEOUT_S) == exit_codes.DONE
    assert waiting["shard"].pid == running.pid
    # Forked by the home's host starter (the default), which imported vLLM for it.
    starter = psutil.Process(running.pid).ppid()
    assert starter != os.getpid() and "llm_batch.runtime.host_starter" in " ".join(psutil.Process(starter).cmdline())
    _assert_exactly_once(first, 10)
    _assert_exactly_once(second, 3)


def test_cancel_marker_stops_a_warm_shard_and_the_engine_stays(settings):
    layout = _shard(30, max_tokens=16)
    _hold(layout, 8)
    shard, _ = _run(settings, layout, *SLOW)
    _wait_results(layout, 8, shard)
    marker = Path(layout.cancel_marker)
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_bytes(b"")
    assert shard.wait(TIMEOUT_S) == exit_codes.CANCELLED
    assert 8 <= count_results(layout.shard(0).results) < 30
    assert read_progress(layout.shard(0).progress).state == ShardState.CANCELLED
    after, _ = _run(settings, _shard(3))
    assert after.wait(TIMEOUT_S) == exit_codes.DONE and after.pid == shard.pid


def test_a_task_that_goes_away_stops_its_shard_and_the_retry_resumes(settings):
    layout = _shard(30, max_tokens=16)
    _hold(layout, 8)
    shard, _ = _run(settings, layout, *SLOW)
    _wait_results(layout, 8, shard)
    shard.detach()  # what on_kill does, and what a dead task's closed socket looks like
    shard.wait(TIMEOUT_S)
    deadline = time.monotonic() + 30
    while read_progress(layout.shard(0).progress).state != ShardState.FAILED:
        assert time.monotonic() < deadline, "the host did not stop the abandoned shard"
        time.sleep(0.2)
    stopped_at = count_results(layout.shard(0).results)
    retry, _ = _run(settings, layout)
    assert retry.wait(TIMEOUT_S) == exit_codes.DONE and retry.pid == shard.pid
    _assert_exactly_once(layout, 30)
    assert read_progress(layout.shard(0).progress).resumed >= stopped_at >= 8


def test_kill_9_of_the_warm_engine_mid_shard_then_retry_gives_exactly_once_and_the_next_job_runs_in_turn(settings):
    """Kill -9 of the host mid-shard: the retry starts a new engine and gives exactly one result
    per request. Then shards of two jobs in turn on that one engine: the next job's shard goes
    to the retry's process, which has its engine loaded (the retry, its first shard, loaded
    it), and each task's lines name its own job. (One test: both need a host started afresh,
    the costly part; the kill makes one whatever ran before.)"""
    layout = _shard(30, max_tokens=16)
    _hold(layout, 8)
    shard, _ = _run(settings, layout, *SLOW)
    _wait_results(layout, 8, shard)
    os.killpg(shard.pid, signal.SIGKILL)
    assert shard.wait(30) == HOST_GONE
    killed_at = count_results(layout.shard(0).results)
    assert killed_at < 30
    retry, lines = _run(settings, layout)
    assert retry.wait(TIMEOUT_S) == exit_codes.DONE
    assert retry.pid != shard.pid, "the retry should have started a new engine"
    _assert_exactly_once(layout, 30)
    final = read_progress(layout.shard(0).progress)
    assert final.done == final.total == 30 and final.resumed >= killed_at

    second = _shard(5)
    again, later_lines = _run(settings, second)
    assert again.wait(TIMEOUT_S) == exit_codes.DONE
    assert again.pid == retry.pid, "the second job's shard went to another process"
    assert any("already loaded" in line for line in later_lines), later_lines[-5:]
    assert not any("already loaded" in line for line in lines)
    # Each task's lines name its own job, as a dedicated worker's do.
    assert any(f"[job {second.job_id}]" in line for line in later_lines), later_lines[-5:]
    assert not any(f"[job {layout.job_id}]" in line for line in later_lines)
    _assert_exactly_once(second, 5)
    assert read_progress(second.shard(0).progress).state == ShardState.DONE


def test_not_a_shard_is_refused_and_the_host_keeps_serving(settings):
    layout = _shard(2)
    ok, _ = _run(settings, layout)
    assert ok.wait(TIMEOUT_S) == exit_codes.DONE
    slot = Slot(settings.home, engine_key(MODEL_CONFIG), 0)
    for request in (b"not json\n", b'{"argv": ["worker", "--shard", "x"]}\n', b'{"argv": ["rm", "-rf"]}\n'):
        with socket.socket(socket.AF_UNIX) as conn:
            conn.connect(str(slot.socket))
            conn.sendall(request)
            answer = conn.makefile("rb").read().splitlines()
        assert orjson.loads(answer[-1]) == {"exit": exit_codes.USAGE}, answer
    assert oct(slot.socket.stat().st_mode & 0o777) == "0o600"
    after, _ = _run(settings, _shard(2))
    assert after.wait(TIMEOUT_S) == exit_codes.DONE and after.pid == ok.pid


def test_another_configuration_stops_idle_engines_and_an_idle_engine_exits(settings):
    warm, _ = _run(settings, _shard(2))
    assert warm.wait(TIMEOUT_S) == exit_codes.DONE
    quick = settings.model_copy(update={"warm_engine_idle_seconds": 2})
    config = {**MODEL_CONFIG, "seed": 7}  # another configuration: an engine of its own
    shard, _ = _run(quick, _shard(2), model_config=config)
    assert shard.wait(TIMEOUT_S) == exit_codes.DONE
    assert shard.pid != warm.pid
    # The idle engine of the other configuration made room before the new one loaded.
    assert _ended(warm.pid) and not Slot(settings.home, engine_key(MODEL_CONFIG), 0).pid_file.exists()
    slot = Slot(settings.home, engine_key(config), 0)
    deadline = time.monotonic() + 60
    while slot.pid_file.exists() or slot.socket.exists():
        assert time.monotonic() < deadline, "the idle host did not exit"
        time.sleep(0.5)
    # Gone (a zombie until its parent, here this test process, reaps it: the task that
    # starts a host in production exits after its shard).
    deadline = time.monotonic() + 30
    while not _ended(shard.pid):
        assert time.monotonic() < deadline, "the idle host's process did not end"
        time.sleep(0.2)


def test_an_engine_started_early_is_the_one_the_first_shard_takes(settings):
    """A job's prepare step starts its engine before the shard asks (``prewarm``): the host loads
    the model at once, a second early start finds it up, and the shard runs on it, loaded."""
    config = {**MODEL_CONFIG, "seed": 11}  # a configuration of its own: cold here
    settings = settings.model_copy(update={"warm_engine_configs": 2})  # the other tests' engine stays
    slot = Slot(settings.home, engine_key(config), 0)
    assert prewarm(settings, config) is True
    host = read_pid(slot.pid_file)
    assert host and prewarm(settings, config) is False  # up: nothing more started
    deadline = time.monotonic() + TIMEOUT_S
    while "preloaded" not in slot.log.read_text():  # loaded with no shard asking
        assert time.monotonic() < deadline, slot.log.read_text()[-2000:]
        time.sleep(0.5)
    shard, _ = _run(settings, _shard(2), model_config=config)
    assert shard.wait(TIMEOUT_S) == exit_codes.DONE and shard.pid == host
    log = slot.log.read_text()
    assert "already loaded" in log.split("preloaded", 1)[1]
    assert "not a shard" not in log  # the early starts' connections are probes, not refused shards
    stop_hosts(settings.home, key=slot.key)  # the module's one configuration again


def _ended(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _prompt_shard(home, prompt: str) -> JobLayout:
    """A one-request shard of ``prompt`` (a job of its own)."""
    from llm_batch.core.records import BatchRequest, dumps_line

    layout = JobLayout(str(home / "work"), f"job-{uuid.uuid4().hex[:8]}")
    requests = Path(layout.shard(0).requests)
    requests.parent.mkdir(parents=True)
    requests.write_bytes(dumps_line(BatchRequest(index=0, custom_id="p", body={
        "messages": [{"role": "user", "content": prompt}], "max_tokens": 2})))
    return layout


def test_owners_share_a_warm_engine_but_not_its_prefix_cache(settings):
    """The server salts each owner's engine requests (core.owners.cache_salt): a prompt one
    owner sent before is served from the prefix cache to that owner again (cached_tokens > 0)
    and to nobody else (cached_tokens 0), on the one shared engine."""
    from llm_batch.core.owners import cache_salt

    prompt = " ".join(f"w{i}" for i in range(100))  # several KV blocks, within the 512-token context
    cached = {}
    pid = None
    for run, owner in (("first", "alice"), ("again", "alice"), ("other owner", "mallory")):
        layout = _prompt_shard(get_settings().home, prompt)
        shard, _ = _run(settings, layout, "--cache-salt", cache_salt(owner))
        assert shard.wait(TIMEOUT_S) == exit_codes.DONE
        assert pid in (None, shard.pid), "not the one warm engine"
        pid = shard.pid
        [record] = list(read_results(layout.shard(0).results))
        assert record.status_code == 200, record
        cached[run] = record.body["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
    assert cached["again"] > 0 and cached["other owner"] == 0, cached
