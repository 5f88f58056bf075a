import hashlib
from collections import Counter

from weightship.data.rendezvous import balanced_owners, rank, rank_with_owner

PEERS = [f"node-{i}" for i in range(10)]
KEYS = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(5000)]


def test_ranking_is_deterministic_and_order_independent() -> None:
    for key in KEYS[:50]:
        r = rank(PEERS, key)
        assert sorted(r) == sorted(PEERS)
        assert rank(list(reversed(PEERS)), key) == r
        assert rank(PEERS + PEERS[:3], key) == r  # duplicates do not change the answer


def test_owners_are_balanced() -> None:
    owners = Counter(rank(PEERS, key)[0] for key in KEYS)
    expected = len(KEYS) / len(PEERS)
    assert set(owners) == set(PEERS)
    assert all(0.85 * expected < n < 1.15 * expected for n in owners.values()), owners


def test_removing_a_peer_moves_only_its_keys() -> None:
    gone = "node-3"
    survivors = [p for p in PEERS if p != gone]
    for key in KEYS[:500]:
        before = rank(PEERS, key)
        after = rank(survivors, key)
        assert after == [p for p in before if p != gone]


def test_balanced_owners_cap_every_node_and_agree_everywhere() -> None:
    keys = KEYS[:203]
    owners = balanced_owners(keys, PEERS)
    assert balanced_owners(keys, list(reversed(PEERS))) == owners  # any node, same map
    loads = Counter(owners.values())
    assert set(loads) == set(PEERS)
    assert max(loads.values()) == 21  # ceil(203 / 10)
    assert sum(loads.values()) == len(keys)
    # Most keys keep their plain rendezvous owner; the cap only moves the overflow.
    same = sum(owners[k] == rank(PEERS, k)[0] for k in keys)
    assert same > 0.7 * len(keys)


def test_a_dead_owner_falls_through_its_ranking() -> None:
    owners = balanced_owners(KEYS[:100], PEERS)
    for key in KEYS[:100]:
        order = rank_with_owner(PEERS, key, owners[key])
        assert order[0] == owners[key] and sorted(order) == sorted(PEERS)
        # Every node agrees on who takes over: the next node of the plain ranking.
        assert order[1:] == [p for p in rank(PEERS, key) if p != owners[key]]
    assert rank_with_owner(PEERS, KEYS[0], None) == rank(PEERS, KEYS[0])
