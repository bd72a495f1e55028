"""How a client reaches a warm engine's socket (``llm_batch.runtime.warm_engines._try_connect``),
without an engine: a live host greets; a killed host whose listening socket a forked child
still holds (as vLLM's engine processes do) takes the connection, then resets it, and is
not mistaken for a live one. (A CI run once handed a retry to such a host: exit -9.)"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import orjson
import pytest

from llm_batch.runtime.warm_engines import Slot, _try_connect


@pytest.fixture
def slot(tmp_path) -> Slot:
    return Slot(tmp_path, "k" * 16, 0)


def _listen(slot: Slot) -> socket.socket:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(slot.socket))
    listener.listen(4)
    return listener


def test_a_live_host_is_reached_with_the_pid_of_its_greeting(slot):
    listener = _listen(slot)

    def host():
        conn, _ = listener.accept()
        with conn:
            conn.sendall(orjson.dumps({"host": 4242}) + b"\n")
            conn.recv(1)  # until the client closes

    threading.Thread(target=host, daemon=True).start()
    reached = _try_connect(slot)
    assert reached is not None and reached[1] == 4242
    reached[0].close()
    listener.close()


def test_no_socket_and_a_socket_nobody_listens_on_are_not_hosts(slot):
    assert _try_connect(slot) is None
    _listen(slot).close()  # the file stays: a killed host's leftover
    assert slot.socket.exists() and _try_connect(slot) is None


def test_a_killed_host_whose_child_holds_its_socket_is_not_a_host(slot):
    listener = _listen(slot)
    child = os.fork()
    if child == 0:  # the engine process: holds the listener, never accepts, dies later
        time.sleep(1.5)
        os._exit(0)
    listener.close()  # the host itself is gone
    try:
        started = time.monotonic()
        assert _try_connect(slot) is None
        assert time.monotonic() - started < 10
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)


def test_a_host_that_closes_without_greeting_is_not_a_host(slot):
    listener = _listen(slot)

    def host():
        conn, _ = listener.accept()
        conn.sendall(b"not json\n")
        conn.close()

    threading.Thread(target=host, daemon=True).start()
    assert _try_connect(slot) is None
    listener.close()
