"""Warm engines of two seats (``llm_batch.runtime.warm_engines``) on the tiny model: two jobs'
shards at once on one engine, cancel of one, a retry beside its abandoned attempt, kill -9
mid both.

A module of their own (the one-seat tests: test_warm_engine.py): a host of another
configuration stops an idle host before it loads, so the two kinds of tests interleaved in
one module would start hosts again and again; here one host serves the module, started again
only after the kill.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from llm_batch.core import exit_codes
from llm_batch.core.config import get_settings
from llm_batch.infra.results import count_results
from llm_batch.runtime.warm_engines import HOST_GONE
from tests.engine.test_warm_engine import (
    MODEL_CONFIG,
    SLOW,
    TIMEOUT_S,
    _assert_exactly_once,
    _hold,
    _release,
    _run,
    _shard,
    _wait_results,
)

pytestmark = pytest.mark.engine

SEATED_CONFIG = {**MODEL_CONFIG, "seed": 11}  # an engine of its own, started with two seats


@pytest.fixture(scope="module")
def seated(tiny_model_dir, hosts_home):
    # One slot of two seats: every shard of these tests goes to the same host, two at a time.
    # The hosts are the module's own (hosts_home).
    return get_settings().model_copy(update={"home": hosts_home, "local_pool_slots": 1, "warm_engine_seats": 2,
                                             "warm_engine_idle_seconds": 600})


def test_two_seats_run_two_jobs_shards_at_once_on_one_engine(seated):
    long, short = _shard(20, max_tokens=16), _shard(4)
    _hold(long, 2)  # still running when the short one ends, by construction
    running, _ = _run(seated, long, *SLOW, model_config=SEATED_CONFIG)
    _wait_results(long, 2, running)
    beside, lines = _run(seated, short, model_config=SEATED_CONFIG)
    assert beside.wait(TIMEOUT_S) == exit_codes.DONE
    assert running.poll() is None, "the second shard waited for the first instead of running beside it"
    assert beside.pid == running.pid and any("seat 1" in line for line in lines), lines[:3]
    _release(long)
    assert running.wait(TIMEOUT_S) == exit_codes.DONE
    _assert_exactly_once(long, 20)
    _assert_exactly_once(short, 4)
    # Each task's log holds its own shard's lines, not the other's.
    assert any("done: 4/4 done" in line for line in lines), lines
    assert not any("/20 done" in line for line in lines), lines


def test_cancel_of_one_job_stops_its_shard_and_not_the_one_beside_it(seated):
    cancelled, other = _shard(30, max_tokens=16), _shard(10, max_tokens=16)
    _hold(cancelled, 4)
    shards = [_run(seated, layout, *SLOW, model_config=SEATED_CONFIG)[0] for layout in (cancelled, other)]
    _wait_results(cancelled, 4, shards[0])
    marker = Path(cancelled.cancel_marker)
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_bytes(b"")
    assert [shard.wait(TIMEOUT_S) for shard in shards] == [exit_codes.CANCELLED, exit_codes.DONE]
    assert shards[0].pid == shards[1].pid
    assert 4 <= count_results(cancelled.shard(0).results) < 30
    _assert_exactly_once(other, 10)


def test_a_retry_waits_for_its_abandoned_attempt_on_a_seated_engine(seated):
    layout = _shard(30, max_tokens=16)
    _hold(layout, 8)
    shard, _ = _run(seated, layout, *SLOW, model_config=SEATED_CONFIG)
    _wait_results(layout, 8, shard)
    shard.detach()
    shard.wait(TIMEOUT_S)
    # At once, on the other seat, while the abandoned attempt may still be stopping: the host
    # runs the retry after it, so no result is written twice.
    retry, _ = _run(seated, layout, model_config=SEATED_CONFIG)
    assert retry.wait(TIMEOUT_S) == exit_codes.DONE and retry.pid == shard.pid
    _assert_exactly_once(layout, 30)


def test_kill_9_of_a_seated_engine_mid_two_shards_then_retries_give_exactly_once(seated):
    first, second = _shard(30, max_tokens=16), _shard(30, max_tokens=16)
    for layout in (first, second):
        _hold(layout, 4)
    shards = [_run(seated, layout, *SLOW, model_config=SEATED_CONFIG)[0] for layout in (first, second)]
    for layout, shard in zip((first, second), shards):
        _wait_results(layout, 4, shard)
    assert shards[0].pid == shards[1].pid
    os.killpg(shards[0].pid, signal.SIGKILL)
    assert [shard.wait(30) for shard in shards] == [HOST_GONE, HOST_GONE]
    retries = [_run(seated, layout, model_config=SEATED_CONFIG)[0] for layout in (first, second)]
    assert [retry.wait(TIMEOUT_S) for retry in retries] == [exit_codes.DONE, exit_codes.DONE]
    assert retries[0].pid == retries[1].pid != shards[0].pid
    for layout in (first, second):
        _assert_exactly_once(layout, 30)
