"""The peer HTTP server each agent runs, and its client.

The server serves only verified bytes of chunks, addressed by key: the request path
must be exactly ``/chunks/<sha256|blake3>/<64 lowercase hex>``, checked before anything
touches the filesystem, so no request can name any other file. The bytes come from the
model file that holds the chunk (``ChunkStore.open_chunk``: only verified, journaled
ranges).

A GET may carry ``X-Weightship-Wait: <seconds>``: when the chunk is not there yet, the
server holds the request until it lands (at most ``MAX_WAIT_S``; only for a chunk a stage
here fetches: any other will not land), instead of a 404 that
the client would poll again. With ``X-Weightship-Stream: 1`` (cut-through), a chunk this
node is still receiving piece by piece is streamed as its pieces verify here: a chunked
body that carries only the verified prefix as it grows, and may end before the chunk's
end (the client keeps what it got and asks again from there). The client keeps one
HTTP/1.1 connection per peer per thread and reuses it.
"""

from __future__ import annotations

import http.client
import logging
import math
import re
import threading
from collections.abc import Callable
from typing import BinaryIO

from weightship.data.chunkindex import Receiving
from weightship.data.chunkstore import ChunkStore
from weightship.data.httpconn import ThreadConnections, read_some
from weightship.httpserver import BoundedHandler, Server
from weightship.weightformat.bounds import MAX_CHUNK_SIZE
from weightship.weightformat.chunkhash import chunk_key

WAIT_HEADER = "X-Weightship-Wait"
STREAM_HEADER = "X-Weightship-Stream"  # "1": stream a chunk still arriving (cut-through)
# "1": answer only from spare uplink: 503 while another whole chunk is being sent. A node
# asking a holder (not the owner) for a chunk it fell behind on sends it, so late nodes
# spread over the holders with idle uplinks instead of queueing at a busy one.
SPARE_HEADER = "X-Weightship-Spare"
SPARE_UPLOADS = 1  # whole chunks in flight at which a spare-only request is refused
# "1": the asker is below this node in the chunk's relay tree (its child there, or the
# child of a node between them that died or no longer relays): the tree's own flow, never
# refused for WHOLE_UPLOADS (MAX_TRANSFERS bounds it). The nodes below a slow relay that
# stopped relaying are behind by then, and catch up on whole chunks from the node above
# it; refused there while late nodes from all over the fleet took its whole uploads, they
# fell further behind, and every node below them with them (the simulator, 1,000 nodes
# with 5 % slow: 1.96x S/B; slowrelay.py).
BELOW_HEADER = "X-Weightship-Below"
# Whole chunks sent at once at most: a late peer asked for more is answered 503 and asks
# a holder with room, or again; those in flight get a fair share of the uplink each.
WHOLE_UPLOADS = 3
# A stream whose verified prefix has not grown for this long ends; the client asks again.
STREAM_STALL_S = 5.0
# The most a client reads before saying what landed; it says so sooner when fewer bytes
# have come (a slow peer's transfer is seen as slow, and split, on time).
READ_STEP = 256 * 1024
NODE_HEADER = "X-Weightship-Node"  # who claims a chunk
# On a whole chunk's answer: seconds since it landed here in a stage (absent when it was
# found on disk). A child that asks its relay parent for a chunk the parent has held whole
# for a while is that far behind it (slowrelay.py).
HELD_HEADER = "X-Weightship-Held"
# "0" on a 503: this node no longer relays (its link lags): ask above it in the tree.
RELAYING_HEADER = "X-Weightship-Relaying"
CLAIMANT_HEADER = "X-Weightship-Claimant"  # who a refused claim went to
MAX_WAIT_S = 5.0  # the longest a server holds a request for a chunk that is not there
# Transfers a peer server sends at once (streams and whole chunks): past this, 503. The
# fleet simulator answers by the same number.
MAX_TRANSFERS = 32
# Handler threads at once: every worker of a few hundred peers keeping its connection.
MAX_CONNECTIONS = 512
# A whole request, its answer included: a 64 MiB chunk at 10 Mbit/s takes under a minute.
REQUEST_DEADLINE_S = 120.0

