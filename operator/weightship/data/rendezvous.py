"""Highest-random-weight (rendezvous) hashing.

Every node ranks the same peers the same way for a chunk without talking to anyone, and
removing a peer only moves the chunks that peer ranked first for.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable


def weight(peer: str, key: str) -> int:
    digest = hashlib.sha256(f"{peer}\0{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


def rank(peers: Iterable[str], key: str) -> list[str]:
    """Peers, highest weight for ``key`` first; ties (never in practice) broken by name."""
    return sorted(set(peers), key=lambda p: (-weight(p, key), p))
