"""A fault-injecting HTTP proxy in front of the local S3 server, for e2e fault tests.

It forwards every request to the upstream (versitygw) unchanged, Host header included,
so SigV4 signatures made for the proxy's address still verify there. On request it
answers S3 error storms instead: every request in the window gets a 503 SlowDown or a
500 InternalError (alternating), with the XML body S3 sends, and never reaches the
upstream. It records each answer (method, key, Range, status, body bytes), so a test can
tell how often each object range was served.

    proxy = FaultProxy("http://198.18.0.1:9000").start()
    proxy.storm(seconds=30, after_ranged_gets=4)  # starts once 4 more ranges were served
    ...
    proxy.served_twice()  # ranges answered 2xx more than once
"""

from __future__ import annotations

import http.client
import itertools
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from weightship.httpserver import QuietHandler, Server

STREAM_STEP = 256 * 1024
MAX_UNSIZED_BODY = 16 * 1024 * 1024  # an upstream answer without Content-Length (rare)
MAX_RECORDS = 100_000
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "transfer-encoding",
        "te",
        "trailer",
        "upgrade",
        "proxy-connection",
    }
)
_OWN_HEADERS = frozenset({"content-length", "date", "server"})  # this server writes these
_STORM_ANSWERS = (
    (503, "SlowDown", "Please reduce your request rate."),
    (500, "InternalError", "We encountered an internal error. Please try again."),
)


@dataclass(frozen=True)
class Answer:
    """One request the proxy answered."""

    method: str
    key: str  # the path without its query: /bucket/key
    range: str | None  # the Range header as sent
    status: int
    body_bytes: int
    at: float  # time.monotonic() when answered
    injected: bool  # a storm answered it; the upstream never saw it
    client: str = ""  # the asking IP

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300


@dataclass
class _Storm:
    seconds: float
    after_ranged_gets: int
    started_at: float | None = None


