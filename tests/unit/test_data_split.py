"""A slow whole-chunk transfer split across two peers: the part past a piece-aligned cut
comes from a second peer while the first stream goes on, and a bad piece in that part
is the second peer's fault."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from weightship.data import peer as peer_module
from weightship.data import rendezvous
from weightship.data.chunkstore import ChunkStore
from weightship.data.fetcher import ChunkFetcher, FetchPolicy, Peer
from weightship.data.metrics import DataPlaneMetrics
from weightship.data.modelstaging import ModelStaging
from weightship.data.peer import PeerClient, PeerError
from weightship.data.split import SplitTransfer
from weightship.httpserver import Server
from weightship.weightformat.build import LocalFolder, build_manifest_with_pieces
from weightship.weightformat.chunkhash import PieceLayer, PieceVerificationError
from weightship.weightformat.entries import ChunkEntry
from weightship.weightformat.manifest import Manifest

PIECE = 16 * 1024
PIECES = 16
CHUNK = PIECES * PIECE
DATA = bytes(range(256)) * (CHUNK // 256)  # one chunk


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _split(clock: _Clock, rest: Callable[[int, int], tuple[str, bytes] | None]) -> SplitTransfer:
    return SplitTransfer(CHUNK, PIECE, 0, rest, after_s=0.5, eta_s=1.0, clock=clock)


def _wait_for(event: threading.Event) -> None:
    assert event.wait(5)


def test_a_stream_on_time_is_never_split() -> None:
    clock, asked = _Clock(), threading.Event()
    split = _split(clock, lambda a, b: asked.set() or None)  # type: ignore[func-returns-value]
    clock.now = 0.4
    split.landed(2 * PIECE)  # slow, but not running long enough to tell yet
    clock.now = 0.6
    split.landed(12 * PIECE)  # 4 pieces left, at 20 pieces/s: 0.2 s
    assert split.cut is None and not asked.is_set()
    assert split.stop_at(12 * PIECE) == CHUNK


def test_a_slow_stream_splits_at_a_piece_boundary_and_stops_there_once_the_rest_is_in() -> None:
    clock, rest_in = _Clock(), threading.Event()
    asked: list[tuple[int, int]] = []

    def rest(begin: int, end: int) -> tuple[str, bytes]:
        asked.append((begin, end))
        rest_in.set()
        return "helper", DATA[begin:end]

    split = _split(clock, rest)
    clock.now = 1.0
    split.landed(PIECE + 100)  # 1 piece a second: 15 more seconds
    _wait_for(rest_in)
    cut = split.cut
    # The first stream keeps what it brings in eta_s (1 s) at its rate (a piece a
    # second), not a third of what is left (5 pieces), rounded up to a piece.
    assert cut == 3 * PIECE and asked == [(cut, CHUNK)]
    for _ in range(100):  # the thread's result is assigned after rest() returns
        if split.stop_at(PIECE + 100) != CHUNK:
            break
        threading.Event().wait(0.01)
    assert split.stop_at(PIECE + 100) == cut
    assert split.stop_at(cut + 5) == cut + PIECE  # past the cut: the next boundary
    view = memoryview(bytearray(CHUNK))
    view[:cut] = DATA[:cut]
    landed: list[int] = []
    assert split.finish(view, cut, landed.append) == CHUNK
    assert bytes(view) == DATA and landed == [CHUNK]


def test_a_stream_that_is_only_late_keeps_a_third_of_what_is_left() -> None:
    clock, rest_in = _Clock(), threading.Event()
    split = _split(clock, lambda a, b: rest_in.set() or None)  # type: ignore[func-returns-value]
    clock.now = 1.0
    split.landed(6 * PIECE)  # 6 pieces a second: 10 left, 1.7 s; in eta_s it brings 6
    _wait_for(rest_in)
    assert split.cut == 10 * PIECE  # a third of the 10 left, rounded up to a piece


def test_a_split_whose_rest_never_came_leaves_the_stream_to_its_end() -> None:
    clock, done = _Clock(), threading.Event()
    split = _split(clock, lambda a, b: done.set() or None)  # type: ignore[func-returns-value]
    clock.now = 1.0
    split.landed(PIECE)
    _wait_for(done)
    assert split.cut is not None and split.stop_at(PIECE) == CHUNK
    view = memoryview(bytearray(CHUNK))
    assert split.finish(view, 10 * PIECE, lambda n: None) == 10 * PIECE  # nothing added


# --- through the fetcher, against HTTP peers ------------------------------------------


@pytest.fixture
def model(tmp_path: Path) -> tuple[Manifest, PieceLayer]:
    src = tmp_path / "src"
    src.mkdir()
    (src / "w.bin").write_bytes(DATA)
    m, layer = build_manifest_with_pieces(LocalFolder(src), chunk_size=CHUNK, piece_size=PIECE)
    return m, PieceLayer(m, layer)


class _Peer:
    """A peer holding the chunk whole, answering ``Range: bytes=a-`` and ``bytes=a-b``.
    ``trickle``: its first answer sends that many pieces, one each 50 ms, then stalls
    until ``release`` (an owner whose uplink is full). ``bad_piece``: corrupted.
    ``oversend``: sends to the chunk's end whatever range end was asked."""

    def __init__(
        self, trickle: int | None = None, bad_piece: int | None = None, oversend: bool = False
    ) -> None:
        self.ranges: list[str | None] = []
        self.release = threading.Event()
        body = bytearray(DATA)
        if bad_piece is not None:
            body[bad_piece * PIECE + 3] ^= 1
        me = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                rng = self.headers.get("Range")
                me.ranges.append(rng)
                m = re.fullmatch(r"bytes=(\d+)-(\d*)", rng or "bytes=0-")
                start = int(m[1]) if m else 0
                end = int(m[2]) + 1 if m and m[2] and not oversend else CHUNK
                self.send_response(206 if rng else 200)
                self.send_header("Content-Length", str(end - start))
                self.end_headers()
                if trickle is None or len(me.ranges) > 1:
                    self.wfile.write(body[start:end])
                    return
                try:
                    for p in range(start // PIECE, end // PIECE):
                        if p >= trickle:
                            me.release.wait(10)
                        else:
                            threading.Event().wait(0.05)
                        self.wfile.write(body[p * PIECE : (p + 1) * PIECE])
                        self.wfile.flush()
                except OSError:
                    pass  # the reader stopped

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.server = Server(("127.0.0.1", 0), Handler).start("peer")
        self.address = f"127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.release.set()
        self.server.stop()


@pytest.fixture
def peers() -> Iterator[Callable[..., _Peer]]:
    made: list[_Peer] = []

    def make(**kwargs: int) -> _Peer:
        made.append(_Peer(**kwargs))
        return made[-1]

    yield make
    for p in made:
        p.close()


def _names(key: str) -> tuple[str, str]:
    """An owner and a second peer: the owner first in the chunk's ranking (of the two and
    this node), so it is asked first."""
    for i in range(1000):
        names = [f"owner-{i}", "other", "me"]
        if rendezvous.rank(names, key)[0] == names[0]:
            return names[0], names[1]
    raise AssertionError("no such names")


def _fetch(
    tmp_path: Path, m: Manifest, pieces: PieceLayer, owner: _Peer, other: _Peer
) -> tuple[ChunkFetcher, ChunkStore, ChunkEntry]:
    chunk = m.chunks[0]
    owner_name, other_name = _names(chunk.key)
    store = ChunkStore(tmp_path / "me")
    with ModelStaging(store, m) as staging:
        staging.pieces = pieces
        staging.prepare()
        fetcher = ChunkFetcher(
            node="me",
            peers=[Peer(owner_name, owner.address), Peer(other_name, other.address)],
            origin=_NoOrigin(),
            sink=staging,
            metrics=DataPlaneMetrics.create(CollectorRegistry()),
            chunks=m.chunks,
            policy=FetchPolicy(
                peer_timeout_s=5,
                owner_wait_s=10,
                poll_interval_s=0.01,
                holder_probes=0,
                split_after_s=0.2,
                split_eta_s=0.3,
            ),
        )
        assert fetcher.owner_of(chunk.key) == owner_name
        assert fetcher.fetch(chunk) == "peer"
        assert staging.has(chunk.key)
    return fetcher, store, chunk


class _NoOrigin:
    def read_range(self, path: str, offset: int, size: int) -> bytes:
        raise AssertionError("nothing should come from the origin")


def test_a_chunk_stalling_at_its_owner_is_finished_from_another_peer(
    tmp_path: Path,
    model: tuple[Manifest, PieceLayer],
    peers: Callable[..., _Peer],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The owner sends 12 of 16 pieces slowly and then nothing: the stream splits, the
    other peer sends the pieces past the cut, and the chunk is whole without waiting for
    the owner, which stays in good standing (it was slow, not dead)."""
    monkeypatch.setattr(peer_module, "READ_STEP", PIECE)
    m, pieces = model
    owner, other = peers(trickle=12), peers()
    fetcher, store, chunk = _fetch(tmp_path, m, pieces, owner, other)
    assert store.read_chunk(chunk.key) == DATA
    assert owner.ranges == [None]
    assert len(other.ranges) == 1
    cut = re.fullmatch(r"bytes=(\d+)-(\d+)", other.ranges[0] or "")
    assert cut is not None and int(cut[2]) == CHUNK - 1
    assert int(cut[1]) % PIECE == 0 and 0 < int(cut[1]) <= 12 * PIECE
    assert not fetcher.health.avoided()


def test_a_bad_piece_past_the_cut_demotes_the_peer_that_sent_it(
    tmp_path: Path,
    model: tuple[Manifest, PieceLayer],
    peers: Callable[..., _Peer],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The other peer's last piece is bad: that peer is demoted, not the owner, and the
    pieces before it (the owner's and the other's, verified) are kept: the owner is asked
    again for the last piece only."""
    monkeypatch.setattr(peer_module, "READ_STEP", PIECE)
    m, pieces = model
    owner, other = peers(trickle=12), peers(bad_piece=PIECES - 1)
    fetcher, store, chunk = _fetch(tmp_path, m, pieces, owner, other)
    assert store.read_chunk(chunk.key) == DATA
    other_name = _names(chunk.key)[1]
    assert fetcher.health.demotions == {other_name: 1}
    assert owner.ranges == [None, f"bytes={(PIECES - 1) * PIECE}-"]
    assert len(other.ranges) == 1 and (other.ranges[0] or "").endswith(f"-{CHUNK - 1}")


def test_a_bad_piece_before_the_cut_is_still_the_first_peers() -> None:
    clock, rest_in = _Clock(), threading.Event()

    def rest(begin: int, end: int) -> tuple[str, bytes]:
        rest_in.set()
        return "helper", DATA[begin:end]

    split = _split(clock, rest)
    clock.now = 1.0
    split.landed(PIECE)
    _wait_for(rest_in)
    for _ in range(100):
        if split.stop_at(PIECE) != CHUNK:
            break
        threading.Event().wait(0.01)
    assert split.cut is not None
    chunk = ChunkEntry(file="w.bin", index=0, offset=0, size=CHUNK, blake3="0" * 64)
    last_before_cut = split.cut // PIECE - 1

    def bad_before(n: int) -> None:
        raise PieceVerificationError(chunk, last_before_cut)  # the first peer's piece

    view = memoryview(bytearray(CHUNK))
    with pytest.raises(PieceVerificationError) as err:
        split.finish(view, split.cut, bad_before)
    assert type(err.value) is PieceVerificationError


def test_a_part_longer_than_the_range_asked_is_refused_unread(
    peers: Callable[..., _Peer], model: tuple[Manifest, PieceLayer]
) -> None:
    """The second part is read into memory: a peer answering more than the range asked
    is refused before its body is read."""
    m, _ = model
    liar, honest = peers(oversend=True), peers()
    client = PeerClient(timeout_s=5)
    with pytest.raises(PeerError, match="more than"):
        client.fetch(liar.address, m.chunks[0].key, start=PIECE, end=2 * PIECE)
    part = client.fetch(honest.address, m.chunks[0].key, start=PIECE, end=2 * PIECE)
    assert part == DATA[PIECE : 2 * PIECE]
