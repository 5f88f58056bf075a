"""Who fetches a chunk from the origin, and who relays it to whom: the same answer on
every node, with no coordinator.

Pure functions of the node set and the manifest's chunk keys, shared by the agent's
fetcher and the fleet simulator (bench/sim_fleet.py), so the two cannot drift apart.

**Origin fetchers.** At most ``count`` nodes fetch from the origin, spread evenly over
the sorted node set, and the chunks are balanced among them (``plan_owners``). Every
node must follow every chunk that is arriving somewhere, and a peer lane follows a
bounded number at once: with every node an owner, a fleet of 32 had 32 origin streams
at a 32nd of the origin's rate each, and a node following 16 of them took 53 % of its
link for the first 6 s (the fleet benchmark, 2026-12-06). With ``count`` fetchers each
stream is faster and every node follows all of them, whatever the fleet's size. Nodes
must agree on the node set to agree on the fetchers (as on the owners before: the
balanced map's cap depends on it); where they do not, a chunk's fetcher is waited for
``owner_wait_s`` at most, then fetched from the origin.

**Relay trees.** Every node takes a chunk it does not own from its parent in the tree of
the chunk's fetcher, which streams it on as it lands (cut-through). A tree is the sorted
node set, dead nodes included, rotated to start at its fetcher and read as a
``fanout``-ary heap; a node that fetches in place of a dead fetcher takes the front
(``stand_in``: the dead fetcher's first live child), and a node whose parent is dead
asks that parent's parent, so one node's view of who is dead changes whom it asks,
never anyone else's tree. A node that finds the root of its round of asks dead starts a
new round at once (``round_goes_on``), so the stand-in takes over the moment it is cut
off. The fetchers' trees start at evenly spaced places, so every node sits at each
depth in about the same number of the busy trees and uploads one child's stream per
tree on average, as in a ring: with the fetchers picked by rendezvous instead and
swapped to the front of evenly spaced rotations, some nodes fed 10 children where the
mean was 8 (25 % over their uplink, and everything below them slowed). Fanout 1 is a
ring (each node asks the node before it): a chunk crosses up to n - 1 hops; a fanout of
2 takes about log2(n).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from weightship.data import rendezvous


def origin_fetchers(nodes: Sequence[str], keys: Sequence[str], count: int) -> list[str]:
    """The nodes that fetch chunks from the origin: every node when there are at most
    ``count``; else ``count`` nodes spread evenly over the sorted node set, from an index
    the manifest's first chunk key picks (so models spread over different nodes). Each
    fetcher's tree starts at its own index, so the trees' starts are spread evenly too."""
    members = sorted(set(nodes))
    if count < 1:
        raise ValueError("count must be at least 1")
    n = len(members)
    if n <= count or not keys:
        return members
    base = rendezvous.hash64(f"origin\0{keys[0]}") % n
    return [members[(base + t * n // count) % n] for t in range(count)]


def origin_requests(nodes: int, fetchers: int) -> int:
    """Origin fetches a fetcher keeps in flight (its origin lane) to begin with. One where
    every node fetches: with two, TCP shared the origin link unevenly between the flows,
    one node's origin stream finished 8 s after the others and every node waited for its
    chunks (the fleet benchmark, 8 nodes). Two where only some nodes fetch: each
    fetcher's stream is then its chunks' only source for the whole fleet, and one request
    at a time leaves the fetcher's share of the origin idle for a first byte between
    chunks: 20 ms of 127 for a 16 MiB chunk at an eighth of 10 Gbit/s (the simulator,
    1,000 nodes: 1.29x S/B with one, 1.16x with two; the fleet benchmark, 16 nodes at
    50 Mbit/s: 1.17x with either). More as it goes where that is not enough
    (``widened_origin_requests``)."""
    return 2 if fetchers < nodes else 1


# A fetcher's origin requests in flight at most (``widened_origin_requests``).
ORIGIN_REQUESTS_MAX = 8
# ... one more while its origin reads sat waiting for a first byte, none moving bytes,
# over this share of the time they were busy.
ORIGIN_IDLE_SHARE = 0.25


@dataclass(frozen=True)
class OriginRead:
    """One origin read's times: asked, its first byte, its last."""

    asked: float
    first_byte: float
    end: float


