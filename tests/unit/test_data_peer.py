import hashlib
import http.client
import random
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from weightship.data import peer
from weightship.data.chunkindex import ChunkLocation
from weightship.data.chunkstore import ChunkStore
from weightship.data.modelstaging import ModelStaging
from weightship.data.peer import (
    ChunkNotOnPeerError,
    PeerBody,
    PeerBusyError,
    PeerClient,
    PeerServer,
    PeerUnavailableError,
    parse_range,
)
from weightship.weightformat.build import LocalFolder, build_manifest
from weightship.weightformat.manifest import Manifest

DATA = bytes(range(256)) * 40
DIGEST = hashlib.sha256(DATA).hexdigest()


def model_of(folder: Path, data: bytes) -> Manifest:
    """A model whose one chunk is ``data``, at an offset inside its second file."""
    folder.mkdir()
    (folder / "a.bin").write_bytes(b"a" * len(data))
    (folder / "b.bin").write_bytes(b"b" * len(data) + data)
    return build_manifest(LocalFolder(folder), chunk_size=len(data), version=1)


@pytest.fixture
def store(tmp_path: Path) -> ChunkStore:
    return ChunkStore(tmp_path / "cache")


@pytest.fixture
def model(tmp_path: Path) -> Manifest:
    return model_of(tmp_path / "src", DATA)


def put_all(store: ChunkStore, m: Manifest, folder: Path) -> None:
    with ModelStaging(store, m) as staging:
        staging.prepare()
        for c in m.chunks:
            staging.put(c.key, LocalFolder(folder).read_range(c.file, c.offset, c.size))
        staging.mark_staged()


@pytest.fixture
def server(tmp_path: Path, store: ChunkStore, model: Manifest) -> Iterator[PeerServer]:
    put_all(store, model, tmp_path / "src")
    (store.root / "secret").write_text("not a chunk")
    with PeerServer(store, "127.0.0.1") as s:
        yield s


