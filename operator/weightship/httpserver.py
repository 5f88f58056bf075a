"""The one HTTP server class every weightship process uses (peers, inference servers,
seeding roots, test stand-ins): stdlib, threaded, without the DNS lookup that blocks,
and bounded in threads, time and bytes.

``http.server.HTTPServer.server_bind`` calls ``socket.getfqdn``, which blocks for about
20 s where DNS is unreachable (a pod's network namespace); the name is never used.

Bounds, so that no client holds more than its share: at most ``max_connections``
connections have a handler thread at once (one more is answered 503 and closed, from the
accepting thread, without reading it); a ``BoundedHandler`` request (its line, headers,
body and answer) must be done within ``request_deadline_s`` or its connection is shut
(a client trickling one byte per idle timeout would otherwise hold a thread for ever);
and ``read_body`` refuses a missing, malformed, negative or oversized Content-Length
before reading a byte.

``start`` serves on a daemon thread and ``stop`` ends it (``with Server(...).start(name)
as server:`` does both), so no caller hand-rolls the thread and the shutdown order.
"""

from __future__ import annotations

import contextlib
import json
import socket
import socketserver
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self

MAX_CONNECTIONS = 256
REQUEST_DEADLINE_S = 60.0
MAX_BODY_BYTES = 1024 * 1024
_BUSY = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


class Server(ThreadingHTTPServer):
    daemon_threads = True
    # The listen backlog (socketserver's default is 5): a peer opening its workers'
    # connections at once (a ring's 14 to one node at stage start) overflowed 5, and a
    # dropped SYN is sent again only after a second: that node started a second late
    # (the fleet benchmark's traces). The kernel caps it at net.core.somaxconn.
    request_queue_size = 1024

    def __init__(
        self,
        server_address: tuple[str, int],
        handler: type[BaseHTTPRequestHandler],
        *,
        max_connections: int = MAX_CONNECTIONS,
        request_deadline_s: float | None = REQUEST_DEADLINE_S,
    ) -> None:
        self.max_connections = max_connections
        self.request_deadline_s = request_deadline_s
        self._slots = threading.BoundedSemaphore(max_connections)
        self._deadlines: dict[socket.socket, float] = {}
        self._deadlines_lock = threading.Lock()
        self._watchdog: threading.Thread | None = None
        self._closing = threading.Event()
        self._serving: threading.Thread | None = None
        super().__init__(server_address, handler)

    def start(self, name: str = "http", *, poll_interval_s: float = 0.5) -> Self:
        """Serve on a daemon thread named ``name`` until ``stop()``. ``poll_interval_s``:
        how long ``stop()`` may wait for the serving loop to notice."""
        if self._serving is not None:
            raise RuntimeError(f"{name}: already serving")
        self._serving = threading.Thread(
            target=self.serve_forever,
            kwargs={"poll_interval": poll_interval_s},
            name=name,
            daemon=True,
        )
        self._serving.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """End the serving loop (if started), close the listening socket, and wait up to
        ``timeout_s`` for the serving thread. Handler threads still running finish on
        their own (they are daemons, bounded by the request deadline)."""
        thread, self._serving = self._serving, None
        if thread is not None:
            self.shutdown()  # returns once the loop is out: it would hang if never started
        self.server_close()
        if thread is not None:
            thread.join(timeout_s)

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def server_bind(self) -> None:
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name, self.server_port = str(host), int(port)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            _refuse(request)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def server_close(self) -> None:
        self._closing.set()
        super().server_close()

    def arm(self, conn: socket.socket) -> None:
        """``conn``'s request must be done within the deadline from now."""
        if self.request_deadline_s is None:
            return
        with self._deadlines_lock:
            self._deadlines[conn] = time.monotonic() + self.request_deadline_s
            if self._watchdog is None:
                self._watchdog = threading.Thread(
                    target=self._enforce_deadlines, name="http-deadlines", daemon=True
                )
                self._watchdog.start()

    def disarm(self, conn: socket.socket) -> None:
        with self._deadlines_lock:
            self._deadlines.pop(conn, None)

    def _enforce_deadlines(self) -> None:
        """One thread for the whole server: shuts the connections past their deadline,
        which wakes their handler threads out of any read or write."""
        tick = min(0.5, (self.request_deadline_s or 1.0) / 4)
        while not self._closing.wait(tick):
            now = time.monotonic()
            with self._deadlines_lock:
                late = [c for c, t in self._deadlines.items() if t <= now]
                for conn in late:
                    del self._deadlines[conn]
            for conn in late:
                with contextlib.suppress(OSError):  # already closed by its handler
                    conn.shutdown(socket.SHUT_RDWR)


def _refuse(request: socket.socket) -> None:
    with contextlib.suppress(OSError):  # best effort: it is closed either way
        request.setblocking(False)
        request.send(_BUSY)


class BodyError(Exception):
    """A request body that is refused before it is read."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def body_length(header: str | None, max_bytes: int) -> int:
    """The body's length from its Content-Length header (0 when absent). BodyError with
    400 for a malformed or negative value, 413 for one over ``max_bytes``."""
    if header is None or header.strip() == "":
        return 0
    text = header.strip()
    if not text.isdigit() or not text.isascii() or len(text) > 19:
        raise BodyError(400, f"Content-Length must be a non-negative integer, got {text[:32]!r}")
    length = int(text)
    if length > max_bytes:
        raise BodyError(413, f"the body is {length} bytes, over the {max_bytes} taken here")
    return length


class BoundedHandler(BaseHTTPRequestHandler):
    """A handler whose every request runs under its server's deadline (when it is a
    ``Server``) and whose body is read through ``read_body``."""

    timeout = 30  # seconds an idle or stalled client may hold a handler thread

    def handle_one_request(self) -> None:
        server = self.server
        if not isinstance(server, Server):
            super().handle_one_request()
            return
        server.arm(self.connection)
        try:
            super().handle_one_request()
        finally:
            server.disarm(self.connection)

    def read_body(self, max_bytes: int = MAX_BODY_BYTES) -> bytes | None:
        """The request body, at most ``max_bytes``; None when refused (then a 400 or 413
        has been answered and the connection will close)."""
        try:
            length = body_length(self.headers.get("Content-Length"), max_bytes)
        except BodyError as exc:
            self.close_connection = True  # the unread body must not be taken for a request
            self.send_error(exc.status, str(exc))
            return None
        data = self.rfile.read(length) if length else b""
        if len(data) != length:
            self.close_connection = True
            return None  # the client went away mid-body: there is no one to answer
        return data


class QuietHandler(BoundedHandler):
    """No access log on stderr; small helpers to answer bytes or JSON."""

    def log_message(self, format: str, *args: Any) -> None:
        return

    def send_bytes(self, code: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def send_json(self, code: int, doc: Any) -> None:
        self.send_bytes(code, json.dumps(doc).encode())