def origin_idle_share(reads: Sequence[OriginRead]) -> float:
    """Of the time some of ``reads`` were under way, the share when every one under way
    was still waiting for its first byte: the fetcher's share of the origin's link idle
    for want of requests (time in which none was under way, a pause of its own, is not
    counted)."""
    events = sorted(
        [(r.asked, 0, 1) for r in reads]
        + [(r.first_byte, 1, 1) for r in reads]
        + [(r.end, 1, -1) for r in reads]
        + [(r.first_byte, 0, -1) for r in reads]
    )
    waiting = moving = 0
    idle = busy = 0.0
    last = events[0][0] if events else 0.0
    for at, kind, step in events:
        if waiting or moving:
            busy += at - last
            if not moving:
                idle += at - last
        last = at
        if kind:
            moving += step
        else:
            waiting += step
    return idle / busy if busy > 0 else 0.0


def widened_origin_requests(in_flight: int, reads: Sequence[OriginRead]) -> int:
    """The origin requests a fetcher keeps in flight after its last ``reads`` (the lane's
    last two rounds, ``2 * in_flight``, judged once it has had that many): where they
    waited for first bytes with none moving over ``ORIGIN_IDLE_SHARE`` of the time, so
    many more that the moving share would be whole (two idle half the time: four).
    A fast origin needs it: at 100 Gbit/s a 16 MiB chunk moves in 21 ms at a sixteenth of
    the link, after a 20 ms first byte, and two requests started together wait for their
    first bytes together (the simulator, 200 nodes, 32 GiB at 100 Gbit/s: 2.02x S/B with
    two). A long first byte alone is no reason: where the origin's link is full, a GET's
    answer waits behind the other flows' bytes, and more requests would only queue (the
    fleet benchmark, 50 Mbit/s, a loaded machine: first bytes of a third of a second
    beside 2.7 s transfers, while each fetcher always had a read moving)."""
    if in_flight >= ORIGIN_REQUESTS_MAX or len(reads) < 2 * in_flight:
        return in_flight
    idle = origin_idle_share(reads[-2 * in_flight :])
    if idle <= ORIGIN_IDLE_SHARE:
        return in_flight
    # As many as it takes for the moving share of the time to be whole.
    return min(ORIGIN_REQUESTS_MAX, max(in_flight + 1, math.ceil(in_flight / (1 - idle))))


def plan_owners(
    keys: Sequence[str], nodes: Sequence[str], fetchers: int, *, first: int | None = None
) -> tuple[list[str], dict[str, str]]:
    """The ``origin_fetchers`` of the node set, and each chunk's owner, balanced among
    them (``first``: only the first that many unique keys, as ``balanced_owners``)."""
    chosen = origin_fetchers(nodes, keys, fetchers)
    return chosen, rendezvous.balanced_owners(keys, chosen, first=first)


def tree_offset(index: Mapping[str, int], owner: str) -> int | None:
    """Where ``owner``'s tree starts among the sorted nodes (``index``: each one's place):
    at the owner, also when it is dead (the node that fetches in its place then takes the
    front: ``relay_parent``); None when it is not one of them."""
    return index.get(owner)


def stand_in(
    members: Sequence[str], index: Mapping[str, int], owner: str, avoided: Collection[str]
) -> str | None:
    """The node that fetches a dead ``owner``'s chunks from the origin: the first live
    node after it in its tree's order (its first child, unless that one is dead too), or
    None when all are dead. The first child asks the owner itself, so it is the first to
    find it dead, and no other node's relays run through it to the owner: it takes over
    at once, and every other node's parents stay as they were. (A stand-in picked by
    rendezvous sat anywhere in the dead owner's tree, still streaming the chunk that was
    in flight from below it while the owner's children asked it for the same bytes: a
    cycle that stalled the whole tree until the peer servers' stall timeout, 5 s, ended
    it: the simulator, 1,000 nodes with 10 % killed.)"""
    start = index.get(owner)
    if start is None:
        return None
    n = len(members)
    for step in range(1, n):
        candidate = members[(start + step) % n]
        if candidate not in avoided:
            return candidate
    return None


def round_goes_on(root: str, dead: Collection[str]) -> bool:
    """Whether a node's round of asks for a chunk (``ChunkFetcher._fetch``: its relays,
    then the round's ``root``, the first live node of the chunk's ranking when the round
    began, then the next ranked peers) goes on to its next peer: not once the root is
    found dead (``dead``: unreachable, or gone mid-transfer; ``PeerHealth.dead``). The
    next round then starts at once, ranked without it, so the node standing in for a
    dead fetcher (``stand_in``) fetches from the origin the moment its stream from the
    fetcher is cut, and the others ask it. Going on asked the round's other peers first:
    nodes holding what the dead fetcher had sent of the chunks it had in flight, copies
    that stopped growing, each stream of one stalling for the peer server's
    ``STREAM_STALL_S``; the stand-in was among the askers, so nobody filled them, and the
    others asked one another in cycles (the simulator and the real fetcher alike, 200
    nodes with 10 % killed: 954 stalled streams in four waves 5 s apart, 12.2x S/B; none,
    and 1.40x, with the round ending there). A root demoted for bad bytes is alive: the
    round goes on to peers that may hold the chunk whole."""
    return root not in dead


