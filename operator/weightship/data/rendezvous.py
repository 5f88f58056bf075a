"""Highest-random-weight (rendezvous) hashing.

Every node ranks the same peers the same way for a chunk without talking to anyone, and
removing a peer only moves the chunks that peer ranked first for.

A node's weight for a key mixes two 64-bit hashes, one of the node name and one of the
key (``weight``), so a fleet's weights for one key are one vector operation over the
node hashes, computed once per node set (``Ranker``): a stage of 8,345 chunks at 5,000
nodes ranks in tenths of a second where a sha256 per (node, key) pair took minutes of CPU
(issue 38). Every node of a fleet must run the same weight function to agree on owners:
nodes that disagree still stage verified bytes, slower (docs/data-plane.md).
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Iterable

import numpy as np
import numpy.typing as npt

U64 = npt.NDArray[np.uint64]


def hash64(text: str) -> int:
    """The first 8 bytes of the text's sha256, as an unsigned integer."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


def _mix(x: U64) -> U64:
    """splitmix64's finalizer: every bit of the input moves every bit of the output, so
    ``node ^ key`` ranks as independently as a hash of the pair."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def weight(peer: str, key: str) -> int:
    return int(_mix(np.array([hash64(peer) ^ hash64(key)], dtype=np.uint64))[0])


class Ranker:
    """Rankings over one node set: the node hashes are taken once, and a key's weights
    are one vector operation over them."""

    def __init__(self, nodes: Iterable[str]) -> None:
        self.nodes = sorted(set(nodes))
        self.index = {n: i for i, n in enumerate(self.nodes)}
        self._hashes = np.array([hash64(n) for n in self.nodes], dtype=np.uint64)

    def weights(self, key: str) -> U64:
        return _mix(self._hashes ^ np.uint64(hash64(key)))

    def rank(self, key: str) -> list[str]:
        """Every node, highest weight first; ties (never in practice) broken by name."""
        order = np.argsort(~self.weights(key), kind="stable")
        return [self.nodes[i] for i in order]

    def top(self, key: str, count: int, skip: Collection[str] = ()) -> list[str]:
        """The first ``count`` nodes of ``rank(key)`` that are not in ``skip``, without
        sorting the whole node set."""
        n = len(self.nodes)
        want = min(n, count + sum(1 for s in skip if s in self.index))
        if want <= 0:
            return []
        inverted = ~self.weights(key)
        if want < n:
            head = np.argpartition(inverted, want - 1)[:want]
            head = head[np.lexsort((head, inverted[head]))]
        else:
            head = np.argsort(inverted, kind="stable")
        return [node for i in head if (node := self.nodes[i]) not in skip][:count]


def rank(peers: Iterable[str], key: str) -> list[str]:
    """Peers, highest weight for ``key`` first; ties (never in practice) broken by name."""
    return Ranker(peers).rank(key)


def balanced_owners(
    keys: Iterable[str], nodes: Iterable[str], *, first: int | None = None
) -> dict[str, str]:
    """An owner for every key, each node owning at most ceil(keys / nodes) of them.

    Rendezvous with bounded loads: walk the unique keys in the given order (the
    manifest's) and give each to its best-ranked node that is still under the cap.
    Deterministic: every node that knows the keys and the node set computes the same map,
    with nobody coordinating. Plain rendezvous gives owners ±40 % of the mean at a few
    dozen chunks per node; this gives each exactly the mean, rounded up. One vector pass
    over the nodes per key.

    ``first``: the owners of the first that many unique keys only (the same as in the
    whole map: the walk is in order), for a caller that needs only those.
    """
    unique = list(dict.fromkeys(keys))
    ranker = Ranker(nodes)
    if not ranker.nodes:
        return {}
    cap = -(-len(unique) // len(ranker.nodes))
    load = np.zeros(len(ranker.nodes), dtype=np.int64)
    full = np.zeros(len(ranker.nodes), dtype=bool)
    owner = {}
    for key in unique if first is None else unique[:first]:
        # Full nodes drop to the bottom; ~w sorts highest first, the lowest index (name)
        # first among ties, as rank() does.
        inverted = np.where(full, np.uint64(2**64 - 1), ~ranker.weights(key))
        i = int(np.argmin(inverted))
        if full[i]:  # every non-full node weighs 0: not in this universe, but exact
            i = next(ranker.index[n] for n in ranker.rank(key) if not full[ranker.index[n]])
        owner[key] = ranker.nodes[i]
        load[i] += 1
        full[i] = load[i] >= cap
    return owner


def rank_with_owner(peers: Iterable[str], key: str, owner: str | None) -> list[str]:
    """The rendezvous ranking with ``owner`` moved to the front. When the owner drops out,
    the key falls to the next node of its plain ranking, as with plain rendezvous."""
    order = rank(peers, key)
    if owner in order:
        order.remove(owner)
        order.insert(0, owner)
    return order
