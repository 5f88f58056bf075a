import dataclasses
import hashlib
import math
import random
import shutil
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, nullcontext
from pathlib import Path
from typing import Any, Literal, NamedTuple

import blake3
import pytest
from prometheus_client import CollectorRegistry

from weightship.data import rendezvous
from weightship.data.chunkstore import Buffer, ChunkStore, InFlight, InsufficientSpaceError
from weightship.data.claims import ClaimBoard
from weightship.data.fetcher import (
    ChunkFetcher,
    FetchCancelledError,
    FetchPolicy,
    Peer,
    PeerHealth,
    TokenBucket,
)
from weightship.data.metrics import DataPlaneMetrics
from weightship.data.modelstaging import ModelStaging
from weightship.data.peer import PeerClient, PeerServer
from weightship.data.schedule import plan_owners
from weightship.data.stage import StageProgress, hold_for_uplink, load_piece_layer, stage
from weightship.weightformat.build import LocalFolder, build_manifest_with_pieces
from weightship.weightformat.chunkhash import ChunkVerificationError
from weightship.weightformat.entries import ChunkEntry
from weightship.weightformat.manifest import Manifest
from weightship.weightformat.paths import is_metadata_path

CHUNK = 16 * 1024
FAST = FetchPolicy(peer_timeout_s=2, owner_wait_s=20, poll_interval_s=0.01)
NO_CLAIMS = FetchPolicy(peer_timeout_s=2, owner_wait_s=20, poll_interval_s=0.01, claims=False)


class CountingOrigin:
    """The local folder as origin, counting reads; ``fail_after`` reads it dies."""

    def __init__(self, folder: Path, fail_after: int | None = None) -> None:
        self.local = LocalFolder(folder)
        self.fail_after = fail_after
        self.reads = 0
        self.bytes = 0
        self.metadata_reads = 0
        self._lock = threading.Lock()

    def read_range(self, path: str, offset: int, size: int) -> bytes:
        if is_metadata_path(path):  # the piece layer: counted apart from the chunks
            self.metadata_reads += 1
            return self.local.read_range(path, offset, size)
        with self._lock:
            if self.fail_after is not None and self.reads >= self.fail_after:
                raise ConnectionError("origin went away")
            self.reads += 1
            self.bytes += size
        return self.local.read_range(path, offset, size)


VERSION: list[Literal[1, 2]] = [2]


@pytest.fixture(autouse=True, params=[1, 2], ids=["v1-sha256", "v2-blake3"])
def manifest_version(request: pytest.FixtureRequest) -> Iterator[int]:
    """Every test here runs on both manifest versions: sha256 chunks, and blake3 chunks
    with a piece layer (pieces of CHUNK // 4)."""
    VERSION[0] = request.param
    yield request.param
    VERSION[0] = 2


