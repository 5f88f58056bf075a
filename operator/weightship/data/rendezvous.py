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


def balanced_owners(
    keys: Iterable[str], nodes: Iterable[str], *, first: int | None = None
) -> dict[str, str]:
    """An owner for every key, each node owning at most ceil(keys / nodes) of them.

    Rendezvous with bounded loads: walk the unique keys in the given order (the
    manifest's) and give each to its best-ranked node that is still under the cap.
    Deterministic: every node that knows the keys and the node set computes the same map,
    with nobody coordinating. Plain rendezvous gives owners ±40 % of the mean at a few
    dozen chunks per node; this gives each exactly the mean, rounded up.

    ``first``: the owners of the first that many unique keys only (the same as in the
    whole map: the walk is in order), for a caller that needs only those.
    """
    unique = list(dict.fromkeys(keys))
    members = sorted(set(nodes))
    if not members:
        return {}
    cap = -(-len(unique) // len(members))
    load = dict.fromkeys(members, 0)
    owner = {}
    for key in unique if first is None else unique[:first]:
        node = next(n for n in rank(members, key) if load[n] < cap)
        owner[key] = node
        load[node] += 1
    return owner


def rank_with_owner(peers: Iterable[str], key: str, owner: str | None) -> list[str]:
    """The rendezvous ranking with ``owner`` moved to the front. When the owner drops out,
    the key falls to the next node of its plain ranking, as with plain rendezvous."""
    order = rank(peers, key)
    if owner in order:
        order.remove(owner)
        order.insert(0, owner)
    return order
