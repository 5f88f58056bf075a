"""A node joining late (the others listed their peers without it) takes their view:
the probe that finds out, and where its chunks then come from. No network, no clocks:
peers are a fake client's answers."""

import hashlib

import pytest
from prometheus_client import CollectorRegistry
from tests.unit.test_data_stage import MemorySink

from weightship.data import rendezvous
from weightship.data.fetcher import ChunkFetcher, FetchPolicy, Peer, late_probes
from weightship.data.metrics import DataPlaneMetrics
from weightship.data.peer import ChunkNotOnPeerError, PeerClient, PeerUnavailableError
from weightship.weightformat.entries import ChunkEntry

SIZE = 64
EARLY = [f"node-{i}" for i in range(5)]
ME = "late"
POLICY = FetchPolicy(owner_wait_s=5, poll_interval_s=0, long_poll_s=0, claims=False)


def data(i: int) -> bytes:
    return bytes([i % 251]) * SIZE


def make_chunks(n: int = 40) -> list[ChunkEntry]:
    return [
        ChunkEntry(
            file="w.bin",
            index=i,
            offset=i * SIZE,
            size=SIZE,
            sha256=hashlib.sha256(data(i)).hexdigest(),
        )
        for i in range(n)
    ]


class FakeClient(PeerClient):
    """Peers as dicts: ``held[node]`` the chunks it has; ``dead`` refuse connections.
    Records every request as (method, node, key)."""

    def __init__(self, held: dict[str, dict[str, bytes]], dead: set[str] = frozenset()) -> None:
        super().__init__()
        self.held, self.dead = held, set(dead)
        self.calls: list[tuple[str, str, str]] = []

    def _node(self, address: str) -> str:
        return address.removesuffix(":1")

    def has(self, address: str, key: str) -> bool:
        node = self._node(address)
        self.calls.append(("HEAD", node, key))
        if node in self.dead:
            raise PeerUnavailableError(f"{address}: refused")
        return key in self.held.get(node, {})

    def fetch(
        self,
        address: str,
        key: str,
        *,
        start: int = 0,
        end: int | None = None,
        wait_s: float = 0.0,
        spare_only: bool = False,  # every fake peer has room
    ) -> bytes:
        node = self._node(address)
        self.calls.append(("GET", node, key))
        if node in self.dead:
            raise PeerUnavailableError(f"{address}: refused")
        if key not in self.held.get(node, {}):
            raise ChunkNotOnPeerError(f"{address} has no chunk {key}")
        return self.held[node][key]


class Origin:
    def __init__(self, chunks: list[ChunkEntry]) -> None:
        self.by_offset = {c.offset: data(c.index) for c in chunks}
        self.reads: list[int] = []

    def read_range(self, path: str, offset: int, size: int) -> bytes:
        self.reads.append(offset)
        return self.by_offset[offset]


def fetcher_for(
    chunks: list[ChunkEntry],
    client: FakeClient,
    *,
    nodes: list[str] = EARLY,
    policy: FetchPolicy = POLICY,
) -> tuple[ChunkFetcher, Origin, MemorySink]:
    origin, sink = Origin(chunks), MemorySink()
    fetcher = ChunkFetcher(
        node=ME,
        peers=[Peer(n, f"{n}:1") for n in [*nodes, ME]],
        origin=origin,
        sink=sink,
        metrics=DataPlaneMetrics.create(CollectorRegistry()),
        chunks=chunks,
        policy=policy,
        client=client,
    )
    return fetcher, origin, sink


def owned_here(fetcher: ChunkFetcher, chunks: list[ChunkEntry]) -> list[ChunkEntry]:
    return [c for c in chunks if fetcher.owner_of(c.key) == ME]


def as_the_others_see_it(chunks: list[ChunkEntry]) -> dict[str, str]:
    return rendezvous.balanced_owners([c.key for c in chunks], EARLY)


def everything_fetched_by_its_owner(chunks: list[ChunkEntry]) -> dict[str, dict[str, bytes]]:
    """Each early node holds the chunks it owns in the early view (and nothing else)."""
    held: dict[str, dict[str, bytes]] = {n: {} for n in EARLY}
    for c in chunks:
        held[as_the_others_see_it(chunks)[c.key]][c.key] = data(c.index)
    return held


