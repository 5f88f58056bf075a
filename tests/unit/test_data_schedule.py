"""The relay trees (data/schedule.py): the same on every node, shallow, and balanced."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from weightship.data.schedule import (
    origin_fetchers,
    plan_owners,
    relay_depth,
    relay_parent,
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
    assert len(chosen) == 8 and set(chosen) <= set(NODES)
    assert origin_fetchers(list(reversed(NODES)), keys, 8) == chosen
    owners = plan_owners(keys, NODES, 8)
    assert set(owners.values()) == set(chosen)
    assert max(Counter(owners.values()).values()) == 13  # ceil(100 / 8)
    # A small fleet: every node fetches, in name order (each tree is its rotation).
    assert origin_fetchers(NODES[:5], keys, 8) == NODES[:5]
    # A node outside the fetchers leaving changes none of them.
    outsider = next(n for n in NODES if n not in chosen)
    assert origin_fetchers([n for n in NODES if n != outsider], keys, 8) == chosen


@pytest.mark.parametrize("fanout", [2, 3])
def test_the_fetchers_trees_spread_the_uplinks_evenly(fanout: int) -> None:
    """With 8 fetchers over 48 nodes (8 trees busy at once), each node feeds about 8
    children in all, one per tree; none feeds more than fanout + a tree's rounding."""
    keys = [f"blake3:{i:064x}" for i in range(100)]
    chosen = origin_fetchers(NODES, keys, 8)
    children: Counter[str] = Counter()
    for owner in chosen:
        offset = tree_offset(NODES, chosen, owner)
        for node in NODES:
            parent = relay_parent(NODES, owner, node, fanout, offset)
            assert (parent is None) == (node == owner)
            if parent is not None:
                children[parent] += 1
    assert sum(children.values()) == 8 * 47
    assert max(children.values()) <= 8 + fanout + 1
    assert sum(children.values()) / len(NODES) == pytest.approx(8 * 47 / 48)


def test_a_stand_in_root_takes_the_front_of_the_tree_and_the_rest_stays() -> None:
    """A dead fetcher's chunk comes from the next node of its ranking: that node is the
    root of the same tree, and it swaps places with the node that was at the front."""
    members = NODES[:7]
    offset = 3  # n03 at the front
    before = {n: relay_parent(members, "n03", n, 2, offset) for n in members}
    after = {n: relay_parent(members, "n05", n, 2, offset) for n in members}
    assert before["n04"] == before["n05"] == "n03"
    assert after["n04"] == after["n03"] == "n05"  # n03 took n05's place
    assert after["n06"] == before["n06"] == "n04"