def make_model(folder: Path, files: dict[str, bytes]) -> Manifest:
    """The folder is its own origin: for version 2 its piece layer is written into it."""
    folder.mkdir(parents=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    m, pieces = build_manifest_with_pieces(
        LocalFolder(folder), chunk_size=CHUNK, version=VERSION[0], piece_size=CHUNK // 4
    )
    if m.piece_layer_path:
        (folder / m.piece_layer_path).parent.mkdir(exist_ok=True)
        (folder / m.piece_layer_path).write_bytes(pieces)
    return m


def random_bytes(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


def metrics() -> tuple[DataPlaneMetrics, CollectorRegistry]:
    registry = CollectorRegistry()
    return DataPlaneMetrics.create(registry), registry


def same_files(manifest: Manifest, store: ChunkStore, source: Path) -> bool:
    staged = store.files_dir(manifest.digest)
    return all(
        (staged / f.path).read_bytes() == (source / f.path).read_bytes() for f in manifest.files
    )


def test_resume_refetches_no_verified_chunk(tmp_path: Path) -> None:
    src = tmp_path / "src"
    m = make_model(src, {"a.bin": random_bytes(2 * CHUNK, 1), "b.bin": random_bytes(6 * CHUNK, 2)})
    store = ChunkStore(tmp_path / "cache")
    dying = CountingOrigin(src, fail_after=3)
    with pytest.raises(ConnectionError):
        stage(m, store, dying, [], node="n1", metrics=metrics()[0], workers=1)
    assert not store.is_staged(m.digest)
    files = store.files_dir(m.digest)
    assert not (files / "b.bin").exists()  # never visible before all chunks verify

    origin = CountingOrigin(src)
    seen: list[StageProgress] = []
    result = stage(m, store, origin, [], node="n1", metrics=metrics()[0], progress=seen.append)
    assert origin.reads == len(m.chunks) - dying.reads
    assert result.from_local == dying.bytes
    assert result.from_origin == origin.bytes
    assert result.done_bytes == result.total_bytes == m.total_size
    assert seen[-1].done_bytes == m.total_size
    assert store.is_staged(m.digest) and same_files(m, store, src)

    # Staging a staged model again fetches nothing.
    again = CountingOrigin(src)
    assert stage(m, store, again, [], node="n1", metrics=metrics()[0]).from_local == m.total_size
    assert again.reads == 0


def test_chunks_already_on_the_node_are_not_fetched(tmp_path: Path) -> None:
    shared = random_bytes(4 * CHUNK, 3)
    a = make_model(tmp_path / "a", {"w.bin": shared, "cfg": b"a"})
    b = make_model(tmp_path / "b", {"w.bin": shared, "cfg": b"b", "w2.bin": shared[:CHUNK] * 3})
    store = ChunkStore(tmp_path / "cache")
    stage(a, store, CountingOrigin(tmp_path / "a"), [], node="n1", metrics=metrics()[0])

    origin = CountingOrigin(tmp_path / "b")
    result = stage(b, store, origin, [], node="n1", metrics=metrics()[0])
    assert origin.reads == 1  # only "cfg" differs; w2.bin repeats a chunk model a has
    assert result.from_origin == 1
    assert result.from_local == b.total_size - 1
    assert same_files(b, store, tmp_path / "b")


def test_disk_too_small_fails_before_fetching(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    m = make_model(tmp_path / "src", {"w.bin": random_bytes(4 * CHUNK, 4)})
    store = ChunkStore(tmp_path / "cache")
    real = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda _: real._replace(free=3 * CHUNK))
    origin = CountingOrigin(tmp_path / "src")
    with pytest.raises(
        InsufficientSpaceError, match=rf"need {4 * CHUNK} bytes .*{3 * CHUNK} bytes"
    ):
        stage(m, store, origin, [], node="n1", metrics=metrics()[0])
    assert origin.reads == 0
    assert not store.is_staged(m.digest)
    assert not any(store.files_dir(m.digest).iterdir())


def test_lru_eviction_respects_pins(tmp_path: Path) -> None:
    size = 4 * CHUNK
    models = {
        name: make_model(tmp_path / name, {"w.bin": random_bytes(size, seed)})
        for seed, name in enumerate("ABCDE")
    }
    # Each staged model takes size (one copy of its bytes): room for two, not three.
    store = ChunkStore(tmp_path / "cache", capacity_bytes=5 * size // 2)

    def stage_model(name: str, pinned: tuple[str, ...] = ()) -> None:
        stage(
            models[name],
            store,
            CountingOrigin(tmp_path / name),
            [],
            node="n1",
            metrics=metrics()[0],
            pinned=[models[p].digest for p in pinned],
        )

    def staged() -> set[str]:
        return {n for n, m in models.items() if store.is_staged(m.digest)}

    stage_model("A")
    stage_model("B")
    store.touch(models["A"].digest)  # A used last: B is least recently used
    stage_model("C")
    assert staged() == {"A", "C"}
    stage_model("D", pinned=("A",))  # A is the LRU now, but pinned: C goes
    assert staged() == {"A", "D"}
    with pytest.raises(InsufficientSpaceError):
        stage_model("E", pinned=("A", "D"))
    assert staged() == {"A", "D"}  # a failed check evicts nothing


class Canned(NamedTuple):
    address: str
    requests: list[bytes]


@pytest.fixture
def canned_peer() -> Iterator[Callable[[Callable[[bytes], bytes]], Canned]]:
    """Raw TCP peers that answer every request with canned bytes, then close."""
    with ExitStack() as stack:

        def start(respond: Callable[[bytes], bytes]) -> Canned:
            listener = stack.enter_context(socket.create_server(("127.0.0.1", 0)))
            requests: list[bytes] = []

            def serve() -> None:
                while True:
                    try:
                        conn, _ = listener.accept()
                    except OSError:
                        return
                    with conn:
                        request = conn.recv(65536)
                        requests.append(request)
                        conn.sendall(respond(request))

            threading.Thread(target=serve, daemon=True).start()
            return Canned(f"127.0.0.1:{listener.getsockname()[1]}", requests)

        yield start


def corrupt(request: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nbogus"


def truncated(request: bytes) -> bytes:
    return f"HTTP/1.1 200 OK\r\nContent-Length: {CHUNK}\r\n\r\n".encode() + b"x" * 100


def names_ranked(sha: str, first: str, rest: list[str]) -> str:
    """A node name starting with ``first`` that ranks ahead of ``rest``, in that order."""
    for i in range(1000):
        name = f"{first}-{i}"
        if rendezvous.rank([name, *rest], sha) == [name, *rest]:
            return name
    raise AssertionError("no such name")


def two_names_ranked(sha: str, first: str, second: str, last: str) -> tuple[str, str]:
    """Node names starting with ``first`` and ``second`` that rank ahead of ``last``, in
    that order."""
    for i in range(1000):
        for j in range(20):
            names = [f"{first}-{i}", f"{second}-{j}", last]
            if rendezvous.rank(names, sha) == names:
                return names[0], names[1]
    raise AssertionError("no such names")


class MemorySink:
    """A ChunkSink that keeps verified chunks in memory."""

    def __init__(self) -> None:
        self.chunks: dict[str, bytes] = {}

    def has(self, key: str) -> bool:
        return key in self.chunks

    def put(self, key: str, data: Buffer, *, verified_digest: str | None = None) -> int:
        algorithm, _, hex_digest = key.partition(":")
        hasher = hashlib.sha256 if algorithm == "sha256" else blake3.blake3
        if hasher(data).hexdigest() != hex_digest:
            raise ChunkVerificationError(key)
        self.chunks[key] = bytes(data)
        return 1


def put_model(store: ChunkStore, m: Manifest, src: Path) -> None:
    with ModelStaging(store, m) as staging:
        staging.prepare()
        for c in m.chunks:
            staging.put(c.key, LocalFolder(src).read_range(c.file, c.offset, c.size))
        staging.mark_staged()


@pytest.fixture
def good_peer(tmp_path: Path) -> Iterator[tuple[Manifest, Path, str]]:
    src = tmp_path / "src"
    m = make_model(src, {"w.bin": random_bytes(CHUNK, 5)})
    store = ChunkStore(tmp_path / "good")
    put_model(store, m, src)
    with PeerServer(store, "127.0.0.1") as server:
        yield m, src, server.address


@pytest.mark.parametrize("respond", [corrupt, truncated])
def test_bad_peer_is_skipped_and_chunk_fetched_elsewhere(
    tmp_path: Path,
    canned_peer: Callable[[Callable[[bytes], bytes]], Canned],
    good_peer: tuple[Manifest, Path, str],
    respond: Callable[[bytes], bytes],
) -> None:
    m, src, good_address = good_peer
    chunk = m.chunks[0]
    bad = canned_peer(respond)
    # Rank: bad peer first (the owner), then the good peer, then this node.
    ours, good = two_names_ranked(chunk.key, "bad", "good", "me")
    ranking = rendezvous.rank([ours, good, "me"], chunk.key)
    assert ranking == [ours, good, "me"]
    dp, registry = metrics()
    origin = CountingOrigin(src)
    sink = MemorySink()
    fetcher = ChunkFetcher(
        node="me",
        peers=[Peer(ours, bad.address), Peer(good, good_address)],
        origin=origin,
        sink=sink,
        metrics=dp,
        chunks=m.chunks,
        # The owner asked first: no holder, no ring.
        policy=dataclasses.replace(FAST, holder_probes=0, relay_wait_s=None),
    )
    assert fetcher.fetch(chunk) == "peer"
    assert sink.chunks[chunk.key] == (src / "w.bin").read_bytes()
    assert origin.reads == 0
    assert len(bad.requests) == 1
    assert ours in fetcher.health.avoided()

    failures = registry.get_sample_value(
        "weightship_agent_chunk_verification_failures_total", {"source": "peer"}
    )
    demotions = registry.get_sample_value("weightship_agent_peer_demotions_total")
    if respond is corrupt:
        assert (failures, demotions) == (1, 1)
        assert fetcher.health.demotions == {ours: 1}
    else:  # closed mid-transfer: a dead peer, not a liar
        assert (failures or 0, demotions) == (0, 0)

    # The avoided peer is not asked again during its cool-down.
    sink.chunks.clear()
    assert fetcher.fetch(chunk) == "peer"
    assert len(bad.requests) == 1


def test_dead_owner_hands_ownership_to_the_next_node(tmp_path: Path) -> None:
    src = tmp_path / "src"
    m = make_model(src, {"w.bin": random_bytes(CHUNK, 6)})
    chunk = m.chunks[0]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))  # bound, never listening: connection refused
        dead_address = f"127.0.0.1:{s.getsockname()[1]}"
        dead = names_ranked(chunk.key, "dead", ["me"])
        origin = CountingOrigin(src)
        fetcher = ChunkFetcher(
            node="me",
            peers=[Peer(dead, dead_address)],
            origin=origin,
            sink=MemorySink(),
            metrics=metrics()[0],
            policy=FAST,
        )
        assert fetcher.fetch(chunk) == "origin"
    assert origin.reads == 1


def test_three_nodes_fetch_each_chunk_from_origin_once(tmp_path: Path) -> None:
    src = tmp_path / "src"
    files = {f"shard-{i}.bin": random_bytes(5 * CHUNK + i * 999, 10 + i) for i in range(3)}
    files["tokenizer.json"] = b"{}"
    m = make_model(src, files)
    origin = CountingOrigin(src)
    nodes = ["node-a", "node-b", "node-c"]
    stores = {n: ChunkStore(tmp_path / n) for n in nodes}
    dp, registry = metrics()
    with ExitStack() as stack:
        servers = {n: stack.enter_context(PeerServer(stores[n], "127.0.0.1")) for n in nodes}
        peers = [Peer(n, servers[n].address) for n in nodes]
        results = {}

        def run(n: str) -> None:
            results[n] = stage(
                m, stores[n], origin, peers, node=n, metrics=dp, policy=NO_CLAIMS, workers=2
            )

        threads = [threading.Thread(target=run, args=(n,)) for n in nodes]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    assert set(results) == set(nodes)
    owners = rendezvous.balanced_owners([c.key for c in m.chunks], nodes)
    loads = Counter(owners.values())
    assert max(loads.values()) - min(loads.values()) <= 1  # balanced, not per-chunk luck
    assert origin.bytes == m.total_size  # each chunk left the origin exactly once
    assert origin.reads == len(m.chunks)
    for n in nodes:
        r = results[n]
        assert r.from_origin + r.from_peers == m.total_size and r.from_local == 0
        assert stores[n].is_staged(m.digest) and same_files(m, stores[n], src)
        owned = sum(c.size for c in m.chunks if owners[c.key] == n)
        assert r.from_origin == owned
    assert (
        registry.get_sample_value("weightship_agent_chunk_bytes_total", {"source": "peer"})
        == 2 * m.total_size
    )


class NodeOrigin(CountingOrigin):
    """The shared origin as seen from one node (with a slow link when ``delay_s``);
    records which ranges this node read."""

    def __init__(self, shared: CountingOrigin, delay_s: float = 0.0) -> None:
        self.shared, self.delay_s = shared, delay_s
        self.ranges: list[tuple[str, int]] = []

    def read_range(self, path: str, offset: int, size: int) -> bytes:
        if not is_metadata_path(path):
            self.ranges.append((path, offset))
        time.sleep(self.delay_s)
        return self.shared.read_range(path, offset, size)


@pytest.mark.parametrize("told", [True, False])
def test_a_node_joining_late_takes_its_own_chunks_from_nodes_that_have_the_model(
    tmp_path: Path, told: bool
) -> None:
    src = tmp_path / "src"
    m = make_model(src, {f"shard-{i}.bin": random_bytes(4 * CHUNK, 30 + i) for i in range(3)})
    origin = CountingOrigin(src)
    early = ["node-a", "node-b"]
    stores = {n: ChunkStore(tmp_path / n) for n in [*early, "late"]}
    for n in early:
        put_model(stores[n], m, src)
    with ExitStack() as stack:
        servers = {n: stack.enter_context(PeerServer(s, "127.0.0.1")) for n, s in stores.items()}
        peers = [Peer(n, server.address) for n, server in servers.items()]
        r = stage(
            m,
            stores["late"],
            origin,
            peers,
            node="late",
            metrics=metrics()[0],
            policy=FAST,
            holders=early if told else (),
        )
    assert stores["late"].is_staged(m.digest) and same_files(m, stores["late"], src)
    owned = rendezvous.balanced_owners([c.key for c in m.chunks], sorted(stores))
    own_bytes = sum(c.size for c in m.chunks if owned[c.key] == "late")
    assert own_bytes > 0
    # Its own share came from the nodes that had it, nothing from the origin: told, by
    # asking the holders; not told, because its probe found a peer holding a chunk it
    # owns (it joined late: fetcher.join_late), so it took the view without itself.
    assert origin.reads == 0 and r.from_peers == m.total_size


# Only version 2's pieces verify a prefix of a chunk: version 1 has nothing to resume from.
@pytest.mark.parametrize("manifest_version", [2], ids=["v2-blake3"], indirect=True)
def test_a_chunk_verified_to_its_end_but_not_committed_is_committed_without_a_request(
    tmp_path: Path, manifest_version: int
) -> None:
    src = tmp_path / "src"
    m = make_model(src, {"w.bin": random_bytes(2 * CHUNK, 8)})
    chunk = m.chunks[0]
    raw = (src / "w.bin").read_bytes()[: chunk.size]
    store = ChunkStore(tmp_path / "cache")

    class Gone(Exception):
        pass

    def fill_then_die(view: memoryview, begin: int, landed: Callable[[int], None]) -> int:
        view[begin:] = raw[begin:]
        landed(len(view))
        raise Gone  # the source went away while ending its answer

    with ModelStaging(store, m) as staging:
        staging.pieces = load_piece_layer(staging, CountingOrigin(src))
        staging.prepare()
        with pytest.raises(Gone):
            staging.receive(chunk.key, fill_then_die)
        assert staging.resume_point(chunk.key) == chunk.size and not staging.has(chunk.key)

        class NoRequests(PeerClient):
            def open(self, *args: Any, **kwargs: Any) -> Any:
                raise AssertionError("asked a peer for a range from the chunk's end (416)")

        fetcher = ChunkFetcher(
            node="me",
            peers=[Peer(names_ranked(chunk.key, "owner", ["me"]), "127.0.0.1:9")],
            origin=CountingOrigin(src),
            sink=staging,
            metrics=metrics()[0],
            chunks=m.chunks,
            policy=FAST,
            client=NoRequests(),
        )
        assert fetcher.fetch(chunk) == "peer"
        assert staging.has(chunk.key)


def test_a_slow_owners_chunks_are_claimed_and_still_leave_the_origin_once(
    tmp_path: Path,
) -> None:
    src = tmp_path / "src"
    m = make_model(src, {f"shard-{i}.bin": random_bytes(4 * CHUNK, 20 + i) for i in range(3)})
    origin = CountingOrigin(src)
    nodes = ["node-a", "node-b", "node-c"]
    owners = rendezvous.balanced_owners([c.key for c in m.chunks], nodes)
    slow_owned = {(c.file, c.offset) for c in m.chunks if owners[c.key] == "node-a"}
    # node-a's own queue takes len(slow_owned) * 0.5 s; the others are fast.
    origins = {n: NodeOrigin(origin, delay_s=0.5 if n == "node-a" else 0.0) for n in nodes}
    stores = {n: ChunkStore(tmp_path / n) for n in nodes}
    registries = {n: metrics() for n in nodes}
    policy = FetchPolicy(peer_timeout_s=5, owner_wait_s=30, poll_interval_s=0.01, long_poll_s=0.2)
    with ExitStack() as stack:
        servers = {n: stack.enter_context(PeerServer(stores[n], "127.0.0.1")) for n in nodes}
        peers = [Peer(n, servers[n].address) for n in nodes]
        results = {}

        def run(n: str) -> None:
            results[n] = stage(
                m,
                stores[n],
                origins[n],
                peers,
                node=n,
                metrics=registries[n][0],
                policy=policy,
                workers=2,
            )

        threads = [threading.Thread(target=run, args=(n,)) for n in nodes]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    assert set(results) == set(nodes)
    claimed = {
        n: registries[n][1].get_sample_value("weightship_agent_chunks_claimed_total") or 0
        for n in nodes
    }
    # Every chunk left the origin exactly once, claimed or not.
    assert origin.reads == len(m.chunks) and origin.bytes == m.total_size
    # Some of the slow owner's chunks were claimed and fetched by the others; it fetched
    # the rest of its own queue and nothing else. (A fast node may also claim from
    # another fast one whose chunks it has not received yet: claims only ever move a
    # chunk's one origin fetch.)
    taken = slow_owned - set(origins["node-a"].ranges)
    assert claimed["node-a"] == 0 and taken
    assert set(origins["node-a"].ranges) == slow_owned - taken
    assert claimed["node-b"] + claimed["node-c"] >= len(taken)
    for n in nodes:
        assert stores[n].is_staged(m.digest) and same_files(m, stores[n], src)
        assert results[n].from_origin + results[n].from_peers == m.total_size


def test_a_claimant_refuses_other_claims_on_the_chunk_it_took(tmp_path: Path) -> None:
    src = tmp_path / "src"
    m = make_model(src, {"w.bin": random_bytes(8 * CHUNK, 8)})
    owner_store, claimant_store = ChunkStore(tmp_path / "owner"), ChunkStore(tmp_path / "claimant")
    origin = CountingOrigin(src)
    with (
        PeerServer(owner_store, "127.0.0.1") as owner_server,
        PeerServer(claimant_store, "127.0.0.1") as claimant_server,
    ):
        fetcher = ChunkFetcher(
            node="claimant",
            peers=[Peer("owner", owner_server.address), Peer("claimant", claimant_server.address)],
            origin=origin,
            sink=MemorySink(),
            metrics=metrics()[0],
            chunks=m.chunks,
            policy=FAST,
            claims=claimant_store.claims,
        )
        queue = [c.key for c in m.chunks if fetcher.owner_of(c.key) == "owner"]
        # The owner stages the model with the claimant among its peers (stage() does this).
        owner_store.claims.open(queue, [("claimant", claimant_server.address)])
        claimant_store.claims.open(queue, [("third", "127.0.0.1:1")])
        fetcher.claim_tails()  # its own origin queue is done (the origin lane runs it then)
        claimed = queue[1]  # the owner started none: each claimed, fetched here
        assert owner_store.claims.start(claimed) == "claimant"
        # A third node asking the claimant for the same chunk is refused: it leaves the
        # origin once.
        client = PeerClient(timeout_s=2)
        assert client.claim(claimant_server.address, claimed, "third") == (False, None)
    assert origin.reads == len(queue)


def test_claim_tails_claims_a_slow_owners_next_chunks_in_order(tmp_path: Path) -> None:
    src = tmp_path / "src"
    m = make_model(src, {"w.bin": random_bytes(8 * CHUNK, 9)})
    owner_store, claimant_store = ChunkStore(tmp_path / "owner"), ChunkStore(tmp_path / "claimant")
    origin, sink = CountingOrigin(src), MemorySink()
    with (
        PeerServer(owner_store, "127.0.0.1") as owner_server,
        PeerServer(claimant_store, "127.0.0.1") as claimant_server,
    ):
        fetcher = ChunkFetcher(
            node="claimant",
            peers=[Peer("owner", owner_server.address), Peer("claimant", claimant_server.address)],
            origin=origin,
            sink=sink,
            metrics=metrics()[0],
            chunks=m.chunks,
            policy=FAST,
            claims=claimant_store.claims,
        )
        queue = [c.key for c in m.chunks if fetcher.owner_of(c.key) == "owner"]
        assert len(queue) == 4
        owner_store.claims.open(queue, [("claimant", claimant_server.address)])
        owner_store.claims.start(queue[0])  # the owner is fetching its first chunk
        fetcher.claim_tails()
    # The chunks after the one it fetches were claimed and fetched here, in the order
    # the fleet asks the owner for them, then the one it fetches was refused (started).
    assert list(sink.chunks) == queue[1:]
    assert origin.reads == 3
    granted = [owner_store.claims.claimant(sha) for sha in queue]
    assert granted == [None, "claimant", "claimant", "claimant"]


def test_owner_of_is_the_head_of_the_ranking(tmp_path: Path) -> None:
    m = make_model(tmp_path / "src", {"w.bin": random_bytes(9 * CHUNK, 11)})
    claims = ClaimBoard()
    fetcher = ChunkFetcher(
        node="n1",
        peers=[Peer(n, f"127.0.0.1:{i}") for i, n in enumerate(["n1", "n2", "n3"], 1)],
        origin=CountingOrigin(tmp_path / "src"),
        sink=MemorySink(),
        metrics=metrics()[0],
        chunks=m.chunks,
        claims=claims,
    )
    # Two chunks n3 does not own, so that owning them is the grant's doing.
    first, second = [c.key for c in m.chunks if fetcher.owners[c.key] != "n3"][:2]
    claims.open([c.key for c in m.chunks], [("n3", "127.0.0.1:3")])
    claims.grant(first, "n3")  # given away to a known peer
    claims.grant(second, "stranger")  # to a node this one was not told of
    for c in m.chunks:
        assert fetcher.owner_of(c.key) == fetcher.ranking(c.key)[0]
    assert fetcher.owner_of(first) == "n3"


def test_file_digests_match_the_manifest(tmp_path: Path) -> None:
    m = make_model(tmp_path / "src", {"w.bin": random_bytes(3 * CHUNK + 7, 7)})
    store = ChunkStore(tmp_path / "cache")
    result = stage(m, store, CountingOrigin(tmp_path / "src"), [], node="n1", metrics=metrics()[0])
    data = (result.path / "w.bin").read_bytes()
    assert hashlib.sha256(data).hexdigest() == m.files[0].sha256


def test_token_bucket_caps_the_average_rate() -> None:
    now = [0.0]
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    bucket = TokenBucket(1000, burst_bytes=500, clock=lambda: now[0], sleep=sleep)
    bucket.consume(500)  # the burst passes at once
    assert slept == []
    for _ in range(4):
        bucket.consume(1000)
    assert now[0] == pytest.approx(4.0)  # 4000 bytes past the burst at 1000 B/s


def test_origin_that_changed_since_the_manifest_fails_clearly(tmp_path: Path) -> None:
    m = make_model(tmp_path / "src", {"w.bin": random_bytes(CHUNK, 8)})
    (tmp_path / "src" / "w.bin").write_bytes(random_bytes(CHUNK, 9))  # weights replaced
    store = ChunkStore(tmp_path / "cache")
    dp, registry = metrics()
    with pytest.raises(ChunkVerificationError, match="re-run `weightship manifest`"):
        stage(m, store, CountingOrigin(tmp_path / "src"), [], node="n1", metrics=dp, workers=1)
    assert not store.is_staged(m.digest)
    assert not store.has_chunk(m.chunks[0].key)
    failures = registry.get_sample_value(
        "weightship_agent_chunk_verification_failures_total", {"source": "origin"}
    )
    assert failures == FetchPolicy().origin_attempts


def test_cancel_stops_a_fetch_waiting_on_an_owner_that_never_gets_the_chunk(
    tmp_path: Path,
) -> None:
    src = tmp_path / "src"
    m = make_model(src, {"w.bin": random_bytes(CHUNK, 9)})
    chunk = m.chunks[0]
    owner = names_ranked(chunk.key, "owner", ["me"])
    empty = ChunkStore(tmp_path / "empty")  # the owner is alive but never gets the chunk
    empty.claims.open([chunk.key], [])  # which its stage fetches (stage() opens this)
    cancel = threading.Event()
    dp, _ = metrics()
    origin = CountingOrigin(src)
    asked = threading.Event()  # the owner holds a request for the chunk
    for name in ("wait", "wait_any"):
        held = getattr(empty.index, name)

        def spied(key: str, timeout_s: float, held: Any = held) -> Any:
            asked.set()
            return held(key, timeout_s)

        setattr(empty.index, name, spied)
    with PeerServer(empty, "127.0.0.1") as server:
        fetcher = ChunkFetcher(
            node="me",
            peers=[Peer(owner, server.address)],
            origin=origin,
            sink=MemorySink(),
            metrics=dp,
            chunks=m.chunks,
            # An hour: a cancel that waited it out would hang the test, not pass it.
            policy=FetchPolicy(owner_wait_s=3600, long_poll_s=0.2, poll_interval_s=0.01),
            cancel=cancel,
        )
        raised: list[BaseException] = []

        def fetch() -> None:
            try:
                fetcher.fetch(chunk)
            except BaseException as e:
                raised.append(e)

        waiting = threading.Thread(target=fetch)
        waiting.start()
        assert asked.wait(10), "the fetcher never asked the owner"
        cancel.set()  # while it waits on the owner
        waiting.join(60)
        assert not waiting.is_alive(), "cancel must not wait out owner_wait_s"
    assert [type(e) for e in raised] == [FetchCancelledError]
    assert origin.reads == 0


@pytest.mark.parametrize("manifest_version", [2], ids=["no-model"], indirect=True)
def test_hold_for_uplink_waits_while_whole_chunks_go_up_and_no_longer(
    manifest_version: int,
) -> None:
    """hold_for_uplink: at once below the limit or when cancelled; else until the count
    drops, max_s at most."""

    def held(uploads: InFlight, cancel: threading.Event, max_s: float) -> float:
        """Seconds it held its caller (inf: still holding after 5 s, so a regression
        fails here rather than hanging)."""
        started = time.monotonic()
        kwargs = {"max_s": max_s, "limit": 2}
        holding = threading.Thread(
            target=hold_for_uplink, args=(uploads, cancel), kwargs=kwargs, daemon=True
        )
        holding.start()
        holding.join(5)
        return math.inf if holding.is_alive() else time.monotonic() - started

    uploads, cancel = InFlight(), threading.Event()
    with uploads:
        assert held(uploads, cancel, 30) < 1  # one going up: below the limit
        with uploads:
            assert 0.3 <= held(uploads, cancel, 0.3) < 1.3  # still two: max_s, then on
            threading.Timer(0.2, uploads.__exit__).start()  # one ends meanwhile
            assert 0.2 <= held(uploads, cancel, 30) < 3
            uploads.__enter__()  # two again
            cancel.set()
            assert held(uploads, cancel, 30) < 1


def spy_lookups(
    monkeypatch: pytest.MonkeyPatch, store: ChunkStore, node: str, seen: list[tuple[str, float]]
) -> None:
    """Note (node, seconds it may wait) whenever ``store``'s peer server looks a chunk up:
    ``wait_any`` for a stream (cut-through) request, ``open_chunk`` for any other."""
    wait_any, open_chunk = store.index.wait_any, store.open_chunk

    def spied_wait_any(key: str, timeout_s: float) -> Any:
        seen.append((node, timeout_s))
        return wait_any(key, timeout_s)

    def spied_open_chunk(key: str, wait_s: float = 0.0) -> Any:
        seen.append((node, wait_s))
        return open_chunk(key, wait_s)

    monkeypatch.setattr(store.index, "wait_any", spied_wait_any)
    monkeypatch.setattr(store, "open_chunk", spied_open_chunk)


def test_an_asker_sent_to_the_claimant_long_polls_it_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The owner let a peer claim the chunk (404 naming it): from the next round on, the
    claimant is asked first, with the long poll, and the chunk comes from it."""
    src = tmp_path / "src"
    m = make_model(src, {"w.bin": random_bytes(CHUNK, 12)})
    chunk = m.chunks[0]
    owner, claimant = two_names_ranked(chunk.key, "owner", "claimant", "me")
    owner_store, claimant_store = ChunkStore(tmp_path / "owner"), ChunkStore(tmp_path / "claimant")
    put_model(claimant_store, m, src)
    seen: list[tuple[str, float]] = []
    spy_lookups(monkeypatch, claimant_store, claimant, seen)
    origin = CountingOrigin(src)
    with (
        PeerServer(owner_store, "127.0.0.1") as owner_server,
        PeerServer(claimant_store, "127.0.0.1") as claimant_server,
        ModelStaging(ChunkStore(tmp_path / "me"), m) as staging,
    ):
        owner_store.claims.open([chunk.key], [(claimant, claimant_server.address)])
        assert owner_store.claims.grant(chunk.key, claimant) == claimant
        staging.prepare()
        fetcher = ChunkFetcher(
            node="me",
            peers=[Peer(owner, owner_server.address), Peer(claimant, claimant_server.address)],
            origin=origin,
            sink=staging,
            metrics=metrics()[0],
            chunks=m.chunks,
            # Only the owner asked in a round, and no holder or ring node before it: the
            # claimant is asked only because the owner named it.
            policy=dataclasses.replace(
                NO_CLAIMS,
                owner_wait_s=5,
                long_poll_s=0.5,
                peers_per_round=1,
                holder_probes=0,
                relay_wait_s=None,
            ),
        )
        assert fetcher.fetch(chunk) == "peer"
        assert staging.has(chunk.key)
    assert origin.reads == 0
    assert seen == [(claimant, 0.5)]  # asked once, first in its round: the long poll


@pytest.mark.parametrize(
    ("probes", "busy", "behind"),
    [(2, False, True), (2, True, True), (2, False, False), (0, False, True)],
    ids=["probed", "busy", "caught-up", "no-probes"],
)
def test_a_holder_is_asked_for_the_chunk_whole_before_a_slow_owner(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, probes: int, busy: bool, behind: bool
) -> None:
    """holder_probes: when this node is behind on the owner (its last chunk from it came
    whole), a peer holding the chunk whole is asked before the owner (which never gets
    it), spare uplink only, so nothing waits on the owner; a holder whose uplink is busy,
    a node that kept up with the owner (its chunks stream as they land: nobody holds the
    next one whole yet), or holder_probes=0, and the owner is asked first."""
    src = tmp_path / "src"
    m = make_model(src, {"w.bin": random_bytes(CHUNK, 13)})
    chunk = m.chunks[0]
    owner, holder = two_names_ranked(chunk.key, "owner", "holder", "me")
    owner_store, holder_store = ChunkStore(tmp_path / "owner"), ChunkStore(tmp_path / "holder")
    put_model(holder_store, m, src)
    owner_store.claims.open([chunk.key], [])  # the owner's stage fetches it (stage() opens)
    seen: list[tuple[str, float]] = []
    spy_lookups(monkeypatch, owner_store, owner, seen)
    spy_lookups(monkeypatch, holder_store, holder, seen)
    origin = CountingOrigin(src)
    with (
        PeerServer(owner_store, "127.0.0.1") as owner_server,
        PeerServer(holder_store, "127.0.0.1") as holder_server,
        ModelStaging(ChunkStore(tmp_path / "me"), m) as staging,
        holder_store.uploads if busy else nullcontext(),  # a whole chunk going up there
    ):
        staging.prepare()
        fetcher = ChunkFetcher(
            node="me",
            peers=[Peer(owner, owner_server.address), Peer(holder, holder_server.address)],
            origin=origin,
            sink=staging,
            metrics=metrics()[0],
            chunks=m.chunks,
            policy=dataclasses.replace(
                NO_CLAIMS, long_poll_s=0.5, holder_probes=probes, relay_wait_s=None
            ),
        )
        assert fetcher.owner_of(chunk.key) == owner
        fetcher.behind_on[owner] = behind  # as after a chunk from it whole, or streamed
        started = time.monotonic()
        assert fetcher.fetch(chunk) == "peer"
        took = time.monotonic() - started
        assert staging.has(chunk.key)
    assert origin.reads == 0
    if probes and behind and not busy:
        assert seen == [(holder, 0.0)]  # the holder alone, at once: the owner never asked
    else:  # the owner held the request first, then the holder sent the chunk
        refused = [(holder, 0.0)] if busy else []  # the probe: 503, its uplink is busy
        assert seen == [*refused, (owner, 0.5), (holder, 0.0)]
        assert took >= 0.45


class AskedClient(PeerClient):
    """A real peer client that also records which peer each fetch asked, in order."""

    def __init__(self, names: dict[str, str]) -> None:
        super().__init__(timeout_s=5)
        self.names = names  # address -> node
        self.asked: list[str] = []

    def fetch(self, address: str, key: str, **kwargs: Any) -> bytes:
        self.asked.append(self.names[address])
        return super().fetch(address, key, **kwargs)

    def open(self, address: str, key: str, **kwargs: Any) -> Any:  # a stream
        self.asked.append(self.names[address])
        return super().open(address, key, **kwargs)


def ring_of_three(
    tmp_path: Path,
    stack: ExitStack,
    holders: list[str],
    policy: FetchPolicy,
    *,
    staged: bool = False,
    dataplane: DataPlaneMetrics | None = None,
    serving: tuple[str, ...] = ("n1", "n2"),
    node: str = "n3",
) -> tuple[ChunkFetcher, AskedClient, Manifest]:
    """``node`` (n3) fetching, ``serving`` (n1 and n2) serving (n2 is the node before n3
    in the ring); the nodes in ``holders`` hold the whole model. ``staged``: the fetching
    node stages into its own store, pieces verified as they land (as ``stage()`` sets it
    up), not into memory."""
    src = tmp_path / "src"
    m = make_model(src, {"w.bin": random_bytes(9 * CHUNK, 31)})
    addresses = {}
    for n in serving:
        store = ChunkStore(tmp_path / n)
        if n in holders:
            put_model(store, m, src)
        addresses[n] = stack.enter_context(PeerServer(store, "127.0.0.1")).address
    client = AskedClient({a: n for n, a in addresses.items()})
    sink: MemorySink | ModelStaging = MemorySink()
    if staged:
        sink = stack.enter_context(ModelStaging(ChunkStore(tmp_path / node), m))
        sink.prepare()
        sink.pieces = load_piece_layer(sink, CountingOrigin(src))
    fetcher = ChunkFetcher(
        node=node,
        peers=[Peer(node, "127.0.0.1:1"), *(Peer(n, a) for n, a in addresses.items())],
        origin=CountingOrigin(src),
        sink=sink,
        metrics=dataplane or metrics()[0],
        chunks=m.chunks,
        policy=policy,
        client=client,
    )
    return fetcher, client, m


def owned_by(fetcher: ChunkFetcher, m: Manifest, node: str) -> ChunkEntry:
    return next(c for c in m.chunks if fetcher.owner_of(c.key) == node)


def test_a_chunk_is_asked_of_the_node_before_this_one_first(tmp_path: Path) -> None:
    policy = dataclasses.replace(FAST, long_poll_s=2.0, relay_wait_s=2.0, relay_fanout=1)
    with ExitStack() as stack:
        fetcher, client, m = ring_of_three(tmp_path, stack, ["n2"], policy)
        chunk = owned_by(fetcher, m, "n1")  # its owner (n1) does not have it yet
        assert fetcher.fetch(chunk) == "peer"
    assert client.asked == ["n2"]  # the node before n3; the owner is never asked


@pytest.mark.parametrize(
    ("node", "serving", "holder", "asked"),
    [
        # Fanout 2 over n1..n4, n1's tree: n4 sits at position 3 and takes from n2 (the
        # ring would have it ask n3, which does not have the chunk).
        ("n4", ("n1", "n2", "n3"), "n2", ["n2"]),
        # n3 sits at position 2: the owner's child asks the owner first.
        ("n3", ("n1", "n2", "n4"), "n1", ["n1"]),
    ],
)
def test_a_chunk_is_asked_of_the_parent_in_its_owners_tree_first(
    tmp_path: Path, node: str, serving: tuple[str, ...], holder: str, asked: list[str]
) -> None:
    policy = dataclasses.replace(FAST, long_poll_s=2.0, relay_wait_s=2.0, relay_fanout=2)
    with ExitStack() as stack:
        fetcher, client, m = ring_of_three(
            tmp_path, stack, [holder], policy, serving=serving, node=node
        )
        assert fetcher.fetch(owned_by(fetcher, m, "n1")) == "peer"
    assert client.asked == asked


def test_the_owner_is_asked_when_the_node_before_does_not_get_the_chunk(
    tmp_path: Path,
) -> None:
    policy = dataclasses.replace(FAST, long_poll_s=2.0, relay_wait_s=0.1, relay_fanout=1)
    with ExitStack() as stack:
        fetcher, client, m = ring_of_three(tmp_path, stack, ["n1"], policy)
        chunk = owned_by(fetcher, m, "n1")
        assert fetcher.fetch(chunk) == "peer"
    assert client.asked == ["n2", "n1"]  # n2 held it relay_wait_s, then the owner


def test_the_node_before_that_owns_the_chunk_is_asked_once(tmp_path: Path) -> None:
    policy = dataclasses.replace(FAST, long_poll_s=2.0, relay_wait_s=2.0, relay_fanout=1)
    with ExitStack() as stack:
        fetcher, client, m = ring_of_three(tmp_path, stack, ["n2"], policy)
        assert fetcher.fetch(owned_by(fetcher, m, "n2")) == "peer"
    assert client.asked == ["n2"]


def test_without_a_ring_the_owner_is_asked_first(tmp_path: Path) -> None:
    policy = dataclasses.replace(FAST, long_poll_s=0.1, relay_wait_s=None)
    with ExitStack() as stack:
        fetcher, client, m = ring_of_three(tmp_path, stack, ["n2"], policy)
        assert fetcher.fetch(owned_by(fetcher, m, "n1")) == "peer"
    assert client.asked[:2] == ["n1", "n2"]


def test_a_dead_node_before_drops_out_of_the_ring(tmp_path: Path) -> None:
    policy = dataclasses.replace(FAST, long_poll_s=2.0, relay_wait_s=2.0, relay_fanout=1)
    with ExitStack() as stack:
        fetcher, client, m = ring_of_three(tmp_path, stack, ["n1"], policy)
        dead = socket.socket()
        dead.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
        stack.callback(dead.close)
        fetcher.address["n2"] = f"127.0.0.1:{dead.getsockname()[1]}"
        client.names[fetcher.address["n2"]] = "n2"
        first, second = [c for c in m.chunks if fetcher.owner_of(c.key) == "n1"][:2]
        assert fetcher.fetch(first) == "peer"
        assert fetcher.fetch(second) == "peer"
    # n2 refused the connection: avoided from then on, so n1, now the node before n3
    # and the chunks' owner, is asked next, and for the next chunk at once.
    assert client.asked == ["n2", "n1", "n1"]
    assert "n2" in fetcher.health.avoided()


def test_a_dead_relay_is_skipped_for_its_parent_at_once_not_for_the_root(
    tmp_path: Path,
) -> None:
    policy = dataclasses.replace(FAST, long_poll_s=2.0, relay_wait_s=2.0, relay_fanout=2)
    serving = tuple(f"n{i:02d}" for i in range(1, 16))
    with ExitStack() as stack:  # where n16 sits: a chunk it is 3 hops below the root of
        fetcher, _, m = ring_of_three(
            tmp_path / "a", stack, [], policy, serving=serving, node="n16"
        )
        for chunk in m.chunks:
            root = fetcher.owner_of(chunk.key)
            parent = fetcher.relay_source(chunk.key, root, ())
            grandparent = fetcher.relay_source(chunk.key, root, {parent} if parent else ())
            if grandparent is not None:
                break
        assert parent and grandparent, "no chunk puts n16 three hops down"
    with ExitStack() as stack:  # the parent dead, the grandparent holding the chunk
        fetcher, client, m = ring_of_three(
            tmp_path / "b", stack, [grandparent], policy, serving=serving, node="n16"
        )
        dead = socket.socket()
        dead.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
        stack.callback(dead.close)
        fetcher.address[parent] = f"127.0.0.1:{dead.getsockname()[1]}"
        client.names[fetcher.address[parent]] = parent
        assert fetcher.fetch(chunk) == "peer"
    # Not the root (which does not have it and would hold the request): the children of
    # a node killed mid-stage go on down its tree.
    assert client.asked == [parent, grandparent]


@pytest.mark.parametrize("fanout", [1, 2])
def test_a_claimed_chunk_reaches_every_node_without_a_cycle_of_relays(fanout: int) -> None:
    """Whom each node asks first for a chunk its owner granted to a claimant, each in its
    own view (only the owner knows of the grant), leads every node to the claimant: no
    node waits on a node that waits on it (a cycle held the fleet benchmark's whole tree
    for ``relay_wait_s`` at the end of the stage)."""
    names = [f"n{i}" for i in range(1, 9)]
    peers = [Peer(n, f"127.0.0.{i}:7000") for i, n in enumerate(names, start=1)]
    chunks = [
        ChunkEntry(file="m", index=i, offset=i * CHUNK, size=CHUNK, blake3=f"{i:064x}")
        for i in range(12)
    ]
    policy = dataclasses.replace(FetchPolicy(), relay_fanout=fanout)
    fetchers = {
        n: ChunkFetcher(
            node=n,
            peers=peers,
            origin=CountingOrigin(Path("/nonexistent")),
            sink=MemorySink(),
            metrics=metrics()[0],
            chunks=chunks,
            policy=policy,
        )
        for n in names
    }
    for chunk in chunks:
        owner = fetchers["n1"].owner_of(chunk.key)
        for claimant in (n for n in names if n != owner):
            board = ClaimBoard()
            board.open([chunk.key], [(p.node, p.address) for p in peers])
            assert board.grant(chunk.key, claimant) == claimant
            fetchers[owner].claims = board
            for first in names:
                asked, node = [first], first
                while node != claimant:
                    fetcher = fetchers[node]
                    root = fetcher.live_ranking(chunk.key, (), 1)[0]
                    node = fetcher.relay_source(chunk.key, root, ()) or root
                    assert node not in asked, f"chunk {chunk.index} claimed by {claimant}: {asked}"
                    asked.append(node)


def test_a_peer_that_refused_twice_is_dropped_for_the_rest_of_the_stage() -> None:
    now = [0.0]
    health = PeerHealth(clock=lambda: now[0])
    health.mark_dead("n2", 30.0, refused=True)
    health.mark_dead("n2", 30.0, refused=True)  # another worker, the same death
    assert health.avoided() == {"n2"}
    now[0] = 31.0
    assert health.avoided() == set()  # asked again once: it may have restarted
    health.mark_dead("n2", 30.0, refused=True)
    now[0] = 10_000.0
    assert health.avoided() == {"n2"}
    assert health.deaths == {"n2": 2}


def test_a_peer_that_only_timed_out_is_asked_again_after_each_cooldown() -> None:
    now = [0.0]
    health = PeerHealth(clock=lambda: now[0])
    for _ in range(5):
        health.mark_dead("n3", 30.0)  # a busy peer, a slow relay: no proof of death
        assert health.avoided() == {"n3"}
        now[0] += 31.0
        assert health.avoided() == set()


def test_a_peer_found_dead_is_told_from_one_demoted_for_bad_bytes() -> None:
    """A round of asks ends when its root is found dead (schedule.round_goes_on), and goes
    on past a root demoted for bad bytes, which is alive."""
    now = [0.0]
    health = PeerHealth(clock=lambda: now[0])
    health.mark_dead("gone", 30.0)
    health.demote("liar", 600.0)
    assert health.avoided() == {"gone", "liar"}
    assert health.dead() == {"gone"}
    health.demote("gone", 600.0)  # it came back, and sent bad bytes
    assert health.dead() == set()
    health.mark_dead("cut", 30.0)
    now[0] = 31.0
    assert health.dead() == set()  # its cooldown is over: alive again until found dead
    assert health.avoided() == {"gone", "liar"}


class TricklingProxy:
    """A TCP proxy in front of a peer whose answers trickle (a degraded uplink): requests
    pass at once, answers at ``rate`` bytes per second; counts the bytes it sent back."""

    def __init__(self, upstream: str, rate: int) -> None:
        host, port = upstream.rsplit(":", 1)
        self.upstream = (host, int(port))
        self.step_s = 256 / rate
        self.sent = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._open: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            server = socket.create_connection(self.upstream)
            self._open += [client, server]
            threading.Thread(target=self._pipe, args=(client, server), daemon=True).start()
            threading.Thread(target=self._trickle, args=(server, client), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, dest: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                dest.sendall(data)
        except OSError:
            pass

    def _trickle(self, source: socket.socket, dest: socket.socket) -> None:
        try:
            while data := source.recv(256):
                dest.sendall(data)
                self.sent += len(data)
                time.sleep(self.step_s)
        except OSError:
            pass
        finally:
            dest.close()

    def close(self) -> None:
        self._listener.close()
        for s in self._open:
            s.close()


def test_a_trickling_node_before_in_the_ring_gets_help_not_waited_on(
    tmp_path: Path, manifest_version: int
) -> None:
    """The node before this one in the ring holds the chunk but sends it at 8 KiB/s (a
    16 KiB chunk: 2 s). With pieces (version 2) the transfer is split once it runs late
    (the client reports bytes as they come, not per 256 KiB read): its last part comes
    from the other holder, the trickle is cut at a piece boundary, and the bytes verify.
    With sha256 chunks (version 1) nothing can be split: the trickle is waited out, and
    the chunk still verifies."""
    dataplane, registry = metrics()
    policy = dataclasses.replace(
        FAST, long_poll_s=2.0, relay_wait_s=2.0, relay_fanout=1, split_after_s=0.3, split_eta_s=0.5
    )
    with ExitStack() as stack:
        fetcher, client, m = ring_of_three(
            tmp_path, stack, ["n1", "n2"], policy, staged=True, dataplane=dataplane
        )
        trickle = TricklingProxy(fetcher.address["n2"], rate=8 * 1024)
        stack.callback(trickle.close)
        fetcher.address["n2"] = trickle.address
        client.names[trickle.address] = "n2"
        chunk = owned_by(fetcher, m, "n1")
        assert fetcher.fetch(chunk) == "peer"
        assert fetcher.sink.has(chunk.key)
    origin = fetcher.origin
    assert isinstance(origin, CountingOrigin)
    used = registry.get_sample_value("weightship_agent_chunk_splits_total", {"outcome": "used"})
    assert origin.reads == 0
    if manifest_version == 2:
        assert client.asked == ["n2", "n1"]  # the node before, then the rest of the other
        assert used == 1
        assert trickle.sent < CHUNK  # cut at a piece boundary, before its end
    else:
        assert client.asked == ["n2"]
        assert used is None
        assert trickle.sent > CHUNK  # the whole chunk, and its headers


class TimedOrigin(CountingOrigin):
    """Says its last read took ``timing`` (first byte s, rest s); counts renewals."""

    def __init__(self, folder: Path, timing: tuple[float, float]) -> None:
        super().__init__(folder)
        self.timing = timing
        self.renewals = 0

    def last_read(self) -> tuple[float, float] | None:
        return self.timing if self.reads else None

    def renew_connection(self) -> None:
        self.renewals += 1


@pytest.mark.parametrize(
    ("timing", "policy", "renewals"),
    [
        ((0.01, 0.10), FAST, 1),  # the transfer took 10 round trips: a new flow costs little
        ((0.01, 0.09), FAST, 0),  # a long, fast path: slow start would cost too much
        ((0.01, 0.10), dataclasses.replace(FAST, renew_origin_connections=False), 0),
    ],
)
def test_with_peers_an_origin_chunk_leaves_its_connection_closed(
    tmp_path: Path, timing: tuple[float, float], policy: FetchPolicy, renewals: int
) -> None:
    with ExitStack() as stack:
        fetcher, _, m = ring_of_three(tmp_path, stack, [], policy)
        origin = fetcher.origin = TimedOrigin(tmp_path / "src", timing)
        assert fetcher.fetch(owned_by(fetcher, m, "n3")) == "origin"
    assert origin.renewals == renewals
    assert fetcher.metrics.origin_renewals._value.get() == renewals


def test_alone_the_origin_connection_is_kept(tmp_path: Path) -> None:
    src = tmp_path / "src"
    m = make_model(src, {"w.bin": random_bytes(3 * CHUNK, 32)})
    origin = TimedOrigin(src, (0.01, 1.0))
    fetcher = ChunkFetcher(
        node="n1",
        peers=[],
        origin=origin,
        sink=MemorySink(),
        metrics=metrics()[0],
        chunks=m.chunks,
        policy=FAST,
    )
    assert all(fetcher.fetch(c) == "origin" for c in m.chunks)
    assert origin.renewals == 0


class FirstByteOrigin(CountingOrigin):
    """Says each read waited ``timing[0]`` for its first byte and took ``timing[1]`` after
    it; each read takes ``read_s``, and the most reads at once are counted."""

    def __init__(self, folder: Path, timing: tuple[float, float], read_s: float) -> None:
        super().__init__(folder)
        self.timing, self.read_s = timing, read_s
        self.now = self.most = 0
        self._at_once = threading.Lock()

    def read_range(self, path: str, offset: int, size: int) -> bytes:
        if is_metadata_path(path):
            return super().read_range(path, offset, size)
        with self._at_once:
            self.now += 1
            self.most = max(self.most, self.now)
        try:
            time.sleep(self.read_s)
            return super().read_range(path, offset, size)
        finally:
            with self._at_once:
                self.now -= 1

    def last_read(self) -> tuple[float, float] | None:
        return self.timing if self.reads else None

    def renew_connection(self) -> None:
        pass


@pytest.mark.parametrize("manifest_version", [2], ids=["v2-blake3"], indirect=True)
@pytest.mark.parametrize(
    ("timing", "most"),
    [((0.02, 0.02), 6), ((0.01, 2.7), 2)],  # a fast origin's first byte; the fleet bench
    ids=["first-byte-as-long-as-the-transfer", "first-byte-short"],
)
def test_an_origin_fetcher_widens_its_origin_lane_where_first_bytes_take_long(
    tmp_path: Path, manifest_version: int, timing: tuple[float, float], most: int
) -> None:
    src = tmp_path / "src"
    m = make_model(src, {"w.bin": random_bytes(80 * CHUNK, 41)})
    names = ["n1", "n2", "n3"]
    (node, _), owner = plan_owners([c.key for c in m.chunks], names, 2)
    stores = {n: ChunkStore(tmp_path / n) for n in names}
    for n in names:  # the others hold the other fetcher's chunks, none of this node's
        if n != node:
            with ModelStaging(stores[n], m) as staging:
                staging.prepare()
                for c in m.chunks:
                    if owner[c.key] != node:
                        staging.put(c.key, LocalFolder(src).read_range(c.file, c.offset, c.size))
    origin = FirstByteOrigin(src, timing, read_s=0.05)
    policy = dataclasses.replace(FAST, origin_fetchers=2)
    with ExitStack() as stack:
        servers = {n: stack.enter_context(PeerServer(s, "127.0.0.1")) for n, s in stores.items()}
        peers = [Peer(n, server.address) for n, server in servers.items()]
        r = stage(m, stores[node], origin, peers, node=node, metrics=metrics()[0], policy=policy)
    assert same_files(m, stores[node], src)
    assert r.from_origin > 0 and origin.reads == r.from_origin // CHUNK
    # Two at once to start with (schedule.origin_requests); where the reads wait for
    # their first bytes together half the time, four after two rounds, then eight (six
    # at least by the time the queue runs short; a tail claim's read may run beside).
    assert origin.most == most if most == 2 else origin.most >= most
