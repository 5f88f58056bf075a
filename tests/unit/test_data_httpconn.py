"""The data plane's keep-alive connections (weightship.data.httpconn): ``read_some`` hands
back a slow body's bytes as they come, and leaves the connection ready for the next
request, as ``readinto`` does. A real HTTP/1.1 server sends each body in two halves with
a pause between them."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import ExitStack
from http.server import BaseHTTPRequestHandler
from typing import ClassVar

import pytest

from weightship.data.httpconn import ThreadConnections, read_some
from weightship.httpserver import Server

BODY = bytes(range(256)) * 64  # 16 KiB
PAUSE_S = 0.5


class TwoHalves(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    connections: ClassVar[set[tuple[str, int]]] = set()

    def do_GET(self) -> None:
        TwoHalves.connections.add(self.client_address)
        self.send_response(200)
        self.send_header("Content-Length", str(len(BODY)))
        self.end_headers()
        self.wfile.write(BODY[: len(BODY) // 2])
        self.wfile.flush()
        time.sleep(PAUSE_S)
        self.wfile.write(BODY[len(BODY) // 2 :])

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def host() -> Iterator[str]:
    TwoHalves.connections = set()
    with Server(("127.0.0.1", 0), TwoHalves).start("two-halves") as httpd:
        yield f"127.0.0.1:{httpd.server_port}"


def test_read_some_returns_what_came_and_keeps_the_connection(host: str) -> None:
    conns = ThreadConnections(timeout_s=5)
    for _ in range(2):  # the second request rides the same connection
        resp = conns.request("GET", host, "/", {})
        view = memoryview(bytearray(len(BODY)))
        first = read_some(resp, view)
        assert 0 < first <= len(BODY) // 2  # the first half: the rest was not waited for
        got = first
        while n := read_some(resp, view[got:]):
            got += n
        assert got == len(BODY) and bytes(view) == BODY
        assert resp.isclosed()  # the body is read: the connection is free
        conns.done("http", host, resp)
    assert len(TwoHalves.connections) == 1
    conns.close()


class Small(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, format: str, *args: object) -> None:
        pass


def test_a_thread_keeps_a_bounded_number_of_connections_the_least_used_go_first() -> None:
    """Ten servers asked in turn, then the first again: a thread holds 8 connections at
    most; the ones used least recently were closed (their sockets gone), the one used
    again was kept."""
    with ExitStack() as stack:
        servers = [
            stack.enter_context(Server(("127.0.0.1", 0), Small).start("s")) for _ in range(10)
        ]
        hosts = [f"127.0.0.1:{s.server_port}" for s in servers]
        conns = ThreadConnections(timeout_s=5)
        kept = []
        for i, host in enumerate(hosts):
            if i == 8:  # the first is used again before the ninth opens
                resp = conns.request("GET", hosts[0], "/", {})
                assert resp.read() == b"ok"
                conns.done("http", hosts[0], resp)
            resp = conns.request("GET", host, "/", {})
            assert resp.read() == b"ok"
            conns.done("http", host, resp)
            kept.append(conns.conns.get(("http", hosts[1])))
        assert len(conns.conns) == ThreadConnections.per_thread
        assert [h for _, h in conns.conns] == [*hosts[3:8], hosts[0], hosts[8], hosts[9]]
        pruned = kept[1]  # the second server's, taken once it was open
        assert pruned is not None and pruned.sock is None  # closed when pruned
        conns.close()
