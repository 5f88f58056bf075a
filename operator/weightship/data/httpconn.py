"""Keep-alive HTTP/1.1 connections, one per host per thread, for the data plane's GETs.

Shared by the peer client and the S3 ranged reader. Both read chunk bodies with
``readinto`` straight into the chunk's final buffer: plain ``http.client`` reads from the
socket into the caller's memory, with no intermediate bytes object per read.
"""

from __future__ import annotations

import http.client
import ssl
import threading
from collections import OrderedDict
from collections.abc import Callable

# A reused connection the server closed meanwhile (idle timeout) fails with one of these
# on the first request; it is retried once on a fresh connection.
_STALE = (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError)


class ThreadConnections:
    """One keep-alive connection per (scheme, host:port) per thread, ``per_thread`` at
    most: past that, opening one closes the one used least recently (a node asks a few
    peers of its trees over and over, and many others once: a fleet's worth of idle
    sockets, and the peer-server threads holding their other ends, would grow with it)."""

    per_thread = 8

    def __init__(self, timeout_s: float, ssl_context: ssl.SSLContext | None = None) -> None:
        self.timeout_s = timeout_s
        self._ssl = ssl_context
        self._local = threading.local()

    @property
    def conns(self) -> OrderedDict[tuple[str, str], http.client.HTTPConnection]:
        """This thread's connections, the one used last at the end."""
        found: OrderedDict[tuple[str, str], http.client.HTTPConnection]
        found = self._local.__dict__.setdefault("conns", OrderedDict())
        return found

    def request(
        self,
        method: str,
        host: str,
        target: str,
        headers: dict[str, str],
        *,
        scheme: str = "http",
        timeout_s: float | None = None,
    ) -> http.client.HTTPResponse:
        """Send a request on this thread's connection to ``host`` and return the response
        (headers read, body not). Raises OSError or http.client.HTTPException, after
        dropping the connection, when the request cannot be sent or answered."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        for attempt in range(2):
            conn, reused = self._connection(scheme, host)
            conn.timeout = timeout
            if conn.sock is not None:
                conn.sock.settimeout(timeout)
            try:
                conn.request(method, target, headers=headers)
                return conn.getresponse()
            except _STALE:
                self.drop(scheme, host)
                if not (reused and attempt == 0):
                    raise
            except (OSError, http.client.HTTPException):
                self.drop(scheme, host)
                raise
        raise AssertionError("unreachable")

    def done(self, scheme: str, host: str, resp: http.client.HTTPResponse) -> None:
        """The body of ``resp`` was read to its end: keep the connection unless the server
        said it closes it."""
        if resp.will_close:
            self.drop(scheme, host)

    def drop(self, scheme: str, host: str) -> None:
        """Close this thread's connection to ``host`` (a half-read body must never be
        followed by another request on it)."""
        conn = self.conns.pop((scheme, host), None)
        if conn is not None:
            conn.close()

    def close(self) -> None:
        """Close this thread's connections."""
        for conn in self.conns.values():
            conn.close()
        self.conns.clear()

    def _connection(self, scheme: str, host: str) -> tuple[http.client.HTTPConnection, bool]:
        conns = self.conns
        conn = conns.get((scheme, host))
        if conn is not None:
            conns.move_to_end((scheme, host))
            return conn, True
        while len(conns) >= self.per_thread:
            conns.popitem(last=False)[1].close()
        if scheme == "https":
            context = self._ssl or ssl.create_default_context()
            conn = http.client.HTTPSConnection(host, timeout=self.timeout_s, context=context)
        else:
            conn = http.client.HTTPConnection(host, timeout=self.timeout_s)
        self.conns[(scheme, host)] = conn
        return conn, False


def read_some(resp: http.client.HTTPResponse, view: memoryview) -> int:
    """Read into ``view`` what the body has ready, waiting only for the first byte (one
    socket read at most), where ``readinto`` waits until ``view`` is full: a reader that
    acts on progress (a split of a slow transfer) sees a slow body as it comes, not once
    per ``len(view)`` bytes. 0 at the body's end. A chunked body reads as ``readinto``."""
    if resp.chunked or resp.length is None or resp.fp is None:
        return resp.readinto(view)
    if len(view) > resp.length:
        view = view[: resp.length]
    n = resp.fp.readinto1(view)
    resp.length -= n
    if not resp.length or (not n and view):  # the body's end, or the peer closed early
        resp.close()  # as readinto does: the connection stays for the next request
    return n


def read_into(
    resp: http.client.HTTPResponse,
    view: memoryview,
    landed: Callable[[int], None] | None = None,
    step: int = 1 << 20,
) -> int:
    """Read the body into ``view``; return the bytes read (fewer than ``len(view)`` when
    the body ended early). Without ``landed``, one ``readinto`` per call: the buffered
    socket reader loops over ``recv`` into ``view`` itself, releasing the GIL for each.
    With it, reads of up to ``step`` bytes, each followed by ``landed(bytes in so far)``."""
    got = 0
    while got < len(view):
        n = resp.readinto(view[got:] if landed is None else view[got : got + step])
        if not n:
            break
        got += n
        if landed is not None:
            landed(got)
    return got