class _Tree:
    """Positions in the tree over ``members`` that starts at ``offset`` with ``root``
    swapped to the front, read as a ``fanout``-ary heap (``relay_parent``)."""

    def __init__(
        self,
        members: Sequence[str],
        root: str,
        fanout: int,
        offset: int | None,
        index: Mapping[str, int],
    ) -> None:
        self.members, self.root, self.fanout, self.index = members, root, fanout, index
        n = len(members)
        self.start = index[root] if offset is None else offset % n
        self.root_at = (index[root] - self.start) % n  # where the root sits before the swap
        self.displaced = members[self.start]  # the node the root swaps places with

    def position(self, x: str) -> int:
        if x == self.root:
            return 0
        if x == self.displaced:
            return self.root_at
        return (self.index[x] - self.start) % len(self.members)

    def at(self, p: int) -> str:
        if p == 0:
            return self.root
        if p == self.root_at:
            return self.displaced
        return self.members[(self.start + p) % len(self.members)]

    def parent(self, x: str) -> str | None:
        p = self.position(x)
        return self.at((p - 1) // self.fanout) if p else None


def _tree(
    members: Sequence[str],
    root: str,
    fanout: int,
    offset: int | None,
    index: Mapping[str, int] | None,
) -> _Tree | None:
    if fanout < 1:
        raise ValueError("fanout must be at least 1")
    where = index if index is not None else {m: i for i, m in enumerate(members)}
    return _Tree(members, root, fanout, offset, where) if root in where else None


def relay_parent(
    members: Sequence[str],
    root: str,
    node: str,
    fanout: int,
    offset: int | None = None,
    index: Mapping[str, int] | None = None,
) -> str | None:
    """The node that ``node`` takes a chunk from in the tree over ``members`` (sorted,
    both included) that starts at ``offset`` (default: the root's index) with ``root``
    swapped to the front; None for the root itself, or when either is not a member.
    ``index``: each member's index in ``members``, for a caller that keeps one."""
    tree = _tree(members, root, fanout, offset, index)
    if tree is None or node not in tree.index:
        return None
    return tree.parent(node)


def live_parent(
    members: Sequence[str],
    index: Mapping[str, int],
    root: str,
    node: str,
    fanout: int,
    offset: int | None,
    avoided: Collection[str],
) -> str | None:
    """Whom ``node`` asks for a chunk before the chunk's ``root`` (its owner, or the node
    standing in for it), in the tree that starts at ``offset`` (``relay_parent``): its
    nearest ancestor not in ``avoided`` (the dead it found). None when that is the root
    (asked next anyway). The fetcher's ``relay_source`` and the simulator both ask this.

    Tried and not kept (2026-12-07): a dead node's children past its first in a tree
    sent to its parents in trees where it fed nobody, so that its death's freed upload
    takes its orphans instead of its parent (which feeds one stream over its share for
    every tree the dead node had two children in). The simulator, 16 GiB, 10 % killed:
    2,000 nodes 1.33 -> 1.28x S/B, 5,000 nodes 1.35 -> 1.21x, but 10,000 nodes 12.86x
    with 4,428 stalled streams (1.77x without): each node judges from its own view of
    who is dead whether the node it would move to asks straight up to the root, and
    the views differ; taking any node not below the child had cycles even with one
    view (1,480 nodes in one of them, 10,000 nodes). Only heap order is safe under any
    views, and it found a place for too few (2,000 nodes: 1.34x). docs/benchmarks.md."""
    tree = _tree(members, root, fanout, offset, index)
    if tree is None or node not in tree.index:
        return None
    p = tree.parent(node)
    while p is not None and p != root and p in avoided:
        p = tree.parent(p)
    return None if p is None or p == root else p


def relay_depth(n: int, position: int, fanout: int) -> int:
    """Hops from the root to ``position`` of a ``fanout``-ary heap of ``n`` nodes."""
    if not 0 <= position < n:
        raise ValueError(f"position {position} is outside a tree of {n}")
    depth = 0
    while position:
        position = (position - 1) // fanout
        depth += 1
    return depth