def raw_get(address: str, target: str, headers: str = "") -> tuple[int, bytes]:
    """Send the request line byte for byte: no client-side path normalization."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(
            f"GET {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{headers}\r\n".encode()
        )
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def test_full_and_ranged_gets(server: PeerServer) -> None:
    client = PeerClient(timeout_s=5)
    assert client.fetch(server.address, DIGEST) == DATA
    assert client.fetch(server.address, DIGEST, start=100, end=300) == DATA[100:300]

    conn = http.client.HTTPConnection(server.address, timeout=5)
    conn.request("GET", f"/chunks/sha256/{DIGEST}", headers={"Range": "bytes=10-19"})
    resp = conn.getresponse()
    assert resp.status == 206
    assert resp.getheader("Content-Range") == f"bytes 10-19/{len(DATA)}"
    assert resp.read() == DATA[10:20]
    # Same connection (keep-alive): suffix range, then an unsatisfiable one.
    conn.request("GET", f"/chunks/sha256/{DIGEST}", headers={"Range": "bytes=-5"})
    resp = conn.getresponse()
    assert (resp.status, resp.read()) == (206, DATA[-5:])
    conn.request("GET", f"/chunks/sha256/{DIGEST}", headers={"Range": f"bytes={len(DATA)}-"})
    resp = conn.getresponse()
    assert resp.status == 416
    resp.read()
    conn.close()


def test_head_healthz_and_absent_chunks(server: PeerServer) -> None:
    client = PeerClient(timeout_s=5)
    assert client.has(server.address, DIGEST)
    assert not client.has(server.address, "0" * 64)
    with pytest.raises(ChunkNotOnPeerError):
        client.fetch(server.address, "0" * 64)
    assert raw_get(server.address, "/healthz") == (200, b"ok\n")


@pytest.mark.parametrize(
    "target",
    [
        "/chunks/sha256/../../etc/passwd",
        "/chunks/sha256/%2e%2e/%2e%2e/etc/passwd",
        "/chunks/sha256/..%2f..%2fsecret",
        "/chunks/sha256/%2E%2E%2Fsecret",
        "/chunks/sha256/..%5c..%5csecret",
        f"/chunks/sha256/{DIGEST}/../../../secret",
        f"/chunks/sha256/{DIGEST}%00",
        f"/chunks/sha256/{DIGEST}?x=1",
        f"/chunks/sha256/{DIGEST.upper()}",
        "/secret",
        "/chunks/../secret",
        f"/chunks/sha256/{DIGEST[:-1]}",
    ],
)
def test_anything_but_a_digest_is_rejected(server: PeerServer, target: str) -> None:
    status, body = raw_get(server.address, target)
    assert status == 400
    assert b"not a chunk" not in body


def test_full_server_answers_busy(server: PeerServer) -> None:
    transfers = server._server.transfers
    while transfers.acquire(blocking=False):  # occupy every transfer slot
        pass
    status, _ = raw_get(server.address, f"/chunks/sha256/{DIGEST}")
    assert status == 503
    with pytest.raises(PeerBusyError):
        PeerClient(timeout_s=5).fetch(server.address, DIGEST)
    assert PeerClient(timeout_s=5).has(server.address, DIGEST)  # HEAD needs no slot


def test_refused_connection_is_unavailable() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connections are refused
        with pytest.raises(PeerUnavailableError):
            PeerClient(timeout_s=2).fetch(f"127.0.0.1:{port}", DIGEST)


def test_parse_range() -> None:
    assert parse_range(None, 100) is None
    assert parse_range("bytes=0-9", 100) == (0, 10)
    assert parse_range("bytes=90-", 100) == (90, 100)
    assert parse_range("bytes=90-1000", 100) == (90, 100)
    assert parse_range("bytes=-10", 100) == (90, 100)
    for bad in ("bytes=100-", "bytes=5-2", "bytes=-", "bytes=0-1,3-4", "items=0-1"):
        with pytest.raises(ValueError):
            parse_range(bad, 100)


def test_long_poll_answers_when_the_chunk_lands(
    tmp_path: Path, store: ChunkStore, model: Manifest, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A server may hold a request for an hour here: one that answered at the end of its
    # wait, not when the chunk landed, would hang the test instead of passing it.
    monkeypatch.setattr(peer, "MAX_WAIT_S", 3600.0)
    held = threading.Event()
    wait = store.index.wait

    def spied_wait(key: str, timeout_s: float) -> ChunkLocation | None:
        held.set()  # the server holds the request
        return wait(key, timeout_s)

    monkeypatch.setattr(store.index, "wait", spied_wait)
    store.claims.open([DIGEST], [])  # a stage of it runs here (stage() opens this)
    with PeerServer(store, "127.0.0.1") as server, ModelStaging(store, model) as staging:
        staging.prepare()
        client = PeerClient(timeout_s=5)
        with pytest.raises(ChunkNotOnPeerError):
            client.fetch(server.address, DIGEST, wait_s=0.2)  # nothing lands: 404 after it
        held.clear()
        got: list[bytes] = []
        fetch = threading.Thread(
            target=lambda: got.append(client.fetch(server.address, DIGEST, wait_s=3600))
        )
        fetch.start()
        assert held.wait(10), "the server never held the request"
        staging.put(DIGEST, DATA)
        fetch.join(60)  # answered when it landed: the end of its wait is an hour away
        assert got == [DATA]
        # Served from the partial file, at the chunk's offset, while the file is incomplete.
        assert not (staging.dir / "files" / "b.bin").exists()
        assert client.fetch(server.address, DIGEST, start=5, end=9) == DATA[5:9]


def test_client_reuses_one_connection_per_peer(server: PeerServer) -> None:
    accepted = []
    real = server._server.get_request

    def counting() -> tuple[socket.socket, object]:
        conn = real()
        accepted.append(conn)
        return conn

    server._server.get_request = counting  # type: ignore[method-assign]
    client = PeerClient(timeout_s=5)
    for _ in range(5):
        assert client.fetch(server.address, DIGEST) == DATA
    with pytest.raises(ChunkNotOnPeerError):
        client.fetch(server.address, "0" * 64)
    assert client.fetch(server.address, DIGEST) == DATA
    assert len(accepted) == 1
    # The server closed the idle connection: the client reconnects without an error.
    conns = client._http.conns
    next(iter(conns.values())).sock.shutdown(socket.SHUT_RDWR)
    assert client.fetch(server.address, DIGEST) == DATA
    assert len(accepted) == 2
    client.close()


PEERS = [("node-b", "127.0.0.1:7001"), ("node-c", "127.0.0.1:7002")]


def test_an_owner_grants_a_claim_only_on_a_chunk_it_has_not_started(
    server: PeerServer, store: ChunkStore
) -> None:
    client = PeerClient(timeout_s=5)
    free, started = "1" * 64, "2" * 64
    store.claims.open([free, started, DIGEST], PEERS)
    store.claims.start(started)
    assert client.claim(server.address, free, "node-b") == (True, "node-b")
    assert client.claim(server.address, free, "node-b") == (True, "node-b")  # idempotent
    assert client.claim(server.address, free, "node-c") == (False, "node-b")  # taken
    assert client.claim(server.address, started, "node-c") == (False, None)
    assert client.claim(server.address, DIGEST, "node-c") == (False, None)  # it has it
    # The owner, reaching the chunk it gave away, is told to take it from the claimant.
    assert store.claims.start(free) == "node-b"
    assert store.claims.start(started) is None
    store.claims.forget([free, started])
    assert store.claims.claimant(free) is None


@pytest.mark.parametrize(
    ("target", "node"),
    [
        ("/claims/sha256/" + "A" * 64, "node-b"),  # upper-case hex
        ("/claims/sha256/" + "1" * 64 + "/..", "node-b"),
        ("/chunks/sha256/" + "1" * 64, "node-b"),  # claims have their own path
        ("/claims/sha256/" + "1" * 64, "../etc"),  # not a node name
        ("/claims/sha256/" + "1" * 64, ""),
    ],
)
def test_malformed_claims_are_refused(
    server: PeerServer, store: ChunkStore, target: str, node: str
) -> None:
    host, port = server.address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=5)
    conn.request("POST", target, headers={"X-Weightship-Node": node} if node else {})
    assert conn.getresponse().status == 400
    conn.close()
    assert store.claims.claimant("1" * 64) is None


def claim_from(address: str, sha: str, node: str, source: str = "127.0.0.1") -> int:
    """POST a claim from the loopback address ``source`` (all of 127/8 is this host)."""
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=5, source_address=(source, 0))
    conn.request("POST", f"/claims/sha256/{sha}", headers={"X-Weightship-Node": node})
    status = conn.getresponse().status
    conn.close()
    return status


def test_claims_only_from_known_peers_at_their_own_address_for_wanted_chunks(
    server: PeerServer, store: ChunkStore
) -> None:
    wanted, other, earlier = "1" * 64, "3" * 64, "5" * 64
    # No stage in progress: this node fetches nothing, so any claim is granted; with no
    # stage run yet it knows no peers, so nothing is kept (see the between-stages test).
    assert claim_from(server.address, earlier, "node-b") == 200
    assert store.claims.entries() == 0 and store.claims.remembered() == 0
    store.claims.open([wanted], [("node-b", "127.0.0.1:7001"), ("node-c", "127.0.0.2:7001")])
    assert claim_from(server.address, wanted, "stranger") == 403  # not a peer of the stage
    assert claim_from(server.address, wanted, "node-c") == 403  # node-c is at 127.0.0.2
    assert claim_from(server.address, other, "node-b") == 200  # not a chunk it stages
    assert store.claims.claimant(wanted) is None and store.claims.claimant(other) is None
    assert store.claims.start(other) is None  # an unkept grant binds nothing
    assert claim_from(server.address, wanted, "node-c", source="127.0.0.2") == 200
    assert store.claims.claimant(wanted) == "node-c"
    assert claim_from(server.address, wanted, "node-b") == 409  # taken by node-c
    store.claims.forget([wanted, other])
    assert store.claims.entries() == 0


def test_random_digests_never_grow_the_claim_table(server: PeerServer, store: ChunkStore) -> None:
    from weightship.data import claims

    store.claims.open(["1" * 64], PEERS)
    before = store.claims.entries()
    for i in range(200):
        assert claim_from(server.address, f"{i + 2:064x}", "stranger") == 200  # unkept
    assert store.claims.entries() == before
    # Grants between stages are remembered only for known peers, and boundedly.
    board = claims.ClaimBoard()
    board.open(["1" * 64], [("node-b", "127.0.0.9:7001")])
    board.forget(["1" * 64])
    for i in range(claims.MAX_UNSTAGED_GRANTS + 50):
        assert board.grant_unstaged(f"{i + 2:064x}", "stranger", "127.0.0.9") == "stranger"
        assert board.grant_unstaged(f"{i + 2:064x}", "node-b", "127.0.0.9") == "node-b"
    assert board.remembered() == claims.MAX_UNSTAGED_GRANTS


def test_a_claim_between_stages_binds_the_next_stage_so_the_chunk_leaves_once() -> None:
    """An owner whose stage failed (an S3 error storm) and waits for its retry grants a
    peer's claim: a second claimant is told who has it, and the owner's next stage takes
    it from the claimant (found by e2e/test_faults: chunks claimed meanwhile by two nodes,
    then fetched by the owner too, left the origin two or three times)."""
    from weightship.data import claims

    now = [0.0]
    board = claims.ClaimBoard(clock=lambda: now[0])
    peers = [("node-b", "127.0.0.1:7001"), ("node-c", "127.0.0.2:7001")]
    board.open(["f" * 64], peers)  # an earlier stage: these are this node's peers
    board.forget(["f" * 64])
    mine, spoofed, late = "1" * 64, "2" * 64, "3" * 64
    assert board.grant_unstaged(mine, "node-b", "127.0.0.1") == "node-b"
    assert board.grant_unstaged(mine, "node-c", "127.0.0.2") == "node-b"  # refused: b has it
    assert board.grant_unstaged(mine, "node-b", "127.0.0.1") == "node-b"  # asked again
    # A stranger naming node-c is granted (it fetches nothing here) but kept nowhere.
    assert board.grant_unstaged(spoofed, "node-c", "127.0.0.9") == "node-c"
    assert board.grant_unstaged(spoofed, "node-b", "127.0.0.1") == "node-b"
    assert board.grant_unstaged(late, "node-c", "127.0.0.2") == "node-c"
    now[0] += claims.UNSTAGED_GRANT_HOLD_S - 5
    board.open([mine, late], peers)  # the retry: mine is taken from node-b
    assert board.start(mine) == "node-b"
    assert board.remembered() == 1  # spoofed: not a chunk of this stage
    now[0] += 6  # node-b may have failed before fetching it: the owner waits no longer
    assert board.claimant(mine) is None and board.start(mine) is None
    # A grant older than the hold binds nothing: node-c asked too long ago.
    board2 = claims.ClaimBoard(clock=lambda: now[0])
    board2.open(["f" * 64], peers)
    board2.forget(["f" * 64])
    board2.grant_unstaged(late, "node-c", "127.0.0.2")
    now[0] += claims.UNSTAGED_GRANT_HOLD_S + 1
    assert board2.grant_unstaged(late, "node-b", "127.0.0.1") == "node-b"  # free again
    board2.open([late], [("node-b", "127.0.0.3:7001")])  # node-b moved: its grant is void
    assert board2.start(late) is None


def test_a_grant_made_during_a_stage_that_failed_binds_its_retry() -> None:
    """A peer claimed a chunk while this node's stage ran; the stage then failed (an S3
    error storm). The retry takes the chunk from the claimant, for the rest of the grant's
    TTL, rather than fetch it from the origin a second time (found by e2e/test_faults: 4
    chunks left the origin twice, for the claimant and for the owner's retry)."""
    from weightship.data import claims

    now = [0.0]
    board = claims.ClaimBoard(clock=lambda: now[0])
    peers = [("node-b", "127.0.0.1:7001"), ("node-c", "127.0.0.2:7001")]
    claimed, other = "1" * 64, "2" * 64
    board.open([claimed, other], peers)
    assert board.grant(claimed, "node-b") == "node-b"
    board.forget([claimed, other])  # the stage failed
    assert board.remembered() == 1  # only the grant: the rest of the stage is gone
    assert board.grant_unstaged(claimed, "node-c", "127.0.0.2") == "node-b"  # b has it
    now[0] += claims.GRANT_TTL_S - 10  # past the between-stages hold, within the grant's TTL
    board.open([claimed, other], peers)  # the retry
    assert board.start(claimed) == "node-b"  # taken from node-b, not fetched here
    assert board.start(other) is None
    now[0] += 11  # node-b never made good on it: the owner fetches it itself now
    assert board.start(claimed) is None
    # A grant that ran out before the stage failed is not kept.
    board.forget([claimed, other])
    assert board.remembered() == 0


def test_a_grant_expires_so_the_owner_fetches_it_itself(store: ChunkStore) -> None:
    from weightship.data import claims

    now = [0.0]
    board = claims.ClaimBoard(clock=lambda: now[0])
    board.open(["1" * 64], PEERS)
    assert board.grant("1" * 64, "node-b") == "node-b"
    now[0] += claims.GRANT_TTL_S + 1
    assert board.claimant("1" * 64) is None
    assert board.start("1" * 64) is None  # the owner fetches it now


def test_a_request_trickled_byte_by_byte_is_cut_at_the_deadline(
    tmp_path: Path, store: ChunkStore
) -> None:
    from weightship.httpserver import BoundedHandler, Server

    class Echo(BoundedHandler):
        timeout = 5  # idle timeout per read: the trickle below never trips it

        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

    with Server(("127.0.0.1", 0), Echo, request_deadline_s=1.0).start("echo") as server:
        s = socket.create_connection(("127.0.0.1", server.server_port), timeout=10)
        started = time.monotonic()
        cut = False
        for byte in b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100:
            try:
                s.sendall(bytes([byte]))
                time.sleep(0.1)
            except OSError:
                cut = True
                break
            if time.monotonic() - started > 8:
                break
        if not cut:  # the server shut its side: a read sees the end at once
            s.settimeout(2)
            cut = s.recv(100) == b""
        # Cut: nothing but the request deadline can (the idle timeout never trips at a
        # byte every 0.1 s, and the request never completes).
        assert cut
        s.close()


def test_a_chunk_no_stage_here_fetches_is_not_waited_for(
    store: ChunkStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node outside a rollout's selector stages nothing of it: a request that may wait
    for one of its chunks is answered 404 at once (it will not land), not held."""
    monkeypatch.setattr(peer, "MAX_WAIT_S", 3600.0)  # held, it would hang the test
    with PeerServer(store, "127.0.0.1") as server:
        client = PeerClient(timeout_s=5)
        with pytest.raises(ChunkNotOnPeerError):
            client.fetch(server.address, DIGEST, wait_s=3600)
        with pytest.raises(ChunkNotOnPeerError):
            client.open(server.address, DIGEST, wait_s=3600).close()


def test_a_burst_of_connections_is_queued_not_dropped() -> None:
    """Connections opened while the server is not accepting yet wait in its backlog: a
    SYN that overflowed it would be sent again only after the kernel's 1 s SYN timeout."""
    from weightship.httpserver import BoundedHandler, Server

    server = Server(("127.0.0.1", 0), BoundedHandler)  # not serving: nothing is accepted
    try:
        burst = [
            socket.create_connection(("127.0.0.1", server.server_port), timeout=0.5)
            for _ in range(64)
        ]
        for s in burst:
            s.close()
    finally:
        server.server_close()


def test_connections_over_the_cap_are_refused_not_given_a_thread(
    tmp_path: Path, store: ChunkStore, model: Manifest
) -> None:
    put_all(store, model, tmp_path / "src")
    with PeerServer(store, "127.0.0.1", max_connections=3) as server:
        host, port = server.address.rsplit(":", 1)
        held = [socket.create_connection((host, int(port)), timeout=5) for _ in range(3)]
        time.sleep(0.2)  # the three have their handler threads
        threads = threading.active_count()
        extra = socket.create_connection((host, int(port)), timeout=5)
        assert extra.recv(100).startswith(b"HTTP/1.1 503")
        assert extra.recv(100) == b""
        extra.close()
        assert threading.active_count() == threads
        for s in held:
            s.close()
        time.sleep(0.3)
        assert PeerClient(timeout_s=5).fetch(server.address, DIGEST) == DATA


def hold_uploads(stack: ExitStack, store: ChunkStore, n: int) -> None:
    """Count ``n`` more whole chunks as going up from ``store`` until ``stack`` closes."""
    for _ in range(n):
        stack.enter_context(store.uploads)


def read_body(body: PeerBody, size: int) -> bytes:
    got = bytearray(size)
    end = body.read_into(memoryview(got), 0, lambda n: None)
    body.close()
    return bytes(got[:end])


def test_a_spare_only_request_is_served_only_while_the_uplink_has_room(
    server: PeerServer, store: ChunkStore
) -> None:
    """X-Weightship-Spare: a whole chunk held here is sent; 503 while SPARE_UPLOADS whole
    chunks go up (a plain request is still served); 404 for a chunk not here."""
    client = PeerClient(timeout_s=5)
    assert client.fetch(server.address, DIGEST, spare_only=True) == DATA
    assert read_body(client.open(server.address, DIGEST, spare_only=True), len(DATA)) == DATA
    with pytest.raises(ChunkNotOnPeerError):
        client.open(server.address, "0" * 64, spare_only=True)
    with ExitStack() as uploading:
        hold_uploads(uploading, store, peer.SPARE_UPLOADS)
        with pytest.raises(PeerBusyError):
            client.fetch(server.address, DIGEST, spare_only=True)
        with pytest.raises(PeerBusyError):
            client.open(server.address, DIGEST, spare_only=True)
        assert client.fetch(server.address, DIGEST) == DATA
    assert client.fetch(server.address, DIGEST, spare_only=True) == DATA
    assert store.uploads.count == 0  # every chunk sent was counted only while it went up


def test_whole_chunks_going_up_at_once_are_capped(
    tmp_path: Path, store: ChunkStore, model: Manifest
) -> None:
    """whole_uploads=N: a plain GET of a whole chunk is 503 while N go up, 200 below."""
    put_all(store, model, tmp_path / "src")
    client = PeerClient(timeout_s=5)
    with PeerServer(store, "127.0.0.1", whole_uploads=2) as server, ExitStack() as uploading:
        hold_uploads(uploading, store, 1)
        assert client.fetch(server.address, DIGEST) == DATA
        assert read_body(client.open(server.address, DIGEST), len(DATA)) == DATA
        hold_uploads(uploading, store, 1)
        with pytest.raises(PeerBusyError):
            client.fetch(server.address, DIGEST)
        with pytest.raises(PeerBusyError):
            client.open(server.address, DIGEST)
        assert raw_get(server.address, f"/chunks/sha256/{DIGEST}")[0] == 503
        uploading.close()
        assert client.fetch(server.address, DIGEST) == DATA


def test_a_request_from_below_in_the_tree_is_not_refused_for_the_whole_upload_cap(
    tmp_path: Path, store: ChunkStore, model: Manifest
) -> None:
    """X-Weightship-Below (a node below this one in the chunk's relay tree): a whole chunk
    is sent while whole_uploads go up, where any other asker is answered 503; only
    MAX_TRANSFERS whole chunks at once refuse it. A spare-only request stays spare-only."""
    put_all(store, model, tmp_path / "src")
    client = PeerClient(timeout_s=5)
    with PeerServer(store, "127.0.0.1", whole_uploads=1) as server, ExitStack() as uploading:
        hold_uploads(uploading, store, 1)
        with pytest.raises(PeerBusyError):
            client.open(server.address, DIGEST)
        assert read_body(client.open(server.address, DIGEST, below=True), len(DATA)) == DATA
        with pytest.raises(PeerBusyError):
            client.open(server.address, DIGEST, spare_only=True, below=True)
        hold_uploads(uploading, store, peer.MAX_TRANSFERS - 1)
        with pytest.raises(PeerBusyError):
            client.open(server.address, DIGEST, below=True)
    assert store.uploads.count == 0


def get_claimant(address: str, sha: str) -> tuple[int, str | None]:
    """A plain GET of the chunk: its status and X-Weightship-Claimant header."""
    conn = http.client.HTTPConnection(address, timeout=5)
    conn.request("GET", f"/chunks/sha256/{sha}")
    resp = conn.getresponse()
    resp.read()
    conn.close()
    return resp.status, resp.getheader(peer.CLAIMANT_HEADER)


def test_a_request_for_a_chunk_a_peer_claimed_is_sent_to_the_claimant(
    server: PeerServer, store: ChunkStore
) -> None:
    """An owner with nothing of a chunk it granted answers 404 naming the claimant (not
    with redirect_claimed=False); a granted chunk it holds is served."""
    claimed = "1" * 64
    store.claims.open([claimed, DIGEST], PEERS)
    assert store.claims.grant(claimed, "node-b") == "node-b"
    assert store.claims.grant(DIGEST, "node-b") == "node-b"
    client = PeerClient(timeout_s=5)
    assert get_claimant(server.address, claimed) == (404, "node-b")
    started = time.monotonic()
    with pytest.raises(ChunkNotOnPeerError) as refused:
        client.open(server.address, claimed, wait_s=5)
    assert refused.value.claimant == "node-b"
    assert time.monotonic() - started < 4  # sent on at once, not held for the long poll
    assert client.fetch(server.address, DIGEST) == DATA  # held here: served
    with PeerServer(store, "127.0.0.1", redirect_claimed=False) as plain:
        assert get_claimant(plain.address, claimed) == (404, None)
        with pytest.raises(ChunkNotOnPeerError) as missing:
            client.open(plain.address, claimed)
        assert missing.value.claimant is None


def test_a_whole_chunk_counts_as_going_up_until_it_is_sent(tmp_path: Path) -> None:
    """The server counts each whole chunk it sends (store.uploads) while it sends it, so
    with whole_uploads=1 a second is refused meanwhile."""
    # More than the socket buffers hold (a send buffer grows to tcp_wmem, 4 MiB by default).
    data = random.Random(3).randbytes(16 * 1024 * 1024)
    (tmp_path / "big").mkdir()
    (tmp_path / "big" / "w.bin").write_bytes(data)
    m = build_manifest(LocalFolder(tmp_path / "big"), chunk_size=len(data), version=1)
    store = ChunkStore(tmp_path / "cache")
    put_all(store, m, tmp_path / "big")
    chunk, client = m.chunks[0], PeerClient(timeout_s=5)
    with PeerServer(store, "127.0.0.1", whole_uploads=1) as server:
        host, port = server.address.rsplit(":", 1)
        slow = socket.socket()
        slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a reader far behind
        slow.settimeout(5)
        slow.connect((host, int(port)))
        slow.sendall(f"GET /chunks/sha256/{chunk.hexdigest} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        assert slow.recv(64).startswith(b"HTTP/1.1 200")
        assert store.uploads.count == 1  # going up, stuck behind the reader
        with pytest.raises(PeerBusyError):
            client.fetch(server.address, chunk.key)
        slow.close()  # the reader gives up: that upload ends
        deadline = time.monotonic() + 5
        while store.uploads.count and time.monotonic() < deadline:
            time.sleep(0.01)
        assert client.fetch(server.address, chunk.key) == data
    assert store.uploads.count == 0


def test_a_plain_fetch_keeps_the_claimant_named_by_the_owner(
    server: PeerServer, store: ChunkStore
) -> None:
    """Not only the streamed path: ``fetch`` (a sink that is not in place) learns it too."""
    store.claims.open(["1" * 64], PEERS)
    store.claims.grant("1" * 64, "node-b")
    with pytest.raises(ChunkNotOnPeerError) as refused:
        PeerClient(timeout_s=5).fetch(server.address, "1" * 64)
    assert refused.value.claimant == "node-b"
