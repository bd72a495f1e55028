"""Which idle warm engines a new model configuration stops (``warm_engines._evict_idle``),
with processes standing in for hosts (their own sessions, as hosts are): at most
``warm_engine_configs`` configurations stay warm, the least recently used go first (a host's
start or its last shard), and a host serving a shard (a seat's lock held) is never stopped."""

from __future__ import annotations

import fcntl
import os
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from llm_batch.core.config import Settings
from llm_batch.runtime.warm_engines import Slot, _evict_idle, engine_key, start_shard

SEATS = 2


@pytest.fixture
def hosts(tmp_path: Path) -> Iterator[dict[str, Slot]]:
    """Three configurations' idle hosts, started a, b, c in that order."""
    slots, procs = {}, []
    for n, key in enumerate("abc"):
        slot = Slot(tmp_path, key * 16, 0)
        proc = subprocess.Popen(["sleep", "120"], start_new_session=True)
        procs.append(proc)
        slot.pid_file.write_text(str(proc.pid))
        os.utime(slot.pid_file, (time.time() - 100 + n, time.time() - 100 + n))
        slots[key] = slot
    yield slots
    for proc in procs:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize(("configs", "left"), [(1, set()), (2, {"c"}), (3, {"b", "c"}), (4, {"a", "b", "c"})])
def test_a_new_configuration_leaves_the_most_recent_others_warm(hosts, configs, left):
    _evict_idle(Slot(hosts["a"].home, "n" * 16, 0), SEATS, configs, grace=2)
    assert {k for k, s in hosts.items() if s.pid_file.exists()} == left


def test_a_host_serving_a_shard_stays_and_idle_ones_go_in_its_place(hosts):
    seat = os.open(hosts["a"].seat_locks(SEATS)[1], os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(seat, fcntl.LOCK_EX)  # a's host serves a shard
    try:
        _evict_idle(Slot(hosts["a"].home, "n" * 16, 0), SEATS, 2, grace=2)
    finally:
        os.close(seat)
    assert {k for k, s in hosts.items() if s.pid_file.exists()} == {"a"}


def test_a_shard_handed_to_a_host_makes_it_the_most_recently_used(tmp_path):
    """start_shard marks the host it reaches as used now (its pid file's time), so a host that
    serves shards all along outlives idle ones started after it."""
    settings = Settings(home=tmp_path, local_pool_slots=1, warm_engine_seats=2)
    config = {"model": "m"}
    slot = Slot(tmp_path, engine_key(config), 0)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(slot.socket))
    listener.listen(1)

    def stand_in_host() -> None:  # the protocol's host side: greet, read the shard, end it
        conn, _ = listener.accept()
        with conn, conn.makefile("rb") as stream:
            conn.sendall(b'{"host": %d}\n' % os.getpid())
            stream.readline()
            conn.sendall(b'{"exit": 0}\n')

    threading.Thread(target=stand_in_host, daemon=True).start()
    slot.pid_file.write_text(str(os.getpid()))
    long_ago = time.time() - 1000
    os.utime(slot.pid_file, (long_ago, long_ago))
    try:
        assert start_shard(settings, config, ["worker"], lambda line: None).wait(10) == 0
    finally:
        listener.close()
        slot.socket.unlink(missing_ok=True)
    assert slot.pid_file.stat().st_mtime > long_ago + 900
