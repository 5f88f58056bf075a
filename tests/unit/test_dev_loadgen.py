"""The e2e load generator's connections (weightship_dev.loadgen): a request must never go
out on a keep-alive connection the server is closing. A real HTTP/1.1 server plays the
race that lost a chat request in CI (vLLM's uvicorn closes a connection idle for 5 s): it
closes, unanswered, a connection whose next request comes after it has been idle too long."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from typing import ClassVar

import pytest
import urllib3

from weightship.httpserver import Server
from weightship_dev.loadgen import IdleBoundedPool

SERVER_KEEP_ALIVE_S = 0.4


class RacingKeepAlive(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    connections: ClassVar[set[tuple[str, int]]] = set()

    def setup(self) -> None:
        super().setup()
        self.idle_since = time.monotonic()
        RacingKeepAlive.connections.add(self.client_address)

    def do_POST(self) -> None:
        if time.monotonic() - self.idle_since >= SERVER_KEEP_ALIVE_S:
            self.close_connection = True  # the keep-alive timer fired as the request came
            return
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")
        self.idle_since = time.monotonic()

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[Server]:
    RacingKeepAlive.connections = set()
    with Server(("127.0.0.1", 0), RacingKeepAlive).start("racing-keep-alive") as httpd:
        yield httpd


def post(pool: IdleBoundedPool) -> int:
    return pool.request("POST", "/v1/chat/completions", body=b"{}", timeout=5.0).status


def test_a_connection_idle_past_the_limit_is_replaced_not_raced(
    server: Server,
) -> None:
    pool = IdleBoundedPool(
        "127.0.0.1", server.server_port, idle_limit_s=SERVER_KEEP_ALIVE_S / 2, maxsize=1
    )
    assert post(pool) == 200
    assert post(pool) == 200  # at once: the same connection
    assert len(RacingKeepAlive.connections) == 1
    time.sleep(SERVER_KEEP_ALIVE_S + 0.1)
    assert post(pool) == 200  # idle past the limit: a new connection, answered
    assert len(RacingKeepAlive.connections) == 2


def test_without_the_limit_the_race_loses_the_request(server: Server) -> None:
    """The control: the server above does lose a request sent on a connection idle too long."""
    pool = IdleBoundedPool("127.0.0.1", server.server_port, idle_limit_s=math.inf, maxsize=1)
    assert post(pool) == 200
    time.sleep(SERVER_KEEP_ALIVE_S + 0.1)
    with pytest.raises(urllib3.exceptions.ProtocolError, match="RemoteDisconnected"):
        post(pool)
