"""Who fetches a chunk from the origin, and who relays it to whom: the same answer on
every node, with no coordinator.

Pure functions of the node set and the manifest's chunk keys, shared by the agent's
fetcher and the fleet simulator (bench/sim_fleet.py), so the two cannot drift apart.

**Origin fetchers.** At most ``count`` nodes fetch from the origin (the first of a
rendezvous ranking over the manifest), and the chunks are balanced among them
(``plan_owners``). Every node must follow every chunk that is arriving somewhere, and
each peer lane follows a bounded number at once: with every node an owner, a fleet of 32
had 32 origin streams at a 32nd of the origin's rate each, and a node following 16 of
them took 53 % of its link for the first 6 s (the fleet benchmark, 2026-12-06). With
``count`` fetchers each stream is faster and every node follows all of them, whatever the
fleet's size. Adding or removing a node changes the fetchers only when it ranks among
them.

**Relay trees.** Every node takes a chunk it does not own from its parent in the tree of
the chunk's fetcher, which streams it on as it lands (cut-through). A tree is the node
set, sorted by name, rotated to start at an offset of its own and read as a
``fanout``-ary heap, with the tree's root (the fetcher, or whoever fetches in its place)
swapped to the front. The fetchers' offsets are spread evenly over the node set, so every
node sits at each depth in about the same number of trees, and uploads the same share:
one child per tree on average. Fanout 1 is a ring (each node asks the node before it): a
chunk crosses up to n - 1 hops; a fanout of 2 takes about log2(n).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from weightship.data import rendezvous


def origin_fetchers(nodes: Sequence[str], keys: Sequence[str], count: int) -> list[str]:
    """The nodes that fetch chunks from the origin, in slot order (the order of their
    trees' offsets): every node when there are at most ``count``, sorted; else the first
    ``count`` of the rendezvous ranking for the manifest's first chunk key."""
    members = sorted(set(nodes))
    if count < 1:
        raise ValueError("count must be at least 1")
    if len(members) <= count or not keys:
        return members
    return rendezvous.Ranker(members).top(f"origin\0{keys[0]}", count)


def plan_owners(
    keys: Sequence[str], nodes: Sequence[str], fetchers: int, *, first: int | None = None
) -> dict[str, str]:
    """Each chunk's owner: balanced among the ``origin_fetchers`` of the node set
    (``first``: only the first that many unique keys, as ``balanced_owners``)."""
    chosen = origin_fetchers(nodes, keys, fetchers)
    return rendezvous.balanced_owners(keys, chosen, first=first)


def tree_offset(members: Sequence[str], fetchers: Sequence[str], owner: str) -> int:
    """Where ``owner``'s tree starts in ``members`` (sorted): the owner's own index while
    every node fetches (the rotation that starts at it), else its slot's share of the
    node set, so the fetchers' trees are spread evenly over it."""
    if len(fetchers) >= len(members) or owner not in fetchers:
        return members.index(owner) if owner in members else 0
    return fetchers.index(owner) * len(members) // len(fetchers)


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
    if fanout < 1:
        raise ValueError("fanout must be at least 1")
    where = index if index is not None else {m: i for i, m in enumerate(members)}
    if root == node or root not in where or node not in where:
        return None
    n = len(members)
    start = where[root] if offset is None else offset % n
    root_at = (where[root] - start) % n  # where the root sits before the swap
    displaced = members[start]  # the node the root swaps places with

    def position(x: str) -> int:
        if x == root:
            return 0
        if x == displaced:
            return root_at
        return (where[x] - start) % n

    def at(p: int) -> str:
        if p == 0:
            return root
        if p == root_at:
            return displaced
        return members[(start + p) % n]

    return at((position(node) - 1) // fanout)


def relay_depth(n: int, position: int, fanout: int) -> int:
    """Hops from the root to ``position`` of a ``fanout``-ary heap of ``n`` nodes."""
    if not 0 <= position < n:
        raise ValueError(f"position {position} is outside a tree of {n}")
    depth = 0
    while position:
        position = (position - 1) // fanout
        depth += 1
    return depth
