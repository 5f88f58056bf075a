"""The relay trees (data/schedule.py): the same on every node, shallow, and balanced."""

from __future__ import annotations

import itertools
import math
from collections import Counter

import pytest

from weightship.data.schedule import (
    live_parent,
    origin_fetchers,
    origin_requests,
    plan_owners,
    relay_depth,
    relay_parent,
    stand_in,
    tree_offset,
)

NODES = [f"n{i:02d}" for i in range(48)]


def test_fanout_one_is_the_ring_each_node_asks_the_node_before_it() -> None:
    for owner in NODES[:5]:
        for i, node in enumerate(NODES):
            want = None if node == owner else NODES[i - 1]
            assert relay_parent(NODES, owner, node, 1) == want


@pytest.mark.parametrize("fanout", [2, 3, 4])
def test_every_tree_reaches_every_node_from_its_owner_in_log_hops(fanout: int) -> None:
    bound = math.ceil(math.log(len(NODES) * (fanout - 1) + 1, fanout))
    for owner in NODES:
        for node in NODES:
            hops, at, seen = 0, node, set()
            while at != owner:
                assert at not in seen  # no cycle
                seen.add(at)
                parent = relay_parent(NODES, owner, at, fanout)
                assert parent is not None
                at, hops = parent, hops + 1
            assert hops <= bound


@pytest.mark.parametrize("fanout", [1, 2, 4])
def test_over_all_owners_each_node_feeds_one_child_per_tree_on_average(fanout: int) -> None:
    """Every node uploads n - 1 streams over the n trees, as in the ring, so no uplink
    carries more than its share whichever trees are busy; each node is at most ``fanout``
    children's parent in one tree."""
    children: Counter[str] = Counter()
    for owner in NODES:
        per_tree = Counter(
            p for n in NODES if (p := relay_parent(NODES, owner, n, fanout)) is not None
        )
        assert max(per_tree.values()) <= fanout
        children.update(per_tree)
    assert set(children.values()) == {len(NODES) - 1}


def test_the_owner_and_strangers_have_no_parent() -> None:
    assert relay_parent(NODES, "n03", "n03", 2) is None
    assert relay_parent(NODES, "gone", "n03", 2) is None
    assert relay_parent(NODES, "n03", "gone", 2) is None
    with pytest.raises(ValueError, match="fanout"):
        relay_parent(NODES, "n03", "n04", 0)


def test_depth_of_a_heap_position() -> None:
    assert [relay_depth(7, p, 2) for p in range(7)] == [0, 1, 1, 2, 2, 2, 2]
    assert relay_depth(48, 47, 1) == 47
    with pytest.raises(ValueError):
        relay_depth(4, 4, 2)


def test_at_most_count_nodes_fetch_from_the_origin_and_all_nodes_agree() -> None:
    keys = [f"blake3:{i:064x}" for i in range(100)]
    chosen = origin_fetchers(NODES, keys, 8)
    assert len(set(chosen)) == 8 and set(chosen) <= set(NODES)
    assert origin_fetchers(list(reversed(NODES)), keys, 8) == chosen
    # Spread evenly over the sorted nodes: 48 / 8 apart.
    places = sorted(NODES.index(n) for n in chosen)
    assert {(b - a) for a, b in itertools.pairwise(places)} == {6}
    planned, owners = plan_owners(keys, NODES, 8)
    assert planned == chosen
    assert set(owners.values()) == set(chosen)
    assert max(Counter(owners.values()).values()) == 13  # ceil(100 / 8)
    # A small fleet: every node fetches.
    assert origin_fetchers(NODES[:5], keys, 8) == NODES[:5]
    # Another model starts elsewhere.
    other = origin_fetchers(NODES, [f"blake3:{i + 7:064x}" for i in range(100)], 8)
    assert other != chosen


@pytest.mark.parametrize(("nodes", "fanout"), [(48, 1), (48, 2), (37, 2), (1000, 2)])
def test_the_fetchers_trees_spread_the_uplinks_evenly(nodes: int, fanout: int) -> None:
    """8 fetchers' trees busy at once: each node feeds one child per tree at most on
    average, 8 in all, never more (fetchers picked by rendezvous and swapped to the front
    of evenly spaced rotations fed 10: 25 % over their uplinks)."""
    names = [f"node-{i:04d}" for i in range(nodes)]
    index = {n: i for i, n in enumerate(names)}
    keys = [f"blake3:{i:064x}" for i in range(100)]
    chosen = origin_fetchers(names, keys, 8)
    children: Counter[str] = Counter()
    for owner in chosen:
        offset = tree_offset(index, owner)
        for node in names:
            parent = relay_parent(names, owner, node, fanout, offset, index)
            assert (parent is None) == (node == owner)
            if parent is not None:
                children[parent] += 1
    assert sum(children.values()) == 8 * (nodes - 1)
    assert max(children.values()) <= 8


