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

from collections.abc import Collection, Mapping, Sequence

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
    """Origin fetches a fetcher keeps in flight (its origin lane). One where every node
    fetches: with two, TCP shared the origin link unevenly between the flows, one node's
    origin stream finished 8 s after the others and every node waited for its chunks
    (the fleet benchmark, 8 nodes). Two where only some nodes fetch: each fetcher's
    stream is then its chunks' only source for the whole fleet, and one request at a
    time leaves the fetcher's share of the origin idle for a first byte between chunks:
    20 ms of 127 for a 16 MiB chunk at an eighth of 10 Gbit/s (the simulator, 1,000
    nodes: 1.29x S/B with one, 1.16x with two; the fleet benchmark, 16 nodes at
    50 Mbit/s: 1.17x with either)."""
    return 2 if fetchers < nodes else 1


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

    def steady(self, x: str, orphan: str, avoided: Collection[str]) -> bool:
        """Whether ``x`` may take ``orphan`` on: neither ``x`` nor any node above it is
        ``orphan``, or a dead node's child past its first (one that may be taken on
        elsewhere itself): ``x`` then asks up its own path to the root, which ``orphan``
        is not on, and no chain of asks runs in a cycle."""
        p = self.position(x)
        o = self.position(orphan)
        while p:
            if p == o:
                return False
            up = (p - 1) // self.fanout
            if up and self.at(up) in avoided and p != up * self.fanout + 1:
                return False
            p = up
        return True

    def children(self, x: str) -> list[str]:
        first = self.position(x) * self.fanout + 1
        return [self.at(p) for p in range(first, min(first + self.fanout, len(self.members)))]


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


def fetcher_trees(
    members: Sequence[str],
    index: Mapping[str, int],
    fetchers: Sequence[str],
    avoided: Collection[str],
) -> list[tuple[str, int | None]]:
    """Each origin fetcher's relay tree as (root, offset), in ``fetchers``' order: rooted
    at the fetcher, or at the node standing in for it when it is dead (``stand_in``)."""
    trees: list[tuple[str, int | None]] = []
    for f in fetchers:
        root = f if f not in avoided else (stand_in(members, index, f, avoided) or f)
        trees.append((root, tree_offset(index, f)))
    return trees


def live_parent(
    members: Sequence[str],
    index: Mapping[str, int],
    node: str,
    fanout: int,
    avoided: Collection[str],
    fetchers: Sequence[str],
    owner: str,
    root: str,
) -> str | None:
    """Whom ``node`` asks for a chunk of ``owner``'s tree before the chunk's ``root`` (the
    owner, or the node standing in for it): its parent in that tree, or, when the parent
    is dead (``avoided``), a live node that the death freed room on (``_adopter``), else
    the parent's nearest live ancestor. None when that is the root (asked next anyway).
    ``fetchers``: the origin fetchers, in the same order on every node.

    Why not always the nearest live ancestor: a dead node's children all moved to its
    parent, in every tree it had children in, so that parent fed one stream more than
    its share of its uplink for each such tree, and everything below it slowed; with
    10 % of a fleet killed mid-stage, most nodes sat below such a parent in one tree or
    another (the simulator, 10,000 nodes: the slowest at 1.77x S/B, against 1.22x for
    the median). A death frees as much upload as it orphans: the dead node's parent in
    every tree lost one stream, and it fed about one stream per tree. So its first child
    in a tree asks its parent there, as before, and each further child asks its parent
    in a tree where it fed nobody, in an order every node computes alike."""
    trees = fetcher_trees(members, index, fetchers, avoided)
    if owner in fetchers:
        tree = list(fetchers).index(owner)
        trees[tree] = (root, trees[tree][1])
    else:  # not a fetcher's chunk: its owner's tree alone
        trees, tree = [(root, tree_offset(index, owner))], 0
    t = _tree(members, root, fanout, trees[tree][1], index)
    if t is None or node not in t.index:
        return None
    p = t.parent(node)
    if p is not None and p != root and p in avoided:
        adopter = _adopter(members, index, fanout, avoided, trees, tree, p, node)
        if adopter is not None:
            return None if adopter == root else adopter
    while p is not None and p != root and p in avoided:
        p = t.parent(p)
    return None if p is None or p == root else p


def _adopter(
    members: Sequence[str],
    index: Mapping[str, int],
    fanout: int,
    avoided: Collection[str],
    trees: Sequence[tuple[str, int | None]],
    tree: int,
    dead: str,
    orphan: str,
) -> str | None:
    """The live node that takes ``orphan`` on in ``trees[tree]`` in place of its parent
    ``dead``, when ``orphan`` is not the dead node's first child there: the dead node's
    parent in a tree where it had no child (a slot). The dead node's children past the
    first, over all trees (in the order of ``trees``, then of the children), each take
    the first live slot not taken yet that is ``steady`` in their own tree: one whose
    own asks run up its path to the root, never through an adopter, so no chain of asks
    runs in a cycle (taking any node not below the orphan, 10,000 nodes with 10 % dead
    had cycles through adopters' own adopters, 1,480 nodes in one of them; taking only
    nodes above the orphan, most orphans found no slot: 2,000 nodes with 10 % killed,
    1.34x S/B in the simulator against 1.18x). None when no slot is left for it."""
    extras: list[tuple[int, str]] = []  # the dead node's children past its first, per tree
    slots: list[str] = []  # its parent in each tree where it had no child
    laid = [_tree(members, r, fanout, off, index) for r, off in trees]
    for i, t in enumerate(laid):
        if t is None or t.root == dead:
            continue
        kids = t.children(dead)
        if kids:
            extras.extend((i, k) for k in kids[1:])
        elif (up := t.parent(dead)) is not None:
            slots.append(up)
    taken: set[int] = set()
    for i, kid in extras:  # each takes the first free slot that can take it
        t = laid[i]
        assert t is not None
        k = next(
            (
                k
                for k, x in enumerate(slots)
                if k not in taken and x not in avoided and t.steady(x, kid, avoided)
            ),
            None,
        )
        if (i, kid) == (tree, orphan):
            return None if k is None else slots[k]
        if k is not None:
            taken.add(k)
    return None


def relay_depth(n: int, position: int, fanout: int) -> int:
    """Hops from the root to ``position`` of a ``fanout``-ary heap of ``n`` nodes."""
    if not 0 <= position < n:
        raise ValueError(f"position {position} is outside a tree of {n}")
    depth = 0
    while position:
        position = (position - 1) // fanout
        depth += 1
    return depth
