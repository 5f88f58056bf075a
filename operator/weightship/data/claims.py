"""Tail stealing without a coordinator: an owner hands one of its chunks to a peer.

The origin link is shared, and TCP shares it unevenly: one owner's origin stream can
finish a third later than the others', and every node then waits on its last chunks. A
node whose own origin queue is done may ask a slow owner for one of the chunks it is
waiting on. The owner grants the claim only if it has not started fetching that chunk,
so the chunk still leaves the origin once: the claimant fetches it from the origin, and
the owner takes it from the claimant like any peer chunk.

The board lives on the node's ChunkStore: the peer server grants claims on it, and the
stage's fetcher consults it before each of its own origin fetches.

A claim may reach an owner between two stages of the model (its last stage failed, say
in an S3 error storm, and waits to be retried): it is granted, since that owner fetches
nothing then. When it comes from a node that was a peer of this node's stages, asking
from that peer's address, it is also remembered for a short while (bounded): another
claimant of that chunk is told who has it, and the owner's next stage takes the chunk
from the claimant; either way it leaves the origin once, not two or three times. A grant
made during a stage that then failed is kept the same way, for the rest of its TTL.
"""

from __future__ import annotations

import ipaddress
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable

from weightship.weightformat.chunkhash import chunk_key

# A grant the claimant has not made good on by then no longer holds: the owner fetches
# the chunk itself rather than wait on a claimant that died or lied.
GRANT_TTL_S = 120.0
# Grants on chunks of no stage in progress, remembered: at most MAX_UNSTAGED_GRANTS (the
# oldest go first), each for UNSTAGED_GRANT_HOLD_S. Short, since the claimant's own stage
# may fail before it fetched the chunk: then others and the owner fetch it soon after.
MAX_UNSTAGED_GRANTS = 4096
MAX_BAD_AT_ORIGIN = 4096
UNSTAGED_GRANT_HOLD_S = 30.0


def peer_host(address: str) -> str | None:
    """The IP of a ``host:port`` peer address, normalized (None when not an IP literal:
    a claim's source is checked against it, and names are never resolved here)."""
    host = address.rsplit(":", 1)[0].strip("[]")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    mapped = getattr(ip, "ipv4_mapped", None)
    return str(mapped or ip)


