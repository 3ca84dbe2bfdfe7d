"""Decode's PrefillDirectory against a bootstrap server that dies mid-answer.

A prefill killed while decode's heartbeat reads its /health leaves a response cut short (the
headers promise a body that never comes). That once killed the directory thread, after which
decode never found a prefill rank again and every new room waited out prefill's bootstrap
timeout (seen in tests/test_router_pd.py's kill test). Here a real socket server answers with
cut responses, then with good ones: the thread must count the cuts as misses, report the rank
dead, and go on finding ranks.
"""

from __future__ import annotations

import json
import queue
import socket
import threading
import time

import pytest

from workers.prefill_directory import PrefillDirectory
from workers.timeouts import Timeouts

ROUTE = {"rank_ip": "127.0.0.1", "rank_port": 4242, "tp_size": 1}


class Bootstrap(threading.Thread):
    """Answers every request on a loopback port: cut short while `cut` is set, else whole."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.addr = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.cut = threading.Event()
        self.slow_once = threading.Event()  # the next answer comes after the client's timeout

    def run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                request = conn.recv(65536)
                if self.slow_once.is_set():
                    self.slow_once.clear()
                    time.sleep(2.5)
                if self.cut.is_set():
                    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n")
                    continue
                body = json.dumps(ROUTE if b"/route" in request else {}).encode()
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-type: application/json\r\n"
                    b"content-length: %d\r\n\r\n%s" % (len(body), body)
                )


@pytest.fixture
def bootstrap():
    server = Bootstrap()
    server.start()
    yield server
    server.sock.close()


def next_event(directory: PrefillDirectory) -> tuple[str, str, object]:
    try:
        return directory.events.get(timeout=20)
    except queue.Empty:
        pytest.fail(f"no event from the directory (thread alive: {directory.is_alive()})")


def started_directory(heartbeat_interval: float) -> PrefillDirectory:
    timeouts = Timeouts(
        bootstrap=1,
        waiting=1,
        heartbeat_interval=heartbeat_interval,
        heartbeat_max_failures=2,
        abort_ack=1,
    )
    directory = PrefillDirectory(timeouts, api_key=None)
    directory.start()
    return directory


def test_cut_answers_are_misses_and_the_directory_lives_on(bootstrap) -> None:
    directory = started_directory(heartbeat_interval=0.05)
    bootstrap.cut.set()
    directory.watched.add(bootstrap.addr)
    assert next_event(directory) == ("dead", bootstrap.addr, None)
    directory.lookups.put(bootstrap.addr)
    kind, addr, why = next_event(directory)
    assert (kind, addr) == ("unreachable", bootstrap.addr), why
    assert directory.is_alive()

    bootstrap.cut.clear()
    directory.lookups.put(bootstrap.addr)
    kind, addr, found = next_event(directory)
    assert (kind, addr) == ("found", bootstrap.addr), found
    assert found["rank"] == "127.0.0.1:4242"


def test_a_lookup_that_times_out_is_tried_again(bootstrap) -> None:
    """A bootstrap server slower than the client's timeout once (a prefill busy with a burst)
    is not reported unreachable: that verdict would fail every room waiting on it."""
    directory = started_directory(heartbeat_interval=60)
    bootstrap.slow_once.set()
    directory.lookups.put(bootstrap.addr)
    kind, addr, found = next_event(directory)
    assert (kind, addr) == ("found", bootstrap.addr), found
    assert not bootstrap.slow_once.is_set()  # the slow answer really came first
