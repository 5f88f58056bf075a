"""The one HTTP server class every weightship process uses (peers, inference servers,
seeding roots, test stand-ins): stdlib, threaded, and without the DNS lookup that blocks.

``http.server.HTTPServer.server_bind`` calls ``socket.getfqdn``, which blocks for about
20 s where DNS is unreachable (a pod's network namespace); the name is never used.
"""

from __future__ import annotations

import json
import socketserver
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class Server(ThreadingHTTPServer):
    daemon_threads = True

    def server_bind(self) -> None:
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name, self.server_port = str(host), int(port)


class QuietHandler(BaseHTTPRequestHandler):
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
