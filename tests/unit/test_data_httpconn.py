"""The data plane's keep-alive connections (weightship.data.httpconn): ``read_some`` hands
back a slow body's bytes as they come, and leaves the connection ready for the next
request, as ``readinto`` does. A real HTTP/1.1 server sends each body in two halves with
a pause between them."""

from __future__ import annotations

import time
from collections.abc import Iterator
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
