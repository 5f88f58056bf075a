"""HTTP glue for the inference server: two handlers, no HTTP framework assumed.

if path == JOIN_PATH:   status, doc = handle_join(root, body)
if path == STATUS_PATH: status, doc = handle_status(root)
respond(status, json.dumps(doc))
"""

from __future__ import annotations

import json
from typing import Any

from weightship.api.inference import FailureReason
from weightship.httpserver import QuietHandler, Server
from weightship.seeding.protocol import JOIN_PATH, STATUS_PATH
from weightship.seeding.root import SeedRoot, refusal

MAX_JOIN_BYTES = 64 * 1024  # a join is a few short fields


def handle_join(root: SeedRoot | None, body: bytes) -> tuple[int, dict[str, Any]]:
    """POST JOIN_PATH. 200 with the group's coordinates; 409 means "load from your node
    cache" (this server is no root, or the root refused); 400 for a malformed body; 401
    without a token and 403 with one that does not open the group (core.seedtoken)."""
    if root is None:
        return _answered(refusal("NotARoot", "this replica does not seed"))
    try:
        doc = json.loads(body)
        group, world_size, member = doc["group"], int(doc["worldSize"]), str(doc["member"])
        digest, backend = doc.get("digest"), str(doc.get("backend", "auto"))
        token = doc.get("token")
    except (ValueError, KeyError, TypeError) as exc:
        return _answered(refusal(FailureReason.BAD_REQUEST, f"join body: {exc}"[:200], 400))
    if not all(isinstance(v, str | None) for v in (group, digest, token)) or group is None:
        return _answered(
            refusal(FailureReason.BAD_REQUEST, "group, digest and token must be strings", 400)
        )
    return _answered(
        root.join(group, world_size, member, digest=digest, backend=backend, token=token)
    )


def _answered(answer: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """The HTTP status a refusal carries (``refusal(status=...)``), 200 for an admission."""
    status = int(answer.pop("status", 200 if answer["accepted"] else 409))
    return status, answer


def handle_status(root: SeedRoot | None) -> tuple[int, dict[str, Any]]:
    """GET STATUS_PATH: the broadcasts this replica ran as a root, and those running."""
    if root is None:
        return 200, {"root": None, "active": [], "history": []}
    return 200, root.status_json()


def serve(root: SeedRoot | None, host: str, port: int = 0) -> Server:
    """A minimal HTTP server for the two endpoints, serving on a daemon thread, for
    processes that have no server of their own (tests, benchmarks). ``server_address``
    has the port; ``stop()`` ends it."""

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

    return Server((host, port), Handler).start("seed-http")