def test_the_probe_asks_the_owner_in_the_view_without_this_node() -> None:
    chunks = make_chunks()
    keys = [c.key for c in chunks]
    owners = as_the_others_see_it(chunks)
    probes = late_probes(keys[3:9], EARLY, keys, 2)
    assert [k for k, _ in probes] == keys[3:5]
    for key, ranking in probes:
        assert ranking[0] == owners[key]  # who fetches it from the origin there
        assert sorted(ranking) == sorted(EARLY)  # the others only, each once
    assert late_probes([], EARLY, keys, 3) == []
    assert late_probes(keys, [], keys, 3) == []


def test_owners_of_a_prefix_are_those_of_the_whole_map() -> None:
    keys = [c.key for c in make_chunks()]
    whole = rendezvous.balanced_owners(keys, EARLY)
    first = rendezvous.balanced_owners(keys, EARLY, first=7)
    assert first == {k: whole[k] for k in keys[:7]}


def test_a_node_starting_with_the_others_is_not_late_and_keeps_its_share() -> None:
    chunks = make_chunks()
    client = FakeClient({})  # nobody has anything yet
    fetcher, _, _ = fetcher_for(chunks, client)
    owned = owned_here(fetcher, chunks)
    assert owned
    assert fetcher.join_late(owned) is False
    assert not fetcher.late
    assert owned_here(fetcher, chunks) == owned  # it still fetches its share from the origin
    # One HEAD per probed chunk (to the node owning it without this one), nothing else.
    assert [m for m, _, _ in client.calls] == ["HEAD"] * POLICY.late_probes
    probes = late_probes([c.key for c in owned], EARLY, [c.key for c in chunks], 3)
    assert [(n, k) for _, n, k in client.calls] == [(r[0], k) for k, r in probes]


def test_a_node_whose_chunk_a_peer_already_holds_takes_the_others_view() -> None:
    chunks = make_chunks()
    client = FakeClient(everything_fetched_by_its_owner(chunks))
    fetcher, _, _ = fetcher_for(chunks, client)
    owned = owned_here(fetcher, chunks)
    assert fetcher.join_late(owned) is True
    assert len(client.calls) == 1  # the first probe answered yes
    others = as_the_others_see_it(chunks)
    for c in chunks:
        assert fetcher.owner_of(c.key) == others[c.key]
        assert ME not in fetcher.ranking(c.key)
    assert owned_here(fetcher, chunks) == []  # it owns nothing now
    assert fetcher.join_late(owned) is True  # decided once; no more probes
    assert len(client.calls) == 1


def test_a_dead_owner_in_the_others_view_is_skipped_for_the_next_node_of_its_ranking() -> None:
    chunks = make_chunks()
    keys = [c.key for c in chunks]
    fetcher, _, _ = fetcher_for(chunks, FakeClient({}))
    first = owned_here(fetcher, chunks)[0]
    ranking = late_probes([first.key], EARLY, keys, 1)[0][1]
    dead, heir = ranking[0], ranking[1]
    client = FakeClient({heir: {first.key: data(first.index)}}, dead={dead})
    fetcher, _, _ = fetcher_for(chunks, client)
    assert fetcher.join_late(owned_here(fetcher, chunks)) is True
    assert [(m, n) for m, n, _ in client.calls] == [("HEAD", dead), ("HEAD", heir)]
    assert dead in fetcher.health.avoided()


def test_a_late_node_takes_its_own_share_from_the_peers_not_the_origin() -> None:
    chunks = make_chunks()
    client = FakeClient(everything_fetched_by_its_owner(chunks))
    fetcher, origin, sink = fetcher_for(chunks, client)
    mine = owned_here(fetcher, chunks)
    assert fetcher.join_late(mine)
    others = as_the_others_see_it(chunks)
    for c in mine:
        assert fetcher.fetch(c) == "peer"
        assert ("GET", others[c.key], c.key) in client.calls
    assert origin.reads == []
    assert all(sink.has(c.key) for c in mine)


def test_a_late_nodes_chunk_falls_through_the_others_ranking_when_its_owner_is_dead() -> None:
    chunks = make_chunks()
    others = as_the_others_see_it(chunks)
    held = everything_fetched_by_its_owner(chunks)
    fetcher, _, _ = fetcher_for(chunks, FakeClient(held))
    chunk = owned_here(fetcher, chunks)[0]
    ranking = rendezvous.rank_with_owner(EARLY, chunk.key, others[chunk.key])
    dead, heir = ranking[0], ranking[1]
    # The dead owner's chunk was fetched again by the next node of its ranking (the
    # others did so on their own); the late node takes it from that one.
    held[heir][chunk.key] = held[dead].pop(chunk.key)
    client = FakeClient(held, dead={dead})
    fetcher, origin, _ = fetcher_for(chunks, client)
    assert fetcher.join_late(owned_here(fetcher, chunks))
    assert fetcher.fetch(chunk) == "peer"
    assert origin.reads == []
    assert ("GET", heir, chunk.key) in client.calls