class ClaimBoard:
    """This node's chunks that it started fetching from the origin, and the ones it gave
    away to a claimant. Thread-safe; the check and the mark are one atomic step.

    Claims on the chunks of a model this node is staging (``open``) are taken only from
    the peers that stage was given, each asking from its own peer address, so a stranger
    cannot make an owner skip the origin. A claim on any other chunk is granted without
    being kept (this node is not fetching it, so nothing needs remembering): the table
    stays bounded by the chunks being staged, whatever digests are sent."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._lock = threading.Lock()
        self._clock = clock
        self._started: set[str] = set()
        self._granted: dict[str, tuple[str, float]] = {}  # sha256 -> (claimant, granted at)
        self._wanted: Counter[str] = Counter()  # chunks of the models being staged
        self._peers: dict[str, str | None] = {}  # node -> the IP its claims must come from
        # The peers of the stages this node ran (node -> IP), kept between stages: who may
        # claim a chunk then and be remembered (bounded by the fleet's size).
        self._known: dict[str, str | None] = {}
        # Grants made between stages: sha256 -> (claimant, its IP, granted at).
        self._unstaged: OrderedDict[str, tuple[str, str, float]] = OrderedDict()
        # Chunks whose origin bytes failed verification here (oldest first, bounded).
        self._bad_at_origin: OrderedDict[str, None] = OrderedDict()

    def open(self, digests: Iterable[str], peers: Iterable[tuple[str, str]]) -> None:
        """A stage of these chunks begins, with these (node, address) peers. Undone by
        ``forget`` of the same digests."""
        with self._lock:
            keys = {chunk_key(d) for d in digests}
            self._wanted.update(keys)
            hosts = {node: peer_host(address) for node, address in peers}
            self._peers.update(hosts)
            self._known.update(hosts)
            now = self._clock()
            for sha in keys & self._unstaged.keys():
                claimant, host, at = self._unstaged.pop(sha)
                # A grant made between stages binds this stage for what is left of its
                # hold, when the claimant is a peer of it at the address it asked from.
                live = now - at <= UNSTAGED_GRANT_HOLD_S
                if live and sha not in self._granted and hosts.get(claimant) == host:
                    self._granted[sha] = (claimant, at + UNSTAGED_GRANT_HOLD_S - GRANT_TTL_S)

    def start(self, sha256: str) -> str | None:
        """This node is about to fetch ``sha256`` from the origin. Returns the node it was
        granted to instead (then this node must not fetch it), else marks it started."""
        sha256 = chunk_key(sha256)
        with self._lock:
            claimant = self._live_claimant(sha256)
            if claimant is None:
                self._started.add(sha256)
            return claimant

    def failed_at_origin(self, sha256: str) -> None:
        """This node fetched ``sha256`` from the origin and its bytes did not match: the
        peer server tells whoever waits for it here (410), so they go to the origin
        themselves at once instead of waiting for the owner. Kept across stages (the
        failed stage is over by the time they ask), bounded."""
        sha256 = chunk_key(sha256)
        with self._lock:
            self._bad_at_origin[sha256] = None
            self._bad_at_origin.move_to_end(sha256)
            while len(self._bad_at_origin) > MAX_BAD_AT_ORIGIN:
                self._bad_at_origin.popitem(last=False)

    def is_bad_at_origin(self, sha256: str) -> bool:
        sha256 = chunk_key(sha256)
        with self._lock:
            return sha256 in self._bad_at_origin

    def wants(self, sha256: str) -> bool:
        """Whether ``sha256`` is a chunk of a model this node is staging."""
        sha256 = chunk_key(sha256)
        with self._lock:
            return sha256 in self._wanted

    def is_peer(self, node: str, source: str) -> bool:
        """Whether ``node`` is a peer of a stage in progress asking from IP ``source``,
        its peer endpoint's address."""
        with self._lock:
            host = self._peers.get(node)
            return host is not None and host == peer_host(f"{source}:0")

    def grant(self, sha256: str, node: str) -> str | None:
        """``node`` asks to fetch ``sha256`` from the origin itself. Returns who fetches it:
        ``node`` when granted (again, if it asked before), or the node already granted.
        None when this node started it (the claimant should keep waiting for it here), or
        when the chunk is not one this node is staging."""
        sha256 = chunk_key(sha256)
        with self._lock:
            if sha256 in self._started or sha256 not in self._wanted:
                return None
            holder = self._live_claimant(sha256)
            if holder is None:
                self._granted[sha256] = (node, self._clock())
                holder = node
            return holder

    def grant_unstaged(self, sha256: str, node: str, source: str) -> str:
        """``node``, asking from IP ``source``, claims a chunk of no stage in progress here.
        Returns who fetches it: ``node`` (granted: this node fetches nothing now), or the
        node a live remembered grant went to. Only a peer of this node's stages asking
        from its own address is remembered; anyone else is granted and forgotten, so a
        stranger naming a node can neither bind this node nor turn real claimants away."""
        sha256 = chunk_key(sha256)
        with self._lock:
            now = self._clock()
            held = self._unstaged.get(sha256)
            if held is not None and now - held[2] <= UNSTAGED_GRANT_HOLD_S:
                return held[0]
            host = self._known.get(node)
            if host is None or host != peer_host(f"{source}:0"):
                return node
            self._hold_unstaged(sha256, node, host, now)
            return node

    def remembered(self) -> int:
        """Grants made between stages, kept for the next one (at most MAX_UNSTAGED_GRANTS)."""
        with self._lock:
            return len(self._unstaged)

    def claimant(self, sha256: str) -> str | None:
        sha256 = chunk_key(sha256)
        with self._lock:
            return self._live_claimant(sha256)

    def forget(self, digests: Iterable[str]) -> None:
        """Drop a finished stage's entries (the peer server refuses claims on chunks this
        node holds, so nothing is granted twice). A live grant of a stage that failed
        (an S3 error storm, say) outlives it: it is kept as a grant between stages for
        the rest of its TTL, so the next stage takes the chunk from its claimant instead
        of fetching it from the origin again."""
        with self._lock:
            for sha in {chunk_key(d) for d in digests}:
                self._started.discard(sha)
                claimant = self._live_claimant(sha)  # an expired grant is dropped here
                granted = self._granted.pop(sha, None)
                host = self._known.get(claimant) if claimant else None
                if claimant and host and granted:
                    # Held between stages until it expires (open binds it again).
                    self._hold_unstaged(
                        sha, claimant, host, granted[1] + GRANT_TTL_S - UNSTAGED_GRANT_HOLD_S
                    )
                self._wanted[sha] -= 1
                if self._wanted[sha] <= 0:
                    del self._wanted[sha]
            if not self._wanted:
                self._peers.clear()

    def entries(self) -> int:
        """Entries held (started, granted and wanted chunks). Not ``__len__``: an empty
        board must stay truthy (``claims or ClaimBoard()``)."""
        with self._lock:
            return len(self._started) + len(self._granted) + len(self._wanted)

    def _hold_unstaged(self, sha256: str, claimant: str, host: str, at: float) -> None:
        """Remember a grant between stages, live until ``at + UNSTAGED_GRANT_HOLD_S``; the
        oldest goes first beyond MAX_UNSTAGED_GRANTS. Called with the lock held."""
        self._unstaged[sha256] = (claimant, host, at)
        self._unstaged.move_to_end(sha256)
        while len(self._unstaged) > MAX_UNSTAGED_GRANTS:
            self._unstaged.popitem(last=False)

    def _live_claimant(self, sha256: str) -> str | None:
        granted = self._granted.get(sha256)
        if granted is None:
            return None
        if self._clock() - granted[1] > GRANT_TTL_S:
            del self._granted[sha256]
            return None
        return granted[0]
