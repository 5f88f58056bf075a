"""The adapter's port: the weightship routes, and SGLang's serving routes forwarded.

The pod's serving port (``spec.validation.endpoint.port``) is the adapter's; SGLang
listens on loopback only. The adapter answers ``/weightship/v1/loaded``,
``/weightship/v1/swap`` and ``/weightship/v1/swap/verified`` itself and forwards only the
routes in ``FORWARDED`` (inference, health, metrics) to SGLang, each response stamped with
the weights that made it
(``gate``). Everything else, SGLang's admin routes above all (``/update_weights_from_disk``,
``/pause_generation``, ``/flush_cache``, ``/weights_checker``, ...), is answered 404
and never reaches SGLang. The server is bounded like every weightship server
(``weightship.httpserver``): threads, bytes and time.
"""

from __future__ import annotations

import contextlib
import http.client
import logging
import socket
import urllib.parse
from typing import Any

from weightship.api.inference import (
    AUTHORIZATION_HEADER,
    DIGEST_HEADER,
    LOADED_PATH,
    MAX_SWAP_BODY,
    REVISION_HEADER,
    SWAP_PATH,
    VERIFIED_PATH,
    VERIFY_HEADER,
    FailureReason,
)
from weightship.httpserver import QuietHandler, Server
from weightship.integrations.serving import Refused, Weights

from .adapter import Adapter

log = logging.getLogger("weightship.sglang")

# Forwarded to SGLang and admitted through the gate (they run the model).
GATED = frozenset(
    {
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/embeddings"),
        ("POST", "/generate"),
    }
)
# Forwarded at once, even during a swap (probes, metrics, the model list): no model runs.
UNGATED = frozenset(
    {
        ("GET", "/health"),
        ("GET", "/health_generate"),
        ("GET", "/ready"),
        ("GET", "/ping"),
        ("GET", "/metrics"),
        ("GET", "/v1/models"),
    }
)
FORWARDED = GATED | UNGATED
MAX_REQUEST_BODY = 16 * 1024 * 1024
# A held request waits up to the swap's bound, then generates: longer than the default.
REQUEST_DEADLINE_S = 900.0
UPSTREAM_TIMEOUT_S = 600.0
PIECE = 64 * 1024
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)


