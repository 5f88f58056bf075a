"""Tail stealing without a coordinator: an owner hands one of its chunks to a peer.

The origin link is shared, and TCP shares it unevenly: one owner's origin stream can
finish a third later than the others', and every node then waits on its last chunks. A
node whose own origin queue is done may ask a slow owner for one of the chunks it is
waiting on. The owner grants the claim only if it has not started fetching that chunk,
so the chunk still leaves the origin once: the claimant fetches it from the origin, and
the owner takes it from the claimant like any peer chunk.

The board lives on the node's ChunkStore: the peer server grants claims on it, and the
stage's fetcher consults it before each of its own origin fetches.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable


class ClaimBoard:
    """This node's chunks that it started fetching from the origin, and the ones it gave
    away to a claimant. Thread-safe; the check and the mark are one atomic step."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._started: set[str] = set()
        self._granted: dict[str, str] = {}  # sha256 -> the node fetching it instead

    def start(self, sha256: str) -> str | None:
        """This node is about to fetch ``sha256`` from the origin. Returns the node it was
        granted to instead (then this node must not fetch it), else marks it started."""
        with self._lock:
            claimant = self._granted.get(sha256)
            if claimant is None:
                self._started.add(sha256)
            return claimant

    def grant(self, sha256: str, node: str) -> str | None:
        """``node`` asks to fetch ``sha256`` from the origin itself. Returns who fetches it:
        ``node`` when granted (again, if it asked before), or the node already granted.
        None when this node started it (the claimant should keep waiting for it here)."""
        with self._lock:
            if sha256 in self._started:
                return None
            return self._granted.setdefault(sha256, node)

    def claimant(self, sha256: str) -> str | None:
        with self._lock:
            return self._granted.get(sha256)

    def forget(self, digests: Iterable[str]) -> None:
        """Drop a finished stage's entries (the peer server refuses claims on chunks this
        node holds, so nothing is granted twice)."""
        with self._lock:
            for sha in digests:
                self._started.discard(sha)
                self._granted.pop(sha, None)
