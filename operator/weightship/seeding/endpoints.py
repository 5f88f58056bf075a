"""HTTP glue for the inference server: two handlers, no HTTP framework assumed.

if path == JOIN_PATH:   status, doc = handle_join(root, body)
if path == STATUS_PATH: status, doc = handle_status(root)
respond(status, json.dumps(doc))
"""

from __future__ import annotations

import json
import threading
from http.server import ThreadingHTTPServer
from typing import Any

from weightship.httpserver import QuietHandler, Server
from weightship.seeding.protocol import JOIN_PATH, STATUS_PATH
from weightship.seeding.root import SeedRoot, refusal

MAX_JOIN_BYTES = 64 * 1024  # a join is a few short fields


def handle_join(root: SeedRoot | None, body: bytes) -> tuple[int, dict[str, Any]]:
    """POST JOIN_PATH. 200 with the group's coordinates; 409 means "load from your node
    cache" (this server is no root, or the root refused); 400 for a malformed body."""
    if root is None:
        return 409, refusal("NotARoot", "this replica does not seed")
    try:
        doc = json.loads(body)
        group, world_size, member = doc["group"], int(doc["worldSize"]), str(doc["member"])
        digest, backend = doc.get("digest"), str(doc.get("backend", "auto"))
    except (ValueError, KeyError, TypeError) as exc:
        return 400, refusal("BadRequest", f"join body: {exc}")
    if not isinstance(group, str) or (digest is not None and not isinstance(digest, str)):
        return 400, refusal("BadRequest", "group and digest must be strings")
    answer = root.join(group, world_size, member, digest=digest, backend=backend)
    if answer["accepted"]:
        return 200, answer
    return (400 if answer["reason"] == "BadRequest" else 409), answer


def handle_status(root: SeedRoot | None) -> tuple[int, dict[str, Any]]:
    """GET STATUS_PATH: the broadcasts this replica ran as a root, and those running."""
    if root is None:
        return 200, {"root": None, "active": [], "history": []}
    return 200, root.status_json()


def serve(root: SeedRoot | None, host: str, port: int = 0) -> ThreadingHTTPServer:
    """A minimal HTTP server for the two endpoints, serving on a daemon thread, for
    processes that have no server of their own (tests, benchmarks). ``server_address``
    has the port; ``shutdown()`` stops it."""

    class Handler(QuietHandler):
        def do_POST(self) -> None:
            if self.path != JOIN_PATH:
                self.send_json(404, {"error": f"no {self.path}"})
                return
            body = self.read_body(MAX_JOIN_BYTES)  # 400/413 answered for a bad length
            if body is not None:
                self.send_json(*handle_join(root, body))

        def do_GET(self) -> None:
            if self.path != STATUS_PATH:
                self.send_json(404, {"error": f"no {self.path}"})
                return
            self.send_json(*handle_status(root))

    server = Server((host, port), Handler)
    threading.Thread(target=server.serve_forever, name="seed-http", daemon=True).start()
    return server
