"""Server.start and Server.stop: one way to serve on a thread and to end it."""

from __future__ import annotations

import socket
import threading
import time
import urllib.request

import pytest

from weightship.httpserver import QuietHandler, Server


class Hello(QuietHandler):
    def do_GET(self) -> None:
        self.send_json(200, {"hello": "there"})


def serving_threads(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == name]


def test_started_it_answers_and_stopped_its_port_and_thread_are_gone() -> None:
    with Server(("127.0.0.1", 0), Hello).start("hello-server") as server:
        port = server.server_port
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5) as resp:
            assert resp.status == 200
        assert len(serving_threads("hello-server")) == 1
    assert serving_threads("hello-server") == []
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_stopping_a_server_that_never_served_returns_at_once_and_frees_its_port() -> None:
    server = Server(("127.0.0.1", 0), Hello)
    port = server.server_port
    started = time.monotonic()
    server.stop()  # BaseServer.shutdown() alone would wait for a loop that never ran
    assert time.monotonic() - started < 1
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_a_server_serves_once() -> None:
    with Server(("127.0.0.1", 0), Hello).start("hello-twice") as server:
        with pytest.raises(RuntimeError, match="already serving"):
            server.start("hello-twice")
        assert len(serving_threads("hello-twice")) == 1
