import hashlib
import http.client
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from weightship.data.chunkstore import ChunkStore
from weightship.data.peer import (
    ChunkNotOnPeerError,
    PeerBusyError,
    PeerClient,
    PeerServer,
    PeerUnavailableError,
    parse_range,
)

DATA = bytes(range(256)) * 40
DIGEST = hashlib.sha256(DATA).hexdigest()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[PeerServer]:
    store = ChunkStore(tmp_path)
    store.put_chunk(DIGEST, DATA)
    (tmp_path / "secret").write_text("not a chunk")
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