def test_a_stand_in_root_takes_the_front_of_the_tree_and_the_rest_stays() -> None:
    """A dead fetcher's chunk comes from the node standing in for it: that node is the
    root of the same tree, and it swaps places with the node that was at the front."""
    members = NODES[:7]
    offset = 3  # n03 at the front
    before = {n: relay_parent(members, "n03", n, 2, offset) for n in members}
    after = {n: relay_parent(members, "n05", n, 2, offset) for n in members}
    assert before["n04"] == before["n05"] == "n03"
    assert after["n04"] == after["n03"] == "n05"  # n03 took n05's place
    assert after["n06"] == before["n06"] == "n04"
    assert tree_offset({"n03": 3}, "n03") == 3
    assert tree_offset({"n03": 3}, "gone") is None


@pytest.mark.parametrize("fanout", [1, 2, 3])
def test_a_dead_owners_first_live_child_stands_in_and_no_other_parent_changes(
    fanout: int,
) -> None:
    members = NODES[:20]
    index = {n: i for i, n in enumerate(members)}
    for owner, dead in [("n03", set()), ("n03", {"n04"}), ("n19", {"n00", "n01"})]:
        avoided = {owner, *dead}
        chosen = stand_in(members, index, owner, avoided)
        assert chosen is not None and chosen not in avoided
        # The first live node in the tree's order: the owner's child, or, its children
        # dead too, the next in line (the rotation wraps around the sorted nodes).
        start = index[owner]
        line = [members[(start + k) % len(members)] for k in range(1, len(members))]
        assert chosen == next(n for n in line if n not in avoided)
        if not dead:
            assert relay_parent(members, owner, chosen, fanout) == owner

        # Rooted at the stand-in, every live node other than the dead owner's old
        # children keeps its parent, the dead ones skipped for theirs.
        def parent(
            root: str, node: str, start: int = start, avoided: set[str] = avoided
        ) -> str | None:
            p = relay_parent(members, root, node, fanout, start, index)
            while p is not None and p != root and p in avoided:
                p = relay_parent(members, root, p, fanout, start, index)
            return p

        moved = {
            n
            for n in members
            if n not in avoided and n != chosen and parent(owner, n) != parent(chosen, n)
        }
        assert all(parent(owner, n) in avoided for n in moved), moved
    assert stand_in(members, index, "n03", set(members)) is None
    assert stand_in(members, index, "stranger", set()) is None


def test_fetchers_pipeline_their_origin_requests_only_where_some_nodes_fetch() -> None:
    # Every node a fetcher: one request each (two flows per node shared the origin
    # unevenly); a few fetchers for the fleet: two, so a first byte never idles a stream.
    assert [origin_requests(n, 8) for n in (1, 8, 9, 10_000)] == [1, 1, 2, 2]
    assert origin_requests(48, len(origin_fetchers(NODES, ["k"], 8))) == 2


@pytest.mark.parametrize(
    ("first_byte_s", "transfer_s", "requests"),
    [
        (0.01, 2.7, 2),  # the fleet benchmark: 1 MiB at a sixteenth of 50 Mbit/s
        (0.02, 0.215, 2),  # 16 MiB at a sixteenth of 10 Gbit/s
        (0.02, 0.16, 3),  # the first byte an eighth of the transfer
        (0.02, 0.079, 4),  # ... a quarter
        (0.02, 0.021, 8),  # 16 MiB at a sixteenth of 100 Gbit/s
        (0.5, 0.01, 8),  # never more than ORIGIN_REQUESTS_MAX
        (0.0, 0.0, 2),  # nothing measured
    ],
)
def test_fetchers_keep_more_origin_requests_in_flight_where_a_first_byte_takes_long(
    first_byte_s: float, transfer_s: float, requests: int
) -> None:
    assert origin_requests(1000, 8, first_byte_s, transfer_s) == requests
    assert origin_requests(8, 8, first_byte_s, transfer_s) == 1  # every node fetches


def test_a_node_asks_its_nearest_live_ancestor() -> None:
    """With nobody dead, its parent; with its parent and grandparent dead, the node
    above them; never the root (asked next anyway), so None below a dead root's child."""
    names = [f"node-{i:04d}" for i in range(100)]
    index = {n: i for i, n in enumerate(names)}
    root, offset = names[40], 40
    for node in names:
        parent = relay_parent(names, root, node, 2, offset, index)
        want = None if parent == root else parent
        assert live_parent(names, index, root, node, 2, offset, set()) == want
    node = names[40 + 20]  # position 20: parent 9, grandparent 4, then 1, then the root
    chain = [names[40 + p] for p in (9, 4, 1)]
    assert live_parent(names, index, root, node, 2, offset, set()) == chain[0]
    assert live_parent(names, index, root, node, 2, offset, set(chain[:2])) == chain[2]
    assert live_parent(names, index, root, node, 2, offset, set(chain)) is None
