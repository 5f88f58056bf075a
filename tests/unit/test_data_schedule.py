"""The relay trees (data/schedule.py): the same on every node, shallow, and balanced."""

from __future__ import annotations

import itertools
import math
from collections import Counter

import pytest

from weightship.data.schedule import (
    ORIGIN_REQUESTS_MAX,
    OriginRead,
    live_parent,
    origin_fetchers,
    origin_idle_share,
    origin_requests,
    plan_owners,
    relay_depth,
    relay_parent,
    stand_in,
    tree_offset,
    widened_origin_requests,
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


def reads_of(*spans: tuple[float, float, float]) -> list[OriginRead]:
    return [OriginRead(*span) for span in spans]


def test_an_origin_lane_is_idle_only_while_every_read_under_way_waits_for_its_first_byte() -> None:
    # Two reads at once, both waiting 1 s, then moving 1 s: idle half the time.
    together = reads_of((0, 1, 2), (0, 1, 2), (2, 3, 4), (2, 3, 4))
    assert origin_idle_share(together) == pytest.approx(0.5)
    # Staggered by half a read: one always moving once the first byte came.
    staggered = reads_of((0, 1, 3), (1.5, 2.5, 4.5), (3, 4, 6), (4.5, 5.5, 7.5))
    assert origin_idle_share(staggered) == pytest.approx(1 / 7.5)
    # A pause of the fetcher's own (nothing asked from 2 to 10 s) is not idle time.
    paused = reads_of((0, 0.1, 2), (10, 10.1, 12))
    assert origin_idle_share(paused) == pytest.approx(0.2 / 4)
    assert origin_idle_share([]) == 0.0


def test_an_origin_lane_widens_while_its_reads_wait_together() -> None:
    together = reads_of((0, 1, 2), (0, 1, 2), (2, 3, 4), (2, 3, 4))
    assert widened_origin_requests(2, together) == 4  # moving half the time: twice as many
    assert widened_origin_requests(4, together * 2) == 8
    assert widened_origin_requests(2, together[:3]) == 2  # judged after two rounds
    assert widened_origin_requests(ORIGIN_REQUESTS_MAX, together * 8) == ORIGIN_REQUESTS_MAX
    # The fleet benchmark on a loaded machine: a third of a second to a first byte
    # beside 2.7 s transfers, but the fetcher's second read moving meanwhile.
    shaped = reads_of((0, 0.3, 3.0), (1.4, 1.7, 4.4), (3.0, 3.3, 6.0), (4.4, 4.7, 7.4))
    assert widened_origin_requests(2, shaped) == 2


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