log = logging.getLogger(__name__)

CHUNK_PATH = re.compile(r"/chunks/(sha256|blake3)/([0-9a-f]{64})")
CLAIM_PATH = re.compile(r"/claims/(sha256|blake3)/([0-9a-f]{64})")
NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}")  # a Kubernetes node name
_RANGE = re.compile(r"bytes=(\d*)-(\d*)")


class PeerError(Exception):
    """A peer could not serve a chunk."""


class PeerUnavailableError(PeerError):
    """Connection refused, timed out, or closed mid-transfer: treat the peer as dead."""


class PeerBusyError(PeerError):
    """The peer is alive but at its concurrency limit (503)."""


class PeerNotRelayingError(PeerBusyError):
    """503 saying the peer no longer relays: its link lags (slowrelay.py)."""


class ChunkNotOnPeerError(PeerError):
    """The peer is alive but has no verified copy of the chunk (404). ``claimant``: the
    node it let fetch the chunk from the origin (a tail claim), where to ask instead."""

    def __init__(self, message: str, claimant: str | None = None) -> None:
        super().__init__(message)
        self.claimant = claimant


class ChunkBadAtOriginError(ChunkNotOnPeerError):
    """The peer fetched the chunk from the origin and its bytes did not match (410): it
    will not get it, so ask the origin now rather than wait for it."""


def parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """A single ``bytes=`` range as [start, end), None for the whole chunk.

    Raises ValueError when the range is malformed or unsatisfiable.
    """
    if header is None:
        return None
    m = _RANGE.fullmatch(header.strip())
    if not m or m.groups() == ("", ""):
        raise ValueError(f"unsupported range {header!r}")
    first, last = m.groups()
    if first == "":  # suffix: the last N bytes
        start, end = max(0, size - int(last)), size
    else:
        start, end = int(first), size if last == "" else min(size, int(last) + 1)
    if start >= size or start >= end:
        raise ValueError(f"range {header!r} not satisfiable for {size} bytes")
    return start, end


class _Server(Server):
    allow_reuse_address = True

    def __init__(
        self,
        address: tuple[str, int],
        store: ChunkStore,
        max_concurrent: int,
        max_connections: int,
        whole_uploads: int,
        redirect_claimed: bool,
    ) -> None:
        self.store = store
        self.transfers = threading.BoundedSemaphore(max_concurrent)
        self.whole_uploads = whole_uploads
        self.redirect_claimed = redirect_claimed
        super().__init__(
            address,
            _ChunkHandler,
            max_connections=max_connections,
            request_deadline_s=REQUEST_DEADLINE_S,
        )


