import hashlib
from collections import Counter

from weightship.data.rendezvous import rank

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