@pytest.mark.parametrize("dead", [False, True])
def test_a_late_node_goes_to_the_origin_when_no_live_peer_gets_the_chunk(dead: bool) -> None:
    chunks = make_chunks()
    held = everything_fetched_by_its_owner(chunks)
    fetcher, _, _ = fetcher_for(chunks, FakeClient(held))
    chunk = owned_here(fetcher, chunks)[-1]
    probe = owned_here(fetcher, chunks)[0]
    for n in EARLY:  # nobody has it, nor will: after late_wait_s (here 0) the origin
        held[n].pop(chunk.key, None)
    # every peer but the one the probe finds holding a chunk is dead (dead=True)
    holder = next(n for n in EARLY if probe.key in held[n])
    client = FakeClient(held, dead=set(EARLY) - {holder} if dead else set())
    policy = FetchPolicy(
        owner_wait_s=5, poll_interval_s=0, long_poll_s=0, claims=False, late_wait_s=0
    )
    fetcher, origin, sink = fetcher_for(chunks, client, policy=policy)
    assert fetcher.join_late(owned_here(fetcher, chunks))
    assert fetcher.fetch(chunk) == "origin"
    assert origin.reads == [chunk.offset] and sink.has(chunk.key)


def test_a_late_node_waits_for_the_peer_it_granted_its_chunk_to() -> None:
    """The others count a late node as the owner of its chunks in its own view, so a peer
    may claim one from it (its board grants what it has not started). After late_wait_s it
    then waits for that claimant rather than fetch the chunk from the origin too."""
    chunks = make_chunks()
    held = everything_fetched_by_its_owner(chunks)
    probe_fetcher, _, _ = fetcher_for(chunks, FakeClient(held))
    mine = owned_here(probe_fetcher, chunks)
    chunk = mine[-1]
    for n in EARLY:
        held[n].pop(chunk.key, None)  # nobody has it yet: the claimant is fetching it
    policy = FetchPolicy(
        owner_wait_s=5, poll_interval_s=0, long_poll_s=0, claims=False, late_wait_s=0
    )
    client = FakeClient(held)
    fetcher, origin, sink = fetcher_for(chunks, client, policy=policy)
    assert fetcher.join_late(mine)
    claimant = next(n for n in EARLY if n != as_the_others_see_it(chunks)[chunk.key])
    fetcher.claims.open([c.key for c in chunks], [(n, f"{n}:1") for n in EARLY])
    assert fetcher.claims.grant(chunk.key, claimant) == claimant
    asked = []

    def fetch(address: str, key: str, **kw: object) -> bytes:
        asked.append(address)
        if len(asked) == 5:  # the claimant's origin fetch lands a few rounds later
            held[claimant][chunk.key] = data(chunk.index)
        return FakeClient.fetch(client, address, key, **kw)  # type: ignore[arg-type]

    client.fetch = fetch  # type: ignore[method-assign]
    assert fetcher.fetch(chunk) == "peer"
    assert origin.reads == [] and sink.has(chunk.key)
    assert f"{claimant}:1" in asked
    # Once no claim is live, its own chunk is marked started: no claim is granted after.
    other = mine[-2]
    for n in EARLY:
        held[n].pop(other.key, None)
    assert fetcher.fetch(other) == "origin"
    assert fetcher.claims.grant(other.key, claimant) is None


def test_a_late_node_claims_nothing() -> None:
    chunks = make_chunks()
    client = FakeClient(everything_fetched_by_its_owner(chunks))
    fetcher, _, _ = fetcher_for(chunks, client, policy=FetchPolicy())
    assert fetcher.join_late(owned_here(fetcher, chunks))
    calls = len(client.calls)
    fetcher.claim_tails()  # the others do not know it: their boards would refuse (403)
    assert len(client.calls) == calls


def test_no_peers_no_probe() -> None:
    chunks = make_chunks()
    client = FakeClient({})
    fetcher, _, _ = fetcher_for(chunks, client, nodes=[])
    assert fetcher.join_late(owned_here(fetcher, chunks)) is False
    assert client.calls == []