def make_handler(adapter: Adapter, upstream: tuple[str, int]) -> type[QuietHandler]:
    class Handler(QuietHandler):
        # HTTP/1.1 so that a streamed answer is chunked: one cut by a seal then ends
        # without its last chunk, which a client can tell from a complete answer.
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            self._route("GET")

        def do_POST(self) -> None:
            self._route("POST")

        def do_PUT(self) -> None:
            self._route("PUT")

        def do_DELETE(self) -> None:
            self._route("DELETE")

        def _route(self, method: str) -> None:
            path = urllib.parse.urlsplit(self.path).path
            if path == LOADED_PATH and method == "GET":
                self._answer(200, adapter.loaded_document())
            elif path == SWAP_PATH and method == "GET":
                self._answer(200, adapter.swap_document())
            elif path == SWAP_PATH and method == "POST":
                body = self.read_body(MAX_SWAP_BODY)
                if body is None:
                    return  # refused (400/413) by read_body
                status, answer = adapter.post_swap(self.headers.get(AUTHORIZATION_HEADER), body)
                self._answer(status, answer.to_json())
            elif path == VERIFIED_PATH and method == "POST":
                body = self.read_body(MAX_SWAP_BODY)
                if body is None:
                    return
                status, answer = adapter.post_verified(self.headers.get(AUTHORIZATION_HEADER), body)
                self._answer(status, answer.to_json())
            elif (method, path) in FORWARDED:
                self._forward(method, gated=(method, path) in GATED)
            else:
                self._answer(
                    404, {"reason": "NotExposed", "message": f"{method} {path} is not served here"}
                )

        def _answer(self, status: int, doc: Any, weights: Weights | None = None) -> None:
            self.close_connection = True
            self.send_response(status)
            self._stamp(weights or adapter.gate.weights)
            self.send_header("Connection", "close")
            body = _json(doc)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _stamp(self, weights: Weights) -> None:
            for name, value in weights.headers():
                self.send_header(name.decode(), value.decode())

        def _forward(self, method: str, *, gated: bool) -> None:
            body = self.read_body(MAX_REQUEST_BODY)
            if body is None:
                return
            header = self.headers.get(VERIFY_HEADER)
            verifier = None if header is None else lambda: adapter.is_verifier(header)
            ticket = adapter.gate.admit(verifier) if gated else None
            if isinstance(ticket, Refused):
                self._answer(ticket.status, {"reason": ticket.reason, "message": ticket.message})
                return
            weights = ticket.weights if ticket is not None else adapter.gate.weights
            conn = http.client.HTTPConnection(*upstream, timeout=UPSTREAM_TIMEOUT_S)
            try:
                if ticket is not None:
                    ticket.on_cut(lambda: _shut(conn))
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
                headers["Host"] = f"{upstream[0]}:{upstream[1]}"
                try:
                    conn.request(method, self.path, body=body or None, headers=headers)
                    response = conn.getresponse()
                except (OSError, http.client.HTTPException) as exc:
                    if ticket is not None and ticket.cut:
                        self._answer(503, _cut_doc(), weights)
                    else:
                        self._answer(502, {"reason": "UpstreamUnavailable", "message": str(exc)})
                    return
                self._relay(response, ticket, weights)
            finally:
                conn.close()
                if ticket is not None:
                    adapter.gate.release(ticket)

        def _relay(self, response: http.client.HTTPResponse, ticket: Any, weights: Weights) -> None:
            length = response.getheader("Content-Length")
            if length is not None and length.isdigit() and int(length) <= MAX_REQUEST_BODY:
                try:
                    data = response.read()
                except (OSError, http.client.HTTPException):
                    data = None
                if data is None or (ticket is not None and ticket.cut):
                    self._answer(503, _cut_doc(), weights)
                    return
                self._head(response, weights, len(data))
                self.wfile.write(data)
                return
            # Streamed (server-sent events): pieces as they come, cut off by a seal.
            first = _read_piece(response)
            if ticket is not None and ticket.cut:
                self._answer(503, _cut_doc(), weights)
                return
            self._head(response, weights, None)
            piece = first
            while piece:
                if ticket is not None and ticket.cut:
                    return  # no last chunk: the client sees the answer cut
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                self.wfile.flush()
                piece = _read_piece(response)
            if ticket is not None and ticket.cut:
                return
            self.wfile.write(b"0\r\n\r\n")

        def _head(
            self, response: http.client.HTTPResponse, weights: Weights, length: int | None
        ) -> None:
            self.close_connection = True
            self.send_response(response.status, response.reason)
            for name, value in response.getheaders():
                low = name.lower()
                if low in HOP_BY_HOP or low in (REVISION_HEADER.lower(), DIGEST_HEADER.lower()):
                    continue
                self.send_header(name, value)
            self._stamp(weights)
            if length is not None:
                self.send_header("Content-Length", str(length))
            else:
                self.send_header("Transfer-Encoding", "chunked")
            self.send_header("Connection", "close")
            self.end_headers()

    return Handler


def _read_piece(response: http.client.HTTPResponse) -> bytes:
    try:
        return response.read1(PIECE)
    except (OSError, http.client.HTTPException):
        return b""


def _shut(conn: http.client.HTTPConnection) -> None:
    sock = conn.sock
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


def _cut_doc() -> dict[str, str]:
    return {
        "reason": FailureReason.WEIGHTS_CHANGED,
        "message": "the weights were swapped while this request ran: send it again",
    }


def _json(doc: Any) -> bytes:
    import json

    return json.dumps(doc).encode()


def serve(
    adapter: Adapter,
    host: str,
    port: int,
    upstream: tuple[str, int],
    *,
    request_deadline_s: float = REQUEST_DEADLINE_S,
) -> Server:
    """The adapter's server, bound, not serving yet (``start()`` serves on a thread)."""
    return Server(
        (host, port), make_handler(adapter, upstream), request_deadline_s=request_deadline_s
    )
