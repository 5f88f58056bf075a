"""Version 2 staging: pieces verified as they land, streamed on while the chunk is still
arriving (cut-through), a bad piece caught at that piece, and the files' sha256 check."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from prometheus_client import CollectorRegistry

from weightship.data import fetcher as fetcher_module
from weightship.data import peer as peer_module
from weightship.data import rendezvous, schedule
from weightship.data.chunkindex import ChunkIndex
from weightship.data.chunkstore import ChunkStore
from weightship.data.cli import verify_files_command
from weightship.data.fetcher import ChunkFetcher, FetchPolicy, Peer
from weightship.data.metrics import DataPlaneMetrics
from weightship.data.modelstaging import ChunkIncompleteError, ModelStaging
from weightship.data.peer import (
    ChunkNotOnPeerError,
    PeerBody,
    PeerBusyError,
    PeerClient,
    PeerError,
    PeerNotRelayingError,
    PeerServer,
)
from weightship.data.slowrelay import LAG_NOTICES, LAG_S
from weightship.data.stage import stage
from weightship.httpserver import Server
from weightship.weightformat.build import LocalFolder, build_manifest_with_pieces
from weightship.weightformat.chunkhash import PieceLayer, PieceVerificationError
from weightship.weightformat.manifest import Manifest

PIECE = 16 * 1024
CHUNK = 4 * PIECE
DATA = bytes(range(256)) * (2 * CHUNK // 256)  # two chunks


@pytest.fixture
def model(tmp_path: Path) -> tuple[Manifest, PieceLayer, Path]:
    src = tmp_path / "src"
    src.mkdir()
    (src / "w.bin").write_bytes(DATA)
    m, layer = build_manifest_with_pieces(LocalFolder(src), chunk_size=CHUNK, piece_size=PIECE)
    return m, PieceLayer(m, layer), src


def _bytes(m: Manifest, src: Path, index: int) -> bytes:
    c = m.chunks[index]
    return (src / c.file).read_bytes()[c.offset : c.offset + c.size]


def test_a_chunk_still_arriving_is_streamed_on_never_past_its_verified_prefix(
    tmp_path: Path, model: tuple[Manifest, PieceLayer, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(peer_module, "STREAM_STALL_S", 0.3)
    monkeypatch.setattr(peer_module, "READ_STEP", PIECE)  # the reader's step: one piece
    m, pieces, src = model
    chunk, good = m.chunks[0], _bytes(m, src, 0)
    owner_store = ChunkStore(tmp_path / "owner")
    owner_store.claims.open([chunk.key], [])  # the owner's stage fetches it (stage() opens)
    gate = [threading.Event() for _ in range(4)]
    verified_at: list[int] = []  # the owner's verified prefix each time the reader got bytes

    with ModelStaging(owner_store, m) as owner, PeerServer(owner_store, "127.0.0.1") as server:
        owner.pieces = pieces
        owner.prepare()

        def slow_fill(bad_piece: int | None) -> Callable[..., int]:
            def fill(view: memoryview, start: int, landed: Callable[[int], None]) -> int:
                for p in range(start // PIECE, 4):
                    gate[p].wait(5)
                    data = bytearray(good[p * PIECE : (p + 1) * PIECE])
                    if p == bad_piece:
                        data[7] ^= 1
                    view[p * PIECE : (p + 1) * PIECE] = data
                    landed((p + 1) * PIECE)
                return CHUNK

            return fill

        errors: list[BaseException] = []

        def owner_receives() -> None:
            try:
                owner.receive(chunk.key, slow_fill(bad_piece=2))  # a bad piece from its source
            except PieceVerificationError as exc:
                errors.append(exc)

        t = threading.Thread(target=owner_receives)
        t.start()
        gate[0].set()
        client = PeerClient(timeout_s=5)
        body = client.open(server.address, chunk.key, wait_s=2)  # held until piece 0 verified
        got = bytearray(CHUNK)

        def landed(end: int) -> None:
            verified_at.append(owner_store.index.receiving(chunk.key).verified)  # type: ignore[union-attr]
            assert end <= verified_at[-1]  # never a byte the owner has not verified
            if end == PIECE:
                gate[1].set()
                gate[2].set()

        end = body.read_into(memoryview(got), 0, landed)
        body.close()
        t.join(5)
        # Piece 2 failed at the owner: the stream ended cleanly after the 2 verified pieces.
        assert len(errors) == 1 and errors[0].piece == 2  # type: ignore[attr-defined]
        assert end == 2 * PIECE and bytes(got[:end]) == good[: 2 * PIECE]
        assert not owner_store.has_chunk(chunk.key)
        assert owner.resume_point(chunk.key) == 2 * PIECE  # kept for the next attempt

        # The owner's next attempt starts at its prefix; the reader resumes at its own.
        gate[3].set()
        t = threading.Thread(target=lambda: owner.receive(chunk.key, slow_fill(None)))
        t.start()
        body = client.open(server.address, chunk.key, start=end, wait_s=2)
        end = body.read_into(memoryview(got), end, lambda n: None)
        body.close()
        t.join(5)
        assert end == CHUNK and bytes(got) == good
        assert owner_store.has_chunk(chunk.key)
        assert verified_at and verified_at[0] < CHUNK  # bytes moved before the chunk was whole


def test_a_peer_sending_its_cap_of_transfers_answers_busy(
    tmp_path: Path, model: tuple[Manifest, PieceLayer, Path]
) -> None:
    """``max_concurrent`` transfers at once (``peer.MAX_TRANSFERS`` by default, the number
    the fleet simulator answers by): a stream in flight holds one until it ends, and an
    ask past the cap is a 503 that the client raises as busy, never held or queued."""
    m, pieces, src = model
    chunk, good = m.chunks[0], _bytes(m, src, 0)
    store = ChunkStore(tmp_path / "owner")
    store.claims.open([chunk.key], [])
    # The rest lands once the second ask was answered.
    first_piece, more = threading.Event(), threading.Event()
    fill = _lands_in_two(good, first_piece, more)
    with (
        ModelStaging(store, m) as owner,
        PeerServer(store, "127.0.0.1", max_concurrent=1) as server,
    ):
        owner.pieces = pieces
        owner.prepare()
        t = threading.Thread(target=lambda: owner.receive(chunk.key, fill))
        t.start()
        first, second = PeerClient(timeout_s=5), PeerClient(timeout_s=5)
        body = first.open(server.address, chunk.key, wait_s=2)  # streaming: holds the slot
        with pytest.raises(PeerBusyError):
            second.open(server.address, chunk.key, wait_s=2)
        more.set()
        got = bytearray(CHUNK)
        assert body.read_into(memoryview(got), 0, lambda n: None) == CHUNK
        body.close()
        t.join(5)
        assert bytes(got) == good
        # The slot is free again: the same ask is answered.
        assert second.fetch(server.address, chunk.key) == good


def _lands_whole(good: bytes) -> Callable[[memoryview, int, Callable[[int], None]], int]:
    """A fill that lands the whole chunk at once."""
    rest = threading.Event()
    rest.set()
    return _lands_in_two(good, threading.Event(), rest)


def test_a_peer_says_how_long_it_has_held_a_chunk_it_sends_whole(
    tmp_path: Path, model: tuple[Manifest, PieceLayer, Path]
) -> None:
    """``HELD_HEADER``: the seconds since the chunk landed here in a stage, which the asker
    reads as how far behind this node it is (slowrelay.py). None on a stream of a chunk
    still landing, and for a chunk found on disk (held since an earlier stage: that says
    nothing of the asker)."""
    m, pieces, src = model
    chunk, good = m.chunks[0], _bytes(m, src, 0)
    store = ChunkStore(tmp_path / "owner")
    store.claims.open([chunk.key], [])
    arrived, more = threading.Event(), threading.Event()
    with (
        ModelStaging(store, m) as owner,
        PeerServer(store, "127.0.0.1") as server,
    ):
        owner.pieces = pieces
        owner.prepare()
        landing = _lands_in_two(good, arrived, more)
        t = threading.Thread(target=lambda: owner.receive(chunk.key, landing))
        t.start()
        client = PeerClient(timeout_s=5)
        assert arrived.wait(5)
        stream = client.open(server.address, chunk.key, wait_s=2)
        assert not stream.whole and stream.held_s is None
        # Asked beside the stream (this thread's connection is carrying it): not whole yet.
        assert client.held(server.address, chunk.key) is None
        more.set()
        got = bytearray(CHUNK)
        assert stream.read_into(memoryview(got), 0, lambda n: None) == CHUNK
        t.join(5)
        body = client.open(server.address, chunk.key)
        assert body.whole and body.held_s is not None and 0.0 <= body.held_s < 5.0
        body.close()
        time.sleep(0.3)
        body = client.open(server.address, chunk.key)
        assert body.held_s is not None and body.held_s >= 0.3  # it grows
        body.close()
        held = client.held(server.address, chunk.key)  # a HEAD says the same
        assert held is not None and held >= 0.3
    found_on_disk = ChunkIndex()
    location = store.index.get(chunk.key)
    assert location is not None
    found_on_disk.add(chunk.key, location)
    assert found_on_disk.held_s(chunk.key) is None and store.index.held_s("x") is None


def test_a_node_that_stopped_relaying_answers_every_chunk_request_saying_so(
    tmp_path: Path, model: tuple[Manifest, PieceLayer, Path]
) -> None:
    """Once its ``RelayStatus`` stopped (``LAG_NOTICES`` lags), the peer server answers 503
    with ``RELAYING_HEADER``, which the client raises as PeerNotRelayingError (the fetcher
    shuns the node and asks above it), also to a request it held while the node stopped,
    and to a claim (its stand-in fetches its chunks: a grant would fetch them twice)."""
    m, pieces, src = model
    chunk = m.chunks[0]
    store = ChunkStore(tmp_path / "owner")
    store.claims.open([chunk.key], [])
    with (
        ModelStaging(store, m) as owner,
        PeerServer(store, "127.0.0.1") as server,
    ):
        owner.pieces = pieces
        owner.prepare()
        client = PeerClient(timeout_s=5)
        held: list[BaseException] = []

        def ask() -> None:
            try:
                client.open(server.address, chunk.key, wait_s=3)
            except PeerError as exc:
                held.append(exc)

        t = threading.Thread(target=ask)
        t.start()
        time.sleep(0.3)  # the request is held: nothing of the chunk is here
        for _ in range(LAG_NOTICES):
            store.relaying.parent_held(LAG_S + 1, LAG_S + 1.5)
        assert not store.relaying.relaying
        owner.receive(chunk.key, _lands_whole(_bytes(m, src, 0)))  # wakes the held request
        t.join(5)
        assert len(held) == 1 and isinstance(held[0], PeerNotRelayingError)
        with pytest.raises(PeerNotRelayingError):
            client.open(server.address, chunk.key)
        with pytest.raises(PeerNotRelayingError):
            client.fetch(server.address, chunk.key)
        with pytest.raises(PeerNotRelayingError):
            client.held(server.address, chunk.key)
        other = f"blake3:{'ab' * 32}"  # a chunk no stage here fetches: else granted
        with pytest.raises(PeerNotRelayingError):
            client.claim(server.address, other, "node-b")


class _Canned:
    """A peer answering GET /chunks/... with ``data`` (honouring ``Range: bytes=a-``),
    one piece corrupted when ``bad_piece`` is set; records the ranges asked."""

    def __init__(self, data: bytes, bad_piece: int | None) -> None:
        self.ranges: list[str | None] = []
        canned = self
        body = bytearray(data)
        if bad_piece is not None:
            body[bad_piece * PIECE + 3] ^= 1

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                rng = self.headers.get("Range")
                canned.ranges.append(rng)
                m = re.fullmatch(r"bytes=(\d+)-", rng or "bytes=0-")
                start = int(m[1]) if m else 0
                self.send_response(206 if start else 200)
                self.send_header("Content-Length", str(len(body) - start))
                self.end_headers()
                self.wfile.write(body[start:])

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.server = Server(("127.0.0.1", 0), Handler).start("peer")
        self.address = f"127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.stop()


@pytest.fixture
def canned() -> Iterator[Callable[[bytes, int | None], _Canned]]:
    made: list[_Canned] = []

    def make(data: bytes, bad_piece: int | None) -> _Canned:
        made.append(_Canned(data, bad_piece))
        return made[-1]

    yield make
    for c in made:
        c.close()


def _ranked(key: str) -> tuple[str, str]:
    for i in range(1000):
        for j in range(20):
            names = [f"liar-{i}", f"honest-{j}", "me"]
            if rendezvous.rank(names, key) == names:
                return names[0], names[1]
    raise AssertionError("no such names")


class _NoOrigin:
    def read_range(self, path: str, offset: int, size: int) -> bytes:
        raise AssertionError("nothing should come from the origin")


def test_a_corrupt_piece_from_a_peer_is_caught_at_that_piece_and_the_rest_fetched_elsewhere(
    tmp_path: Path,
    model: tuple[Manifest, PieceLayer, Path],
    canned: Callable[[bytes, int | None], _Canned],
) -> None:
    m, pieces, src = model
    chunk, good = m.chunks[1], _bytes(m, src, 1)
    liar, honest = canned(good, 2), canned(good, None)
    liar_name, honest_name = _ranked(chunk.key)
    registry = CollectorRegistry()
    store = ChunkStore(tmp_path / "me")
    with ModelStaging(store, m) as staging:
        staging.pieces = pieces
        staging.prepare()
        fetcher = ChunkFetcher(
            node="me",
            peers=[Peer(liar_name, liar.address), Peer(honest_name, honest.address)],
            origin=_NoOrigin(),
            sink=staging,
            metrics=DataPlaneMetrics.create(registry),
            chunks=m.chunks,
            # The owner (the liar) asked first: no holder asked before it.
            policy=FetchPolicy(
                peer_timeout_s=2, owner_wait_s=10, poll_interval_s=0.01, holder_probes=0
            ),
        )
        assert fetcher.fetch(chunk) == "peer"
        assert store.read_chunk(chunk.key) == good
    # The liar's pieces 0 and 1 verified and were kept; piece 2 failed; the honest peer
    # was asked for the rest only, from piece 2 on.
    assert liar.ranges == [None]
    assert honest.ranges == [f"bytes={2 * PIECE}-"]
    assert fetcher.health.demotions == {liar_name: 1}
    assert liar_name in fetcher.health.avoided()
    assert registry.get_sample_value("weightship_agent_peer_demotions_total") == 1
    failures = registry.get_sample_value(
        "weightship_agent_chunk_verification_failures_total", {"source": "peer"}
    )
    assert failures == 1


def test_verify_files_checks_staged_files_against_their_sha256(
    tmp_path: Path, model: tuple[Manifest, PieceLayer, Path]
) -> None:
    m, _pieces, src = model
    store = ChunkStore(tmp_path / "cache")
    with ModelStaging(store, m) as staging:
        staging.prepare()
        for i, c in enumerate(m.chunks):
            staging.put(c.key, _bytes(m, src, i))
        staging.mark_staged()
    runner = CliRunner()
    ok = runner.invoke(verify_files_command, [str(store.root)])
    assert ok.exit_code == 0, ok.output
    assert f"{m.digest}: 1 files, all match" in ok.output
    staged = store.files_dir(m.digest) / "w.bin"
    data = bytearray(staged.read_bytes())
    data[100] ^= 1
    staged.write_bytes(data)
    bad = runner.invoke(verify_files_command, [str(store.root), m.digest])
    assert bad.exit_code == 1
    assert "w.bin does not match its sha256" in bad.output


class _Folder:
    """The model folder as origin (``read_range`` only), optionally with a bad piece layer."""

    def __init__(self, src: Path, layer: bytes | None) -> None:
        self.local, self.layer = LocalFolder(src), layer
        self.layer_reads = 0

    def read_range(self, path: str, offset: int, size: int) -> bytes:
        if path.startswith("weightship-pieces/"):
            self.layer_reads += 1
            if self.layer is None:
                raise FileNotFoundError(path)
            return self.layer[offset : offset + size]
        return self.local.read_range(path, offset, size)


@pytest.mark.parametrize("layer", [None, b"\0" * 32 * 8], ids=["missing", "forged"])
def test_without_a_valid_piece_layer_chunks_are_verified_whole(
    tmp_path: Path,
    model: tuple[Manifest, PieceLayer, Path],
    layer: bytes | None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    m, _pieces, src = model
    store = ChunkStore(tmp_path / "cache")
    origin = _Folder(src, layer)
    metrics = DataPlaneMetrics.create(CollectorRegistry())
    result = stage(m, store, origin, [], node="n1", metrics=metrics)
    assert store.is_staged(m.digest) and result.from_origin + result.from_local == m.total_size
    assert (store.files_dir(m.digest) / "w.bin").read_bytes() == DATA
    assert origin.layer_reads == 1
    assert not (store.model_dir(m.digest) / "pieces").exists()
    assert "without piece verification" in caplog.text
    assert store.index.receiving(m.chunks[0].key) is None


def test_a_staged_piece_layer_is_kept_and_nothing_stays_listed_as_arriving(
    tmp_path: Path, model: tuple[Manifest, PieceLayer, Path]
) -> None:
    m, pieces, src = model
    store = ChunkStore(tmp_path / "cache")
    origin = _Folder(src, pieces.raw)
    stage(m, store, origin, [], node="n1", metrics=DataPlaneMetrics.create(CollectorRegistry()))
    assert (store.model_dir(m.digest) / "pieces").read_bytes() == pieces.raw
    assert all(store.index.receiving(c.key) is None for c in m.chunks)


def _lands_in_two(
    good: bytes, first_piece: threading.Event, rest: threading.Event
) -> Callable[[memoryview, int, Callable[[int], None]], int]:
    """A fill that lands the first piece (verified and published: the chunk is arriving),
    sets ``first_piece``, and lands the rest once ``rest`` is set."""

    def fill(view: memoryview, start: int, landed: Callable[[int], None]) -> int:
        view[:PIECE] = good[:PIECE]
        landed(PIECE)
        first_piece.set()
        rest.wait(5)
        view[PIECE:] = good[PIECE:]
        landed(CHUNK)
        return CHUNK

    return fill


def test_a_spare_only_request_is_never_streamed_a_chunk_still_arriving(
    tmp_path: Path, model: tuple[Manifest, PieceLayer, Path]
) -> None:
    """X-Weightship-Spare: a chunk the peer is still receiving is a 404 (a plain request
    is streamed it); once whole, it is sent."""
    m, pieces, src = model
    chunk, good = m.chunks[0], _bytes(m, src, 0)
    store = ChunkStore(tmp_path / "holder")
    first_piece, rest = threading.Event(), threading.Event()
    fill = _lands_in_two(good, first_piece, rest)

    with ModelStaging(store, m) as staging, PeerServer(store, "127.0.0.1") as server:
        staging.pieces = pieces
        staging.prepare()
        receiving = threading.Thread(target=staging.receive, args=(chunk.key, fill))
        receiving.start()
        assert first_piece.wait(5)
        client = PeerClient(timeout_s=5)
        with pytest.raises(ChunkNotOnPeerError):
            client.open(server.address, chunk.key, spare_only=True)
        with pytest.raises(ChunkNotOnPeerError):
            client.fetch(server.address, chunk.key, spare_only=True)
        stream = client.open(server.address, chunk.key)  # a plain request: streamed
        rest.set()
        got = bytearray(CHUNK)
        assert stream.read_into(memoryview(got), 0, lambda n: None) == CHUNK
        stream.close()
        receiving.join(5)
        assert bytes(got) == good
        assert client.fetch(server.address, chunk.key, spare_only=True) == good


def test_an_owner_sends_a_request_it_held_to_the_claimant_once_its_chunk_lands_from_there(
    tmp_path: Path, model: tuple[Manifest, PieceLayer, Path]
) -> None:
    """A request held at the owner for a chunk that a peer then claimed, and that now lands
    at the owner from that claimant, is answered 404 naming the claimant: relayed from a
    slow owner it would share that owner's full uplink (fleet traces: five nodes got a
    claimed chunk through its owner at the end of a round). Not with redirect_claimed
    off: then it is streamed."""
    m, pieces, src = model
    chunk, good = m.chunks[0], _bytes(m, src, 0)
    store = ChunkStore(tmp_path / "owner")
    store.claims.open([c.key for c in m.chunks], [("node-b", "127.0.0.1:1")])
    first_piece, rest = threading.Event(), threading.Event()
    from_claimant = _lands_in_two(good, first_piece, rest)

    with (
        ModelStaging(store, m) as staging,
        PeerServer(store, "127.0.0.1") as server,
        PeerServer(store, "127.0.0.1", redirect_claimed=False) as plain,
    ):
        staging.pieces = pieces
        staging.prepare()
        client = PeerClient(timeout_s=5)
        held: list[BaseException | None] = []

        def ask_owner() -> None:
            try:
                client.open(server.address, chunk.key, wait_s=5).close()
                held.append(None)
            except ChunkNotOnPeerError as exc:
                held.append(exc)

        asker = threading.Thread(target=ask_owner)
        asker.start()  # held: nothing of the chunk is here, and nobody claimed it yet
        assert store.claims.grant(chunk.key, "node-b") == "node-b"
        receiving = threading.Thread(target=staging.receive, args=(chunk.key, from_claimant))
        receiving.start()
        assert first_piece.wait(5)
        asker.join(5)
        assert isinstance(held[0], ChunkNotOnPeerError) and held[0].claimant == "node-b"
        relayed = PeerClient(timeout_s=5).open(plain.address, chunk.key)
        rest.set()
        got = bytearray(CHUNK)
        assert relayed.read_into(memoryview(got), 0, lambda n: None) == CHUNK
        relayed.close()
        receiving.join(5)
        assert bytes(got) == good
        assert client.fetch(server.address, chunk.key) == good  # whole here: served


@pytest.mark.parametrize("streamed", [True, False], ids=["streamed", "whole"])
def test_a_chunk_from_its_owner_whole_marks_the_node_behind_on_it(
    tmp_path: Path, model: tuple[Manifest, PieceLayer, Path], streamed: bool
) -> None:
    """A chunk its owner sent whole means this node fell behind on that owner (others may
    hold its next chunks whole: worth asking them first); one streamed as it landed at
    the owner means it kept up (nobody holds the next one whole yet)."""
    m, pieces, src = model
    chunk, good = m.chunks[0], _bytes(m, src, 0)
    keys = [c.key for c in m.chunks]
    owner = next(
        f"owner-{i}"
        for i in range(1000)
        if rendezvous.balanced_owners(keys, ["me", f"owner-{i}"])[chunk.key] == f"owner-{i}"
    )
    owner_store = ChunkStore(tmp_path / "owner")
    landing = threading.Event()
    with (
        ModelStaging(owner_store, m) as owner_staging,
        PeerServer(owner_store, "127.0.0.1") as server,
        ModelStaging(ChunkStore(tmp_path / "me"), m) as staging,
    ):
        owner_staging.pieces = staging.pieces = pieces
        owner_staging.prepare()
        staging.prepare()

        def trickle(view: memoryview, start: int, landed: Callable[[int], None]) -> int:
            for p in range(start // PIECE, CHUNK // PIECE):  # a piece each 50 ms
                view[p * PIECE : (p + 1) * PIECE] = good[p * PIECE : (p + 1) * PIECE]
                landed((p + 1) * PIECE)
                landing.set()
                threading.Event().wait(0.05)
            return CHUNK

        if streamed:
            t = threading.Thread(target=lambda: owner_staging.receive(chunk.key, trickle))
            t.start()
            assert landing.wait(5)
        else:
            owner_staging.put(chunk.key, good)
        fetcher = ChunkFetcher(
            node="me",
            peers=[Peer(owner, server.address)],
            origin=_NoOrigin(),
            sink=staging,
            metrics=DataPlaneMetrics.create(CollectorRegistry()),
            chunks=m.chunks,
            policy=FetchPolicy(peer_timeout_s=2, owner_wait_s=10, poll_interval_s=0.01),
        )
        assert fetcher.owner_of(chunk.key) == owner
        assert fetcher.fetch(chunk) == "peer"
        if streamed:
            t.join(5)
        assert staging.has(chunk.key)
    assert fetcher.behind_on == {owner: not streamed}


class _SteppedOrigin:
    """An origin over the model's files that lands each read in the step it is asked
    for, and records that step (None: the origin's default)."""

    def __init__(self, src: Path) -> None:
        self.src = src
        self.steps: list[int | None] = []

    def read_range(self, path: str, offset: int, size: int) -> bytes:
        return (self.src / path).read_bytes()[offset : offset + size]

    def read_range_into(
        self,
        path: str,
        offset: int,
        view: memoryview,
        landed: Callable[[int], None] | None = None,
        step: int | None = None,
    ) -> None:
        self.steps.append(step)
        view[:] = self.read_range(path, offset, len(view))
        size = step or len(view)
        for end in range(size, len(view) + size, size):
            if landed:
                landed(min(end, len(view)))


@pytest.mark.parametrize("with_peers", [True, False])
def test_an_owner_with_peers_reads_the_origin_one_piece_at_a_time(
    tmp_path: Path,
    model: tuple[Manifest, PieceLayer, Path],
    monkeypatch: pytest.MonkeyPatch,
    with_peers: bool,
) -> None:
    """Each piece is verified and streamed on the moment it is in, instead of waiting for
    the origin's larger read; alone, the node keeps the origin's default step (P1)."""
    monkeypatch.setattr(fetcher_module, "MIN_ORIGIN_STEP", PIECE // 4)
    m, pieces, src = model
    origin = _SteppedOrigin(src)
    store = ChunkStore(tmp_path / "me")
    with ModelStaging(store, m) as staging:
        staging.pieces = pieces
        staging.prepare()
        fetcher = ChunkFetcher(
            node="me",
            peers=[Peer("other", "127.0.0.1:9")] if with_peers else [],
            origin=origin,
            sink=staging,
            metrics=DataPlaneMetrics.create(CollectorRegistry()),
            chunks=m.chunks,
        )
        chunk = next(c for c in m.chunks if fetcher.owner_of(c.key) == "me")
        assert fetcher.fetch(chunk) == "origin"
        assert store.read_chunk(chunk.key) == _bytes(m, src, m.chunks.index(chunk))
    assert origin.steps == ([PIECE] if with_peers else [None])


class _DiesMidChunk:
    """A fetcher killed while it streams a chunk on: answers a GET with the first
    ``pieces`` pieces of ``data``, chunked (a chunk still landing there), then drops the
    connection; counts the requests."""

    def __init__(self, data: bytes, pieces: int) -> None:
        self.requests = 0
        dying = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                dying.requests += 1
                self.send_response(200)
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                sent = data[: pieces * PIECE]
                self.wfile.write(f"{len(sent):x}\r\n".encode() + sent + b"\r\n")
                self.close_connection = True  # gone before the chunk's end

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.server = Server(("127.0.0.1", 0), Handler).start("dying")
        self.address = f"127.0.0.1:{self.server.server_address[1]}"


class _AskedClient(PeerClient):
    """A real peer client that records whom each stream was asked of, in order."""

    def __init__(self, names: dict[str, str]) -> None:
        super().__init__(timeout_s=5)
        self.names = names  # address -> node
        self.asked: list[str] = []

    def open(self, address: str, key: str, **kwargs: Any) -> PeerBody:
        self.asked.append(self.names[address])
        return super().open(address, key, **kwargs)


class _FillingOrigin:
    """The source folder as an origin that reads into place; records where reads start."""

    def __init__(self, src: Path) -> None:
        self.local = LocalFolder(src)
        self.offsets: list[int] = []

    def read_range(self, path: str, offset: int, size: int) -> bytes:
        raise AssertionError("the in-place sink reads with read_range_into")

    def read_range_into(
        self,
        path: str,
        offset: int,
        view: memoryview,
        landed: Callable[[int], None] | None = None,
        step: int = 0,
    ) -> None:
        self.offsets.append(offset)
        view[:] = self.local.read_range(path, offset, len(view))
        if landed is not None:
            landed(len(view))


def _owner_before(keys: list[str], key: str, stand_in: str, other: str) -> str:
    """A name for the fetcher that owns ``key`` among itself, ``stand_in`` and ``other``,
    sorted just before ``stand_in`` (its first child: the node standing in for it)."""
    for i in range(1000):
        owner = f"{stand_in[:-1]}{chr(ord(stand_in[-1]) - 1)}{i}"
        if schedule.plan_owners(keys, [owner, stand_in, other], 8)[1][key] == owner:
            return owner
    raise AssertionError("no such name")


def test_the_stand_in_cut_off_from_a_dead_fetcher_goes_to_the_origin_at_once(
    tmp_path: Path, model: tuple[Manifest, PieceLayer, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fetcher dies while it streams a chunk on to its first child (node-b, which then
    stands in for it) and to another peer (node-c). node-c's copy stops growing, so a
    stream of it stalls (``STREAM_STALL_S``, 5 s in the agent). node-b, cut off, finds the
    fetcher dead and starts a new round at once (``schedule.round_goes_on``): the root now,
    it fetches the rest from the origin, from its verified prefix on, rather than going on
    to the round's other peers and stalling on node-c's copy, which waited on node-b's
    (the simulator, 200 nodes with 10 % killed: 12.2x S/B going on, 1.40x not)."""
    monkeypatch.setattr(peer_module, "STREAM_STALL_S", 1.0)
    monkeypatch.setattr(peer_module, "READ_STEP", PIECE)  # the pieces read before the cut land
    m, pieces, src = model
    chunk, good = m.chunks[0], _bytes(m, src, 0)
    owner = _owner_before([c.key for c in m.chunks], chunk.key, "node-b", "node-c")
    dying = _DiesMidChunk(good, pieces=2)
    peer_store, store = ChunkStore(tmp_path / "node-c"), ChunkStore(tmp_path / "node-b")
    two_pieces_in, release = threading.Event(), threading.Event()

    def two_pieces_then_nothing(view: memoryview, start: int, landed: Callable[[int], None]) -> int:
        view[: 2 * PIECE] = good[: 2 * PIECE]
        landed(2 * PIECE)
        two_pieces_in.set()
        release.wait(10)  # its source died too: nothing more lands before the test ends
        return 2 * PIECE

    def peer_receives(staging: ModelStaging) -> None:
        with pytest.raises(ChunkIncompleteError):
            staging.receive(chunk.key, two_pieces_then_nothing)

    with (
        ModelStaging(peer_store, m) as peer_staging,
        PeerServer(peer_store, "127.0.0.1") as peer_server,
        ModelStaging(store, m) as staging,
    ):
        for s in (peer_staging, staging):
            s.pieces = pieces
            s.prepare()
        receiving = threading.Thread(target=peer_receives, args=(peer_staging,))
        receiving.start()
        assert two_pieces_in.wait(5)
        names = {dying.address: owner, peer_server.address: "node-c"}
        client = _AskedClient(names)
        origin = _FillingOrigin(src)
        fetcher = ChunkFetcher(
            node="node-b",
            peers=[Peer(n, a) for a, n in names.items()],
            origin=origin,
            sink=staging,
            metrics=DataPlaneMetrics.create(CollectorRegistry()),
            chunks=m.chunks,
            policy=FetchPolicy(peer_timeout_s=2, owner_wait_s=20, poll_interval_s=0.01),
            client=client,
        )
        assert fetcher.live_ranking(chunk.key, (), 1) == [owner]
        assert fetcher.live_ranking(chunk.key, {owner}, 1) == ["node-b"]  # stands in
        try:
            assert fetcher.fetch(chunk) == "origin"
        finally:
            release.set()
            receiving.join(5)
            dying.server.stop()
        assert store.read_chunk(chunk.key) == good
    assert dying.requests == 1 and owner in fetcher.health.avoided()
    assert origin.offsets == [chunk.offset + 2 * PIECE]  # from its verified prefix on
    # node-c, whose copy nobody will fill, is never asked.
    assert client.asked == [owner]
