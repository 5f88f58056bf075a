"""A local stand-in for Slack's incoming webhook: it checks each payload's shape the way
Slack would (text and/or blocks of known types) and records what it accepted."""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler
from typing import Any

from weightship.httpserver import Server

BLOCK_TYPES = {"header", "section", "context", "divider", "actions", "image", "rich_text"}


def payload_problem(payload: Any) -> str | None:
    """None when Slack would accept the payload, else Slack's error word."""
    if not isinstance(payload, dict):
        return "invalid_payload"
    if not payload.get("text") and not payload.get("blocks"):
        return "no_text"
    for block in payload.get("blocks") or []:
        if not isinstance(block, dict) or block.get("type") not in BLOCK_TYPES:
            return "invalid_blocks"
        text = block.get("text")
        if text is not None and (not isinstance(text, dict) or "text" not in text):
            return "invalid_blocks"
    return None


class SlackReceiver:
    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.received: list[dict[str, Any]] = []
        self.paths: list[str] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: object) -> None:
                return

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                try:
                    payload = json.loads(self.rfile.read(length))
                except ValueError:
                    payload = None
                problem = payload_problem(payload)
                body = (problem or "ok").encode()
                self.send_response(400 if problem else 200)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                if problem is None:
                    receiver.received.append(payload)
                    receiver.paths.append(self.path)

        self.server = Server((host, port), Handler)

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host!s}:{port}/services/T000/B000/secret-token"

    def __enter__(self) -> SlackReceiver:
        self.server.start("slack-receiver")
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop()