class _ChunkHandler(BoundedHandler):
    protocol_version = "HTTP/1.1"
    timeout = 30  # seconds a stalled client may hold a handler thread
    server: _Server

    def do_HEAD(self) -> None:
        self._serve(send_body=False)

    def do_GET(self) -> None:
        self._serve(send_body=True)

    def do_POST(self) -> None:
        """``POST /claims/sha256/<hex>``: a peer asks to fetch one of this node's chunks
        from the origin itself (claims.py). 200 granted; 409 refused: this node has it or
        started it, or it went to the node named in X-Weightship-Claimant; 403: a claim on
        a chunk this node is staging from a node that is not a peer of that stage, or
        from another address than its peer endpoint's. A claim on a chunk this node is
        not staging is granted to its first claimant, or refused naming it (claims.py).
        503 saying so once this node stopped relaying (slowrelay.py)."""
        if self.headers.get("Content-Length", "0") != "0":
            self.close_connection = True  # a body we will not read: never reuse the stream
        m = CLAIM_PATH.fullmatch(self.path)
        node = self.headers.get(NODE_HEADER, "")
        if not m or not NODE_NAME.fullmatch(node):
            self._reply(
                400, b"expected /claims/<sha256|blake3>/<64 lowercase hex> and a node name\n"
            )
            return
        sha, board, store = f"{m[1]}:{m[2]}", self.server.store.claims, self.server.store
        if self._not_relaying():
            # Its chunks are fetched by the node standing in for it, which the claimant
            # does not know of: a grant here would send them through the origin twice.
            return
        if store.has_chunk(sha):
            self._reply(409, b"refused\n")  # take it from here
            return
        if not board.wants(sha):
            # Not a chunk this node is fetching: the first claimant may (claims.py).
            first = board.grant_unstaged(sha, node, self.client_address[0])
            status, text = (200, b"granted\n") if first == node else (409, b"refused\n")
            self._reply(status, text, {CLAIMANT_HEADER: first})
            return
        if not board.is_peer(node, self.client_address[0]):
            self._reply(403, b"not a peer of this stage, or not from its peer address\n")
            return
        holder = board.grant(sha, node)
        headers = {CLAIMANT_HEADER: holder} if holder else None
        if holder == node:
            self._reply(200, b"granted\n", headers)
        else:
            self._reply(409, b"refused\n", headers)

    def log_message(self, format: str, *args: object) -> None:
        log.debug("peer %s: " + format, self.client_address[0], *args)

    def _reply(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _serve(self, *, send_body: bool) -> None:
        if self.path == "/healthz":
            self._reply(200, b"ok\n")
            return
        m = CHUNK_PATH.fullmatch(self.path)
        if not m:
            self._reply(400, b"expected /chunks/<sha256|blake3>/<64 lowercase hex>\n")
            return
        key, store = f"{m[1]}:{m[2]}", self.server.store
        if self._not_relaying():
            return
        if self._bad_at_origin(key):
            return
        wait_s = _wait_seconds(self.headers.get(WAIT_HEADER)) if send_body else 0.0
        if wait_s and not store.claims.wants(key) and not store.has_chunk(key):
            # No stage here fetches it (this node is outside the rollout's selector, or
            # done): it will not land, so the asker hears that at once, not after the wait
            # (a node asked first as the one before it in the ring, say).
            wait_s = 0.0
        stream = send_body and self.headers.get(STREAM_HEADER) == "1"
        claimant = store.claims.claimant(key)
        if (
            self.server.redirect_claimed
            and claimant is not None
            and store.index.wait_any(key, 0) is None  # nothing of it here yet
        ):
            # A peer fetches it from the origin (a tail claim it was granted): this node
            # gets it from there too, so send the asker there rather than hold it here.
            self._reply(404, b"chunk not here; ask its claimant\n", {CLAIMANT_HEADER: claimant})
            return
        if stream:
            where = store.index.wait_any(key, wait_s)
            if wait_s and self._not_relaying():  # stopped while this request waited
                return
            if isinstance(where, Receiving):
                claimant = store.claims.claimant(key)
                if self.server.redirect_claimed and claimant is not None:
                    # Claimed while this request waited, and now landing here from the
                    # claimant: the claimant streams it as fast; relayed from here it
                    # would share this (slow) owner's uplink as well.
                    self._reply(
                        404, b"chunk not here; ask its claimant\n", {CLAIMANT_HEADER: claimant}
                    )
                    return
                self._serve_receiving(where)
                return
            found = store.open_location(where) if where is not None else None
        else:
            found = store.open_chunk(key, wait_s=wait_s)
        if found is None:
            if not self._bad_at_origin(key):  # it may have failed while this request waited
                self._reply(404, b"chunk not here\n")
            return
        f, loc = found
        with f:
            if wait_s and self._not_relaying():
                return
            self._serve_chunk(
                f, loc.offset, loc.size, send_body=send_body, held_s=store.index.held_s(key)
            )

    def _not_relaying(self) -> bool:
        """Answer 503 saying so when this node no longer relays (slowrelay.py)."""
        if self.server.store.relaying.relaying:
            return False
        self._reply(503, b"not relaying: this node's link lags\n", {RELAYING_HEADER: "0"})
        return True

    def _bad_at_origin(self, key: str) -> bool:
        """Answer 410 for a chunk this node does not have and found bad at the origin."""
        store = self.server.store
        if not store.claims.is_bad_at_origin(key) or store.has_chunk(key):
            return False
        self._reply(410, b"the origin's bytes of this chunk do not match its digest\n")
        return True

    def _serve_receiving(self, r: Receiving) -> None:
        """Stream the verified prefix of a chunk still arriving, as it grows (chunked
        encoding, so the body may end early: at a stall, or when the receive ends short).
        Never a byte past the verified prefix."""
        loc = r.location
        try:
            span = parse_range(self.headers.get("Range"), loc.size)
        except ValueError:
            self._reply(416, headers={"Content-Range": f"bytes */{loc.size}"})
            return
        start, end = span or (0, loc.size)
        if end != loc.size:  # a stream always runs to the chunk's end
            self._reply(416, headers={"Content-Range": f"bytes */{loc.size}"})
            return
        found = self.server.store.open_location(loc)
        if found is None:
            self._reply(404, b"chunk not here\n")
            return
        if not self.server.transfers.acquire(blocking=False):
            found[0].close()
            self._reply(503, b"busy\n", {"Retry-After": "1"})
            return
        f = found[0]
        try:
            self.send_response(206 if start else 200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.send_header("Content-Range", f"bytes {start}-{loc.size - 1}/{loc.size}")
            self.end_headers()
            sent = start
            while sent < loc.size:
                verified = r.wait_past(sent, STREAM_STALL_S)
                if verified <= sent:
                    break  # stalled or ended short: the client asks again from here
                n = verified - sent
                self.connection.sendall(f"{n:x}\r\n".encode())
                self.connection.sendfile(f, loc.offset + sent, n)
                self.connection.sendall(b"\r\n")
                sent = verified
            self.connection.sendall(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            self.close_connection = True
        finally:
            f.close()
            self.server.transfers.release()

    def _serve_chunk(
        self, f: BinaryIO, offset: int, size: int, *, send_body: bool, held_s: float | None
    ) -> None:
        try:
            span = parse_range(self.headers.get("Range"), size)
        except ValueError:
            self._reply(416, headers={"Content-Range": f"bytes */{size}"})
            return
        if not send_body:
            self._send_head(200, size, size, None, held_s)
            return
        uploads = self.server.store.uploads
        spare_only = self.headers.get(SPARE_HEADER) == "1"
        below = self.headers.get(BELOW_HEADER) == "1"
        limit = whole_upload_limit(self.server.whole_uploads, spare_only, below)
        if not uploads.enter_below(limit):
            self._reply(503, b"uplink busy\n", {"Retry-After": "1"})
            return
        try:
            if not self.server.transfers.acquire(blocking=False):
                self._reply(503, b"busy\n", {"Retry-After": "1"})
                return
            try:
                self._send_chunk(f, offset, size, span, held_s)
            finally:
                self.server.transfers.release()
        finally:
            uploads.leave()

    def _send_head(
        self,
        status: int,
        length: int,
        size: int,
        span: tuple[int, int] | None,
        held_s: float | None,
    ) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(length))
        self.send_header("Accept-Ranges", "bytes")
        if held_s is not None:
            self.send_header(HELD_HEADER, f"{held_s:.3f}")
        if span:
            self.send_header("Content-Range", f"bytes {span[0]}-{span[1] - 1}/{size}")
        self.end_headers()

    def _send_chunk(
        self,
        f: BinaryIO,
        offset: int,
        size: int,
        span: tuple[int, int] | None,
        held_s: float | None,
    ) -> None:
        start, end = span or (0, size)
        self._send_head(206 if span else 200, end - start, size, span, held_s)
        try:
            self.connection.sendfile(f, offset + start, end - start)
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            self.close_connection = True


def whole_upload_limit(whole_uploads: int, spare_only: bool, below: bool = False) -> int:
    """Whole chunks a peer server may be sending when it takes one more request for a
    whole chunk (503 at this many): ``whole_uploads``, ``SPARE_UPLOADS`` for a spare-only
    request (a holder probe), ``MAX_TRANSFERS`` for one from below this node in the
    chunk's tree (``BELOW_HEADER``). The fleet simulator answers by the same rule."""
    if spare_only:
        return SPARE_UPLOADS
    return MAX_TRANSFERS if below else whole_uploads


def _wait_seconds(header: str | None) -> float:
    try:
        return min(MAX_WAIT_S, max(0.0, float(header))) if header else 0.0
    except ValueError:
        return 0.0


class PeerServer:
    """Serves this node's verified chunks to other agents.

    ``max_concurrent`` bounds the transfers in flight (a request held by the long-poll
    takes no slot until its chunk lands); 32 covers every worker of a few dozen peers.
    ``whole_uploads`` bounds those of whole chunks (peers that fell behind; a stream of a
    chunk still landing is not one). ``redirect_claimed``: a request for a chunk a peer
    claimed (nothing of which is here yet) is sent to that peer (404 naming it) rather
    than held here, as is a request held here when the chunk starts landing from that
    peer (never relayed through this node); off only for the benchmark's baseline.
    ``max_connections`` bounds the connections (so the threads) held at once."""

    def __init__(
        self,
        store: ChunkStore,
        host: str,
        port: int = 0,
        max_concurrent: int = MAX_TRANSFERS,
        max_connections: int = MAX_CONNECTIONS,
        whole_uploads: int = WHOLE_UPLOADS,
        redirect_claimed: bool = True,
    ) -> None:
        self._server = _Server(
            (host, port), store, max_concurrent, max_connections, whole_uploads, redirect_claimed
        )

    @property
    def address(self) -> str:
        host, port = self._server.server_address[:2]
        return f"{host!s}:{port}"

    def start(self) -> PeerServer:
        self._server.start("weightship-peer", poll_interval_s=0.05)
        return self

    def stop(self) -> None:
        self._server.stop(timeout_s=5)

    def __enter__(self) -> PeerServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class PeerClient:
    """Fetches chunks from other agents' peer servers. Every call is bounded by a timeout.

    Keeps one keep-alive connection per peer per thread, so a chunk does not pay a TCP
    handshake and slow start each time. A reused connection that the server has closed
    meanwhile (idle timeout) is retried once on a fresh one."""

    def __init__(self, timeout_s: float = 10.0) -> None:
        self.timeout_s = timeout_s
        self._http = ThreadConnections(timeout_s)
        self._probes = ThreadConnections(timeout_s)  # held(), beside a stream in flight

    def fetch(
        self,
        address: str,
        key: str,
        *,
        start: int = 0,
        end: int | None = None,
        wait_s: float = 0.0,
        spare_only: bool = False,
    ) -> bytes:
        """The whole verified chunk's bytes [start, end). ``wait_s`` > 0 lets the peer
        hold the request that long for a chunk it does not have yet; ``spare_only``: only
        while its uplink has room (503 otherwise)."""
        headers = {SPARE_HEADER: "1"} if spare_only else {}
        if start or end is not None:
            headers["Range"] = f"bytes={start}-{'' if end is None else end - 1}"
        if wait_s > 0:
            headers[WAIT_HEADER] = f"{wait_s:.3f}"
        asked = MAX_CHUNK_SIZE if end is None else end - start
        status, body = self._request("GET", address, key, headers, self.timeout_s + wait_s, asked)
        if status not in (200, 206):
            raise PeerError(f"{address} answered {status} for chunk {key}")
        return body

    def open(
        self,
        address: str,
        key: str,
        *,
        start: int = 0,
        wait_s: float = 0.0,
        spare_only: bool = False,
        below: bool = False,
    ) -> PeerBody:
        """Ask for the chunk's bytes from ``start`` on, streamed if the peer is still
        receiving it (cut-through), unless ``spare_only``: then only a chunk the peer holds
        whole, and only while its uplink has room (404, or 503 while it sends another).
        ``below``: this node is below the peer in the chunk's relay tree (``BELOW_HEADER``).
        Returns the body to read; raises ChunkNotOnPeerError, PeerBusyError,
        PeerUnavailableError or PeerError as ``fetch`` does."""
        headers = {SPARE_HEADER: "1"} if spare_only else {STREAM_HEADER: "1"}
        if below and not spare_only:
            headers[BELOW_HEADER] = "1"
        if start:
            headers["Range"] = f"bytes={start}-"
        if wait_s > 0:
            headers[WAIT_HEADER] = f"{wait_s:.3f}"
        target = _chunk_target(key)
        try:
            resp = self._http.request(
                "GET", address, target, headers, timeout_s=self.timeout_s + wait_s
            )
        except (OSError, http.client.HTTPException) as exc:
            raise PeerUnavailableError(f"{address}: {exc!r}") from exc
        if resp.status == 206 or (resp.status == 200 and not start):
            return PeerBody(self._http, address, resp, start)
        if resp.status == 200:  # the whole chunk where a range was asked: never misplace it
            self._http.drop("http", address)
            raise PeerError(f"{address} ignored the range from {start} of chunk {key}")
        _read_to_end(self._http, address, resp)
        if resp.status == 410:
            raise ChunkBadAtOriginError(f"{address} found chunk {key} bad at the origin")
        if resp.status == 404:
            claimant = resp.getheader(CLAIMANT_HEADER)
            raise ChunkNotOnPeerError(f"{address} has no chunk {key}", claimant)
        if resp.status == 503:
            raise _busy(address, resp)
        raise PeerError(f"{address} answered {resp.status} for chunk {key}")

    def has(self, address: str, key: str) -> bool:
        try:
            status, _ = self._request("HEAD", address, key, {}, self.timeout_s)
        except ChunkNotOnPeerError:
            return False
        return status == 200

    def held(self, address: str, key: str) -> float | None:
        """How long the peer has held the chunk whole (``HELD_HEADER``, a HEAD), on a
        connection of its own: this thread's usual one to ``address`` may be carrying a
        stream of the same chunk. None when the peer does not hold it whole."""
        try:
            resp = self._probes.request(
                "HEAD", address, _chunk_target(key), {}, timeout_s=self.timeout_s
            )
        except (OSError, http.client.HTTPException) as exc:
            raise PeerUnavailableError(f"{address}: {exc!r}") from exc
        _read_to_end(self._probes, address, resp)
        if resp.status == 503:
            raise _busy(address, resp)
        return held_seconds(resp.getheader(HELD_HEADER)) if resp.status == 200 else None

    def claim(self, address: str, key: str, node: str) -> tuple[bool, str | None]:
        """Ask the owner at ``address`` to let ``node`` fetch the chunk from the origin.
        Returns (granted, the node it went to instead when one did)."""
        target = _chunk_target(key).replace("/chunks/", "/claims/", 1)
        status, _, holder = self._call("POST", address, target, {NODE_HEADER: node}, self.timeout_s)
        return status == 200, holder

    def close(self) -> None:
        """Close this thread's connections."""
        self._http.close()
        self._probes.close()

    def _request(
        self,
        method: str,
        address: str,
        key: str,
        headers: dict[str, str],
        timeout_s: float,
        max_bytes: int = MAX_CHUNK_SIZE,
    ) -> tuple[int, bytes]:
        target = _chunk_target(key)
        status, body, claimant = self._call(method, address, target, headers, timeout_s, max_bytes)
        if status == 410:
            raise ChunkBadAtOriginError(f"{address} found chunk {key} bad at the origin")
        if status == 404:
            raise ChunkNotOnPeerError(f"{address} has no chunk {key}", claimant)
        return status, body

    def _call(
        self,
        method: str,
        address: str,
        target: str,
        headers: dict[str, str],
        timeout_s: float,
        max_bytes: int = MAX_CHUNK_SIZE,
    ) -> tuple[int, bytes, str | None]:
        """One request and its whole answer, of ``max_bytes`` at most (PeerError past it:
        a peer never sends more than the range or the chunk asked for)."""
        try:
            resp = self._http.request(method, address, target, headers, timeout_s=timeout_s)
            if resp.length is not None and resp.length > max_bytes:
                body = b""
            else:  # raises IncompleteRead when the peer closes mid-transfer
                body = resp.read(max_bytes + 1) if resp.length is None else resp.read()
        except (OSError, http.client.HTTPException) as exc:
            self._http.drop("http", address)
            raise PeerUnavailableError(f"{address}: {exc!r}") from exc
        if not resp.isclosed() or len(body) > max_bytes:
            self._http.drop("http", address)
            raise PeerError(f"{address} answered more than the {max_bytes} bytes asked")
        self._http.done("http", address, resp)
        if resp.status == 503:
            raise _busy(address, resp)
        return resp.status, body, resp.getheader(CLAIMANT_HEADER)


def _busy(address: str, resp: http.client.HTTPResponse) -> PeerBusyError:
    """The error for a 503: the peer stopped relaying, or is at a limit."""
    if resp.getheader(RELAYING_HEADER) == "0":
        return PeerNotRelayingError(f"{address} no longer relays (its link lags)")
    return PeerBusyError(f"{address} is busy")


def _read_to_end(pool: ThreadConnections, address: str, resp: http.client.HTTPResponse) -> None:
    """Read the rest of a short answer; keep its connection when the server does."""
    try:
        resp.read()
    except (OSError, http.client.HTTPException) as exc:
        pool.drop("http", address)
        raise PeerUnavailableError(f"{address}: {exc!r}") from exc
    pool.done("http", address, resp)


def held_seconds(value: str | None) -> float | None:
    """A ``HELD_HEADER`` value: seconds, finite and not negative; None otherwise."""
    try:
        held = float(value or "nan")
    except ValueError:
        return None
    return held if 0.0 <= held < math.inf else None


def _chunk_target(key: str) -> str:
    algorithm, _, hex_digest = chunk_key(key).partition(":")
    return f"/chunks/{algorithm}/{hex_digest}"


class PeerBody:
    """The body of one chunk answer, read straight into the chunk's place."""

    def __init__(
        self, http: ThreadConnections, address: str, resp: http.client.HTTPResponse, start: int
    ) -> None:
        self._http, self.address, self._resp, self.start = http, address, resp, start
        self._finished = False

    @property
    def whole(self) -> bool:
        """The peer sent the chunk whole (a sized answer, not a stream of it landing)."""
        return not self._resp.chunked

    @property
    def held_s(self) -> float | None:
        """How long the peer had held the chunk whole (``HELD_HEADER``), if it said."""
        return held_seconds(self._resp.getheader(HELD_HEADER))

    def read_into(
        self,
        view: memoryview,
        begin: int,
        landed: Callable[[int], None],
        stop_at: Callable[[int], int] | None = None,
    ) -> int:
        """Read the body into ``view[begin:]``, calling ``landed(n)`` after each step with
        bytes [0, n) in; return the end reached. A stream may end before ``len(view)``
        (cleanly: not an error); a body cut short raises PeerUnavailableError.
        ``stop_at(n)``, asked before each step: where to stop reading (the rest of the
        body is not read, and the connection is dropped)."""
        if begin != self.start:
            raise PeerError(f"asked {self.address} from {self.start}, reading from {begin}")
        resp, pos = self._resp, begin
        try:
            while pos < (stop := len(view) if stop_at is None else min(len(view), stop_at(pos))):
                n = read_some(resp, view[pos : min(stop, pos + READ_STEP)])
                if not n:
                    break
                pos += n
                landed(pos)
            if pos < len(view) and stop_at is not None and pos >= stop_at(pos):
                self.close()  # stopped on purpose: the rest is not wanted
                return pos
            if not resp.chunked and resp.length:  # Content-Length not met: cut short
                raise http.client.IncompleteRead(b"", resp.length)
            if resp.chunked and pos == len(view):
                resp.read()  # the terminating chunk, so the connection can be reused
        except (OSError, http.client.HTTPException) as exc:
            self.close()
            raise PeerUnavailableError(f"{self.address}: {exc!r}") from exc
        if resp.isclosed():
            self._finished = True
            self._http.done("http", self.address, resp)
        return pos

    def close(self) -> None:
        """Drop the connection unless the body was read to its end."""
        if not self._finished:
            self._finished = True
            self._http.drop("http", self.address)