class FaultProxy:
    """A threaded reverse proxy to ``upstream`` (http://host:port) with S3 error storms."""

    def __init__(self, upstream: str, host: str = "127.0.0.1", port: int = 0) -> None:
        url = urlsplit(upstream)
        if url.scheme != "http" or not url.hostname:
            raise ValueError(f"upstream must be http://host:port, got {upstream!r}")
        self.upstream_host = url.hostname
        self.upstream_port = url.port or 80
        self._lock = threading.Lock()
        self._answers: list[Answer] = []
        self._storm: _Storm | None = None
        self._storms_over: list[tuple[float, float]] = []
        self._codes = itertools.cycle(_STORM_ANSWERS)
        self._server = Server((host, port), self._handler_class())

    # ---- lifecycle --------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://{self._server.server_name}:{self._server.server_port}"

    def start(self) -> FaultProxy:
        self._server.start("faultproxy")
        return self

    def stop(self) -> None:
        self._server.stop()

    # ---- faults -----------------------------------------------------------------------
    def storm(self, seconds: float, after_ranged_gets: int = 0) -> None:
        """Answer 503/500 to every request for ``seconds``, starting now, or once
        ``after_ranged_gets`` more ranged GETs were answered 2xx."""
        with self._lock:
            self._storm = _Storm(seconds, after_ranged_gets)
            if after_ranged_gets <= 0:
                self._storm.started_at = time.monotonic()

    def storm_window(self) -> tuple[float, float] | None:
        """(start, end) in time.monotonic() of the last storm that began; None if none."""
        with self._lock:
            storm = self._storm
            if storm is not None and storm.started_at is not None:
                return storm.started_at, storm.started_at + storm.seconds
            return self._storms_over[-1] if self._storms_over else None

    def storming(self) -> bool:
        with self._lock:
            return self._storming_locked(time.monotonic())

    def _storming_locked(self, now: float) -> bool:
        storm = self._storm
        if storm is None or storm.started_at is None:
            return False
        if now < storm.started_at + storm.seconds:
            return True
        self._storms_over.append((storm.started_at, storm.started_at + storm.seconds))
        self._storm = None
        return False

    # ---- what was served --------------------------------------------------------------
    def answers(self) -> list[Answer]:
        with self._lock:
            return list(self._answers)

    def ranged_gets(self, *, ok: bool | None = None, prefix: str = "") -> list[Answer]:
        return [
            a
            for a in self.answers()
            if a.method == "GET"
            and a.range is not None
            and a.key.startswith(prefix)
            and (ok is None or a.ok == ok)
        ]

    def served_twice(self, prefix: str = "") -> dict[tuple[str, str], int]:
        """(key, Range) pairs answered 2xx more than once, with their counts."""
        counts = Counter((a.key, a.range or "") for a in self.ranged_gets(ok=True, prefix=prefix))
        return {k: n for k, n in counts.items() if n > 1}

    def _record(self, answer: Answer) -> None:
        with self._lock:
            if len(self._answers) < MAX_RECORDS:
                self._answers.append(answer)
            storm = self._storm
            if (
                storm is not None
                and storm.started_at is None
                and answer.ok
                and answer.method == "GET"
                and answer.range is not None
            ):
                storm.after_ranged_gets -= 1
                if storm.after_ranged_gets <= 0:
                    storm.started_at = time.monotonic()

    def _storm_answer(self) -> tuple[int, bytes] | None:
        with self._lock:
            if not self._storming_locked(time.monotonic()):
                return None
            status, code, message = next(self._codes)
        body = (
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            f"<Error><Code>{code}</Code><Message>{message}</Message></Error>"
        ).encode()
        return status, body

    # ---- the handler ------------------------------------------------------------------
    def _handler_class(self) -> type[QuietHandler]:
        proxy = self

        class Forward(QuietHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                self._forward()

            def do_HEAD(self) -> None:
                self._forward()

            def do_PUT(self) -> None:
                self._forward()

            def do_POST(self) -> None:
                self._forward()

            def do_DELETE(self) -> None:
                self._forward()

            def _forward(self) -> None:
                key = self.path.split("?", 1)[0]
                rng = self.headers.get("Range")
                client = str(self.client_address[0])
                body = self.read_body(max_bytes=64 * 1024 * 1024)
                if body is None:
                    return

                def record(status: int, sent: int, injected: bool) -> None:
                    # Before the answer's last byte goes out: once a client has its
                    # answer, the proxy's count already includes it.
                    answer = Answer(
                        self.command, key, rng, status, sent, time.monotonic(), injected, client
                    )
                    proxy._record(answer)

                injected = proxy._storm_answer()
                if injected is not None:
                    status, error = injected
                    record(status, 0, True)
                    self.send_bytes(status, error, "application/xml")
                    return
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
                upstream = http.client.HTTPConnection(
                    proxy.upstream_host, proxy.upstream_port, timeout=30
                )
                try:
                    upstream.request(self.command, self.path, body or None, headers)
                    resp = upstream.getresponse()
                    self._relay(resp, lambda sent: record(resp.status, sent, False))
                finally:
                    upstream.close()

            def _relay(self, resp: http.client.HTTPResponse, record: Callable[[int], None]) -> None:
                """Send ``resp`` on; ``record(bytes)`` is called before its last write."""
                length = resp.getheader("Content-Length")
                data = b"" if length is not None else resp.read(MAX_UNSIZED_BODY)
                size = int(length) if length is not None else len(data)
                if self.command == "HEAD" or size == 0 or length is None:
                    record(0 if self.command == "HEAD" else len(data))
                self.send_response(resp.status, resp.reason)
                for k, v in resp.getheaders():
                    if k.lower() not in _HOP_BY_HOP | _OWN_HEADERS:
                        self.send_header(k, v)
                self.send_header("Content-Length", str(size))
                self.end_headers()
                if self.command == "HEAD" or size == 0:
                    return
                if length is None:
                    self.wfile.write(data)
                    return
                sent = 0
                while sent < size:
                    piece = resp.read(min(STREAM_STEP, size - sent))
                    if not piece:
                        break
                    if sent + len(piece) >= size:
                        record(sent + len(piece))
                    self.wfile.write(piece)
                    sent += len(piece)
                if sent < size:
                    record(sent)
                    self.close_connection = True  # the client sees a short body

        return Forward
