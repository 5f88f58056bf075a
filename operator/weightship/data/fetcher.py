"""Coordinator-free chunk fetching.

Every node computes the same owner for each chunk from the manifest and the node set
(rendezvous hashing with bounded loads: each node owns at most ceil(chunks / nodes)).
The owner fetches from origin; the others ask the owner (a long-poll: the owner's peer
server holds the request until the chunk lands, up to ``long_poll_s``), then the next
peers in the chunk's rendezvous ranking, falling through on timeouts, dead peers and
404s, waiting a bounded time for the owner, and going to origin last. A dead owner drops
out of the ranking, so the next node takes over without anyone deciding it. Every byte
is verified before it is stored.

At the tail, a node whose own origin queue is done claims chunks it has waited on from
their slow owner and fetches them from the origin itself; the owner grants only chunks
it has not started, so each still leaves the origin once (claims.py).

A node that starts after the others (they listed their peers without it) would own its
share in its own view, and nobody else's view: it would fetch that share from the origin
a second time. So before it plans, it asks (HEAD) the nodes that own its first chunks in
the view without it; if one holds a chunk this node owns, nobody counted it, and it
takes that view (``join_late``): it owns nothing and takes every chunk from the node that
fetches it, falling back to the origin only when no live node has or gets it in time.
"""

from __future__ import annotations

import logging
import math
import sys
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

from weightship.data import rendezvous, schedule
from weightship.data.chunkstore import Buffer
from weightship.data.claims import ClaimBoard
from weightship.data.metrics import DataPlaneMetrics
from weightship.data.modelstaging import ChunkIncompleteError, Fill, ResumeMovedError
from weightship.data.peer import (
    ChunkBadAtOriginError,
    ChunkNotOnPeerError,
    PeerBusyError,
    PeerClient,
    PeerError,
    PeerNotRelayingError,
    PeerUnavailableError,
)
from weightship.data.slowrelay import LAG_S, RelayStatus, lags
from weightship.data.split import SplitPieceError, SplitTransfer
from weightship.weightformat.chunkhash import ChunkVerificationError, PieceVerificationError
from weightship.weightformat.entries import ChunkEntry

log = logging.getLogger(__name__)

Source = Literal["origin", "peer", "local"]


SPLITS_IN_FLIGHT = 2  # second parts of split transfers fetched at once, per node
# A peer that refused connections this often is dropped for the rest of the stage.
DROP_AFTER_DEATHS = 2
# The smallest origin read step (a manifest may have smaller pieces: they are verified
# a few at a time then, and a tiny piece size never means a read call per few bytes).
MIN_ORIGIN_STEP = 64 * 1024
# A new origin connection per chunk (FetchPolicy.renew_origin_connections) only where the
# chunk's transfer took this many times its first-byte latency (about a round trip) or
# more: a new flow's slow start costs a few round trips, small beside that; on a long,
# fast path (a far region) it would cost more than the chunk, and the connection is kept.
RENEW_AFTER_ROUND_TRIPS = 10


class ChunkOrigin(Protocol):
    def read_range(self, path: str, offset: int, size: int) -> Buffer: ...


@runtime_checkable
class FillingOrigin(Protocol):
    """An origin that reads a range into the caller's memory (``S3Origin``), saying
    after each read how many bytes are in (``landed``), so pieces can be checked as
    they arrive."""

    def read_range_into(
        self,
        path: str,
        offset: int,
        view: memoryview,
        landed: Callable[[int], None] | None = None,
        step: int = ...,
    ) -> None: ...


@runtime_checkable
class RenewableOrigin(Protocol):
    """An origin whose connection the calling thread can replace (``S3Origin``)."""

    def last_read(self) -> tuple[float, float] | None: ...

    def renew_connection(self) -> None: ...


@runtime_checkable
class InPlaceSink(Protocol):
    """A sink that lets a source write a chunk straight into its place and verifies it
    as it lands (``ModelStaging.receive``)."""

    def receive(self, key: str, fill: Fill, *, start: int | None = None) -> int: ...

    def resume_point(self, key: str) -> int: ...

    @property
    def piece_size(self) -> int | None: ...


class ChunkSink(Protocol):
    """Where verified chunks go (``ModelStaging``)."""

    def has(self, key: str) -> bool: ...

    def put(self, key: str, data: Buffer, *, verified_digest: str | None = None) -> int:
        """Verify and store; raise ChunkVerificationError on a mismatch."""
        ...


class FetchCancelledError(RuntimeError):
    """The stage this fetch belongs to was cancelled."""


class OriginMismatchError(ChunkVerificationError):
    """The origin's bytes of one chunk do not match the manifest, in every attempt: the
    weights changed after the manifest was written. Every node reading that chunk gets
    the same bytes, so this is not worth retrying (unlike a short read or a bad peer)."""

    def __init__(self, chunk: ChunkEntry) -> None:
        super().__init__(
            f"origin bytes of {chunk.file} chunk {chunk.index} (offset {chunk.offset}) do not "
            f"match the manifest's {chunk.algorithm} {chunk.hexdigest}: the weights changed "
            "after the manifest was written; re-run `weightship manifest`"
        )
        self.file, self.index, self.offset = chunk.file, chunk.index, chunk.offset


@dataclass(frozen=True)
class Peer:
    node: str  # stable identity (the node name): ranking survives pod IP changes
    address: str  # host:port of the node's peer server


@dataclass(frozen=True)
class FetchPolicy:
    peer_timeout_s: float = 10.0
    owner_wait_s: float = 120.0  # per chunk, then origin
    # Between rounds that did not long-poll (every peer answered at once: busy, or not
    # there). 0.2 s until 2026-12-07: at 100 Gbit/s a stage of 16 GiB lasts 1.4 s, and
    # each such pause cost a seventh of it (the simulator, 1,000 nodes: 1.50x S/B with
    # 0.2 s, 1.35x with 0.05 s; 10 % killed 1.88x -> 1.79x; 10 Gbit/s 1.16x either way,
    # with as many asks). The fleet benchmark, 16 hosts: 1.18x against 1.19x.
    poll_interval_s: float = 0.05
    # How long the owner may hold a request for a missing chunk (its server caps it at 5):
    # a request for an owner's next chunk waits out the one it is fetching, and one that
    # expires first is away asking others when the chunk starts landing (the fleet
    # benchmark, 8 rounds each interleaved: 1.16x S/B at 4.5 s, 1.18x at 2 s).
    long_poll_s: float = 4.5
    peers_per_round: int = 3  # the owner plus the next peers asked each round
    # Peers asked, before the owner, whether they hold the chunk whole (no wait): a node
    # that fell behind on an owner takes those chunks from the nodes that already have
    # them, so the owner's uplink is not the one source of every late node (0: never).
    holder_probes: int = 2
    # A node holds back its next own origin chunk, this long at most, while its uplink is
    # busy sending whole chunks to peers that fell behind (stage.hold_for_uplink; 0: never).
    uplink_hold_s: float = 2.0
    # A whole chunk coming from one peer that, after split_after_s, would take more than
    # split_eta_s more at its rate so far has its last part asked of another peer at the
    # same time (split.py; the first of split_peers that sends it; None: never split).
    # For a peer that trickles (a degraded link): the fleet benchmark was no faster
    # splitting its slow transfers (docs/benchmarks.md), so only very slow ones are split.
    split_after_s: float | None = 2.0
    split_eta_s: float = 5.0
    split_peers: int = 2
    dead_cooldown_s: float = 30.0
    demote_cooldown_s: float = 600.0
    origin_attempts: int = 2  # verification failures tolerated from origin
    # Once this node's own origin queue is done, it claims slow owners' chunks and
    # fetches them from the origin here (claim_tails; False: never).
    claims: bool = True
    # A node joining late waits this long at most (per chunk) for a chunk that it owns in
    # its own view, before it fetches it from the origin: the others may count it after
    # all, and then wait for it (owner_wait_s bounds every other chunk).
    late_wait_s: float = 30.0
    late_probes: int = 3  # chunks of its own it asks about at stage start (HEAD, no wait)
    # Relays (schedule.py): a chunk this node does not own is asked first of its parent
    # in the owner's tree (a fanout-ary heap over the stage's nodes, rotated to start at
    # the owner; a dead parent skipped for its own), which streams it on as it lands,
    # waiting this long at most for it to start landing there; then its owner (None:
    # owners only). Each uplink carries one stream of the others' chunks on average,
    # whatever share of the origin each owner gets, and a chunk crosses about log2(n)
    # hops. Fanout 1 is the ring of before (n - 1 hops; docs/benchmarks.md).
    relay_wait_s: float | None = 4.5
    relay_fanout: int = 2
    # At most this many nodes fetch chunks from the origin (schedule.origin_fetchers):
    # every node follows every chunk that is arriving, and a peer lane follows a bounded
    # number at once (stage.PEER_LANE_MAX), so the origin's streams must not grow with n.
    origin_fetchers: int = 8
    # With peers, each origin chunk on a new connection (where that is cheap:
    # RENEW_AFTER_ROUND_TRIPS). The owners' origin flows share one origin link, and a
    # flow that starts with a small share keeps it while its connection lives (BBR keeps
    # its estimates, and the winners keep theirs): owners with 4-6 origin chunks beside
    # owners with 22-27, the others waiting on the slow ones' chunks. New flows for every
    # chunk share it afresh each time (the fleet benchmark: 12-20 chunks each, 1.09x S/B
    # against 1.12x; renewing only the starved flows did not help: 1.13x).
    renew_origin_connections: bool = True


class PeerHealth:
    """Peers this node currently avoids: dead (unreachable) or demoted (bad bytes).

    One per stage. A peer found dead is avoided for a cooldown. One that refused the
    connection (nothing listens there: the node or its agent is gone) is asked again once
    after it (an agent restarting comes back on the same node name), and, refused again,
    dropped for the rest of the stage: it is not retried every cooldown, by every node,
    for as long as the stage lasts. A timeout or a transfer cut short is no proof of
    death (a busy peer, a slow relay), and costs a cooldown only."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._avoid_until: dict[str, float] = {}
        self._found_dead: set[str] = set()  # avoided for a death, not a demotion
        self._lock = threading.Lock()
        self.demotions: dict[str, int] = {}
        self.deaths: dict[str, int] = {}

    def mark_dead(self, node: str, cooldown_s: float, *, refused: bool = False) -> bool:
        """Avoid ``node``; whether it is now dropped for the rest of the stage."""
        with self._lock:
            now = self._clock()
            if self._avoid_until.get(node, 0.0) <= now:  # else the same death, seen again
                if refused:
                    self.deaths[node] = self.deaths.get(node, 0) + 1
                gone = self.deaths.get(node, 0) >= DROP_AFTER_DEATHS
                self._avoid_until[node] = math.inf if gone else now + cooldown_s
                self._found_dead.add(node)
            return self._avoid_until[node] == math.inf

    def demote(self, node: str, cooldown_s: float) -> None:
        with self._lock:
            self._avoid_until[node] = self._clock() + cooldown_s
            self._found_dead.discard(node)
            self.demotions[node] = self.demotions.get(node, 0) + 1

    def shun(self, node: str) -> None:
        """Avoid ``node`` for the rest of the stage: it said it no longer relays
        (slowrelay.py). Alive, so neither a death nor a demotion."""
        with self._lock:
            self._avoid_until[node] = math.inf
            self._found_dead.discard(node)

    def avoided(self) -> set[str]:
        now = self._clock()
        with self._lock:
            return {n for n, until in self._avoid_until.items() if until > now}

    def dead(self) -> set[str]:
        """The avoided peers found dead (unreachable, or gone mid-transfer), not demoted."""
        now = self._clock()
        with self._lock:
            return {n for n in self._found_dead if self._avoid_until[n] > now}


class TokenBucket:
    """Caps the average byte rate; ``burst`` bytes may pass at once."""

    def __init__(
        self,
        rate_bytes_per_s: float,
        burst_bytes: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.rate = rate_bytes_per_s
        self.burst = burst_bytes if burst_bytes is not None else rate_bytes_per_s
        self._tokens = self.burst
        self._clock, self._sleep = clock, sleep
        self._last = clock()
        self._lock = threading.Lock()

    def consume(self, n: int) -> None:
        with self._lock:
            now = self._clock()
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
            self._last = now
            self._tokens -= n  # may go negative: the debt is slept off below
            debt = -self._tokens
        if debt > 0:
            self._sleep(debt / self.rate)


def fetch_order(
    chunks: Sequence[ChunkEntry], node: str, owner_of: Callable[[str], str], lag: int
) -> list[ChunkEntry]:
    """The order in which ``node`` should fetch ``chunks``.

    Each owner fetches its own chunks in manifest order. A chunk that is k-th in its
    owner's queue is fetched by its owner at step k, and asked for by everyone else at
    step k + lag, when the owner should have it. No node needs to tell any other.
    """
    step: dict[str, int] = {}
    queue_len: dict[str, int] = {}
    for c in chunks:
        owner = owner_of(c.key)
        step[c.key] = queue_len.get(owner, 0) + (0 if owner == node else lag)
        queue_len[owner] = queue_len.get(owner, 0) + 1
    return sorted(chunks, key=lambda c: step[c.key])


def late_probes(
    owned: Sequence[str],
    others: Sequence[str],
    keys: Sequence[str],
    count: int,
    fetchers: int = FetchPolicy.origin_fetchers,
) -> list[tuple[str, list[str]]]:
    """What a node asks at stage start to find out whether it joined late.

    For each of the first ``count`` chunks it owns (``owned``, in fetch order), the
    chunk's ranking in the view of ``others`` (the node set without it) over the
    manifest's ``keys``: first the node that owns it there, and so fetches it from the
    origin, then the nodes it falls to when that one is dead. This node never appears.
    Only the manifest's keys up to the last probed chunk are walked.
    """
    probed = owned[:count]
    if not probed or not others:
        return []
    unique = list(dict.fromkeys(keys))
    where = {k: i for i, k in enumerate(unique)}
    upto = max((where[k] for k in probed if k in where), default=-1) + 1
    _, owners = schedule.plan_owners(unique, others, fetchers, first=upto)
    return [(k, rendezvous.rank_with_owner(others, k, owners.get(k))) for k in probed]


class ChunkFetcher:
    def __init__(
        self,
        *,
        node: str,
        peers: Sequence[Peer],
        origin: ChunkOrigin,
        sink: ChunkSink,
        metrics: DataPlaneMetrics,
        chunks: Sequence[ChunkEntry] = (),
        policy: FetchPolicy | None = None,
        client: PeerClient | None = None,
        bandwidth: TokenBucket | None = None,
        health: PeerHealth | None = None,
        cancel: threading.Event | None = None,
        claims: ClaimBoard | None = None,
        relaying: RelayStatus | None = None,
        holders: Collection[str] = (),
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        """``chunks``: the whole manifest's, in manifest order, so that every node computes
        the same balanced owners (a chunk not among them gets its rendezvous owner).
        ``claims``: this node's board, shared with its peer server (``ChunkStore.claims``).
        ``relaying``: whether this node relays, which its peer server answers by
        (``ChunkStore.relaying``): told how long its relay parents had held the chunks
        they sent it whole (slowrelay.py).
        ``holders``: peers known to have the whole model staged (a node joining late):
        this node takes its own chunks from them before going to the origin.
        ``clock`` and ``sleep``: the time every wait and deadline here is measured in (the
        fleet simulator runs the fetcher on its virtual time: bench/sim_fetcher.py); only
        a worker waiting out this node's own claim of a chunk waits on a real-time event."""
        self._clock, self._sleep = clock, sleep
        self.node = node
        self.address = {p.node: p.address for p in peers if p.node != node}
        self.nodes = sorted({node, *self.address})
        self._keys = [c.key for c in chunks]
        self.policy = policy or FetchPolicy()
        fetchers = self.policy.origin_fetchers
        self.fetchers, self.owners = schedule.plan_owners(self._keys, self.nodes, fetchers)
        # The owners in this node's view, kept when it joins late (``join_late``).
        self.planned = self.owners
        self.late = False
        # Who the rankings rank: the view without it, once late.
        self._ranker = rendezvous.Ranker(self.nodes)
        self._peers = rendezvous.Ranker(self.address)  # every other node
        self.holders = sorted(set(holders) & set(self.address))
        self._holders = rendezvous.Ranker(self.holders)
        self.origin = origin
        self.sink = sink
        self.metrics = metrics
        self.relaying = relaying or RelayStatus(clock)
        self.started = clock()  # when this stage began (slowrelay.lags)
        self.client = client or PeerClient(self.policy.peer_timeout_s)
        self.bandwidth = bandwidth
        self.cancel = cancel or threading.Event()
        self.health = health or PeerHealth(clock)
        self.claims = claims or ClaimBoard()
        # Second parts of split transfers being fetched (each read into memory: up to 2/3
        # of a chunk), so a peer trickling to every worker does not start one per worker.
        self._split_slots = threading.Semaphore(SPLITS_IN_FLIGHT)
        self._claim_refused: set[str] = set()  # chunks not to claim again
        self._holder_hint: dict[str, str] = {}  # chunk -> the node a claim went to
        # Owners whose last chunk came from them whole (this node is behind on them), not
        # streamed as it landed: only then may another peer hold their next chunk whole
        # already, so only then are holders asked before the owner in the first round
        # (a trace: 1,717 of 1,956 such probes were for chunks still landing, all 404).
        self.behind_on: dict[str, bool] = {}
        # Chunks this node claimed: set once the claimed fetch is over, so the worker
        # that wants the chunk reports it as from the origin (the claimer counts nothing).
        self._claimed_here: dict[str, threading.Event] = {}
        # Chunks a peer found bad at the origin (410): fetched from the origin here at once.
        self._bad_at_origin: set[str] = set()
        self._entries = {c.key: c for c in reversed(chunks)}  # first position wins
        self._queues: dict[str, list[str]] = {}  # owner -> its chunks, in fetch order
        self._queue_owners()

    def _queue_owners(self) -> None:
        self._queues = {}
        for sha, owner in self.owners.items():
            self._queues.setdefault(owner, []).append(sha)

    def ranking(self, key: str) -> list[str]:
        """Every node, this one included (unless it joined late): the chunk's owner first,
        then its rendezvous ranking, which a dead owner's chunk falls through. A chunk
        this node gave away (claims) has its claimant first."""
        owner = self.claims.claimant(key) or self.owners.get(key)
        return rendezvous.rank_with_owner(self._ranker.nodes, key, owner)

    def live_ranking(self, key: str, avoided: Collection[str], count: int) -> list[str]:
        """``count`` nodes not in ``avoided``: the chunk's owner (or claimant), or when it
        is avoided the node standing in for it (``schedule.stand_in``), then the rest of
        ``ranking(key)``; one vector pass over the node set, not a sort of it (every
        chunk asks this every round)."""
        owner = self.claims.claimant(key) or self.owners.get(key)
        index = self._ranker.index
        if owner in index and owner in avoided:
            planned = self.owners.get(key, owner)
            owner = schedule.stand_in(self._ranker.nodes, index, planned, avoided)
        head = [owner] if owner in index and owner not in avoided else []
        return head + self._ranker.top(key, count - len(head), skip={*avoided, *head})

    def join_late(self, owned: Sequence[ChunkEntry]) -> bool:
        """Called before the stage plans, with this node's own chunks in fetch order:
        whether it joined late, and if so, take the others' view.

        Asks (HEAD, no wait) the node that owns each of its first ``late_probes`` chunks in
        the view without it (the next ones of that ranking if it is dead). At stage start
        nobody holds a chunk this node owns unless they did not count it: they fetched
        it, or are fetching it, from the origin themselves. Then this node owns nothing:
        each chunk comes from the node that fetches it in their view (its rankings
        without this node), and from the origin only when none of them is alive, or after
        ``owner_wait_s`` (``late_wait_s`` for the chunks it owns in its own view).
        Costs at most ``late_probes`` answered HEADs when it is not late."""
        if self.late or not self.address or not owned:
            return self.late
        others = [n for n in self.nodes if n != self.node]
        owned_keys = [c.key for c in owned]
        limit = self.policy.peers_per_round
        probes = late_probes(
            owned_keys, others, self._keys, self.policy.late_probes, self.policy.origin_fetchers
        )
        for key, ranked in probes:
            asked = 0
            for peer in ranked:
                if asked >= limit:
                    break
                if peer in self.health.avoided():
                    continue
                asked += 1
                answer = self._probe(peer, key)
                if answer is None:
                    continue  # dead: the next node of its ranking would fetch it
                if answer:
                    log.info(
                        "%s holds chunk %s, which this node owns in its view: joining late, "
                        "taking the view of the %d nodes without it",
                        peer,
                        key,
                        len(others),
                    )
                    self.late, self._ranker = True, rendezvous.Ranker(others)
                    fetchers = self.policy.origin_fetchers
                    self.fetchers, self.owners = schedule.plan_owners(self._keys, others, fetchers)
                    self._queue_owners()
                    return True
                break
        return False

    def _probe(self, peer: str, key: str) -> bool | None:
        """Whether ``peer`` holds the whole chunk; None when it did not answer."""
        try:
            return self.client.has(self.address[peer], key)
        except PeerUnavailableError as exc:
            self._peer_failed(peer, exc, key)
            return None
        except PeerError:
            return False  # busy, or found it bad at the origin: not evidence of lateness

    def owner_of(self, key: str) -> str:
        """``ranking(key)[0]``, without ranking every node when the owner is known: the
        stage asks this for every chunk several times, and a ranking hashes each node."""
        owner = self.claims.claimant(key) or self.owners.get(key)
        if owner is not None and (owner == self.node or owner in self.address):
            return owner
        return self.live_ranking(key, (), 1)[0]

    def fetch(self, chunk: ChunkEntry) -> Source:
        """Get one chunk into the store, verified; say where it came from."""
        started = self._clock()
        source = self._fetch(chunk)
        self.metrics.chunk_seconds.labels(source).observe(self._clock() - started)
        self.metrics.chunk_bytes.labels(source).inc(chunk.size)
        return source

    def _fetch(self, chunk: ChunkEntry) -> Source:
        started = self._clock()
        wait_s = self.policy.owner_wait_s
        if self.late and self.planned.get(chunk.key) == self.node:
            wait_s = min(wait_s, self.policy.late_wait_s)
        deadline = started + wait_s
        rounds = 0  # rounds that asked peers
        relayed: set[tuple[str, str]] = set()  # (relay, root) pairs asked for this chunk
        while True:
            if self.sink.has(chunk.key):  # another worker of this node got it meanwhile
                return "origin" if chunk.key in self._claimed_here else "local"
            if self.cancel.is_set():
                # The model is no longer wanted: stop waiting on owners at once.
                raise FetchCancelledError(f"fetch of chunk {chunk.key} cancelled")
            claimed = self._claimed_here.get(chunk.key)
            if claimed is not None:  # another worker of this node claimed it
                if claimed.wait(0.1) and self.sink.has(chunk.key):
                    return "origin"
                if not claimed.is_set():
                    continue
            avoided = self.health.avoided()
            if not self.relaying.relaying:
                # Its own chunks too come from the node standing in for it, which its
                # children ask: not from the origin a second time (slowrelay.py).
                avoided.add(self.node)
            live = self.live_ranking(chunk.key, avoided, self.policy.peers_per_round + 2)
            if not live or live[0] == self.node:
                claimant = self.claims.start(chunk.key)
                if claimant is None or claimant not in self.address or claimant in avoided:
                    if self._from_holders(chunk, avoided):
                        return "peer"
                    self._from_origin(chunk)
                    return "origin"
                continue  # granted to a peer meanwhile: the ranking now starts with it
            if self._from_relay_parent(chunk, live[0], deadline, relayed):
                return "peer"
            round_started = self._clock()
            if (rounds or self.behind_on.get(live[0], False)) and any(
                self._from_peer(n, chunk, spare_only=True)
                for n in self._holder_candidates(chunk.key, live[0], avoided)
            ):
                return "peer"
            rounds += 1
            asked = [n for n in live if n != self.node][: self.policy.peers_per_round]
            hint = self._holder_hint.get(chunk.key)
            if hint is not None and hint in self.address and hint not in avoided:
                # The node that claimed it from the owner fetches it from the origin: the
                # owner gets it from there too, so that node is asked first (long-poll).
                asked = [hint, *(n for n in asked if n != hint)]
            # The owner (asked first) may hold the request until the chunk lands; the
            # others answer at once.
            wait = min(self.policy.long_poll_s, max(0.0, deadline - round_started))
            if self._ask_round(chunk, asked, live[0], wait):
                return "peer"
            if chunk.key in self._bad_at_origin:
                # Its owner will not get it: check the origin's bytes here rather than wait
                # (they are verified as any; a peer lying about it costs one origin fetch).
                log.info("chunk %s: a peer found it bad at the origin; fetching it", chunk.key)
                self._from_origin(chunk)
                return "origin"
            if self._holder_hint.get(chunk.key) not in (hint, None):
                continue  # the owner named the node that claimed it: ask that one now
            if not schedule.round_goes_on(live[0], self.health.dead()):
                continue  # the root is dead: rank without it now (its stand-in may be here)
            now = self._clock()
            if now >= deadline and self._granted_from_here(chunk.key) is None:
                log.info("chunk %s: owner %s too slow, going to origin", chunk.key, live[0])
                self._from_origin(chunk)
                return "origin"
            if now - round_started < self.policy.poll_interval_s:  # nobody held the request
                self._sleep(self.policy.poll_interval_s)

    def _ask_round(self, chunk: ChunkEntry, asked: Sequence[str], root: str, wait_s: float) -> bool:
        """Ask ``asked`` in turn, the first with ``wait_s``; whether one sent the chunk.
        Stops once the round's ``root`` is found dead (``schedule.round_goes_on``)."""
        for k, node in enumerate(asked):
            if not schedule.round_goes_on(root, self.health.dead()):
                return False
            if self._from_peer(node, chunk, wait_s if k == 0 else 0.0):
                return True
        return False

    def relay_source(self, key: str, root: str, avoided: Collection[str]) -> str | None:
        """With relays (``relay_wait_s``), the node asked for ``key`` before its ``root``
        (the first live node of its ranking): this node's nearest live ancestor in the
        tree of the chunk's owner, which gets the chunk from its own parent, or from the
        origin when it is the root, and streams it on as it lands. None when that is the
        root itself (asked next anyway), or with no relays.

        The trees are laid out over the stage's whole node set, dead nodes included, and
        a dead parent is skipped for its own parent: which nodes one node finds dead
        changes whom it asks, never anyone else's tree. (Laid out over the live nodes
        only, one peer that timed out moved every position after it in that node's view:
        it asked nodes that were not its parents in anyone else's, waited, and fell back
        to the owners, whose uplinks then carried the fleet: 2.4-5.1x S/B at 48 hosts.)

        None, too, for a chunk this node owns and granted to a claimant: the claimant is
        the root in this node's view only (nobody else knows of the grant), and its tree
        there puts this node below nodes that, in their views, are below this node: a
        cycle of long-polls that held the whole tree until ``relay_wait_s`` ran out (the
        fleet benchmark's ring: every node but the claimant 4.5 s late at the end of the
        stage, 1.19-1.24x S/B instead of 1.11-1.13x). The owner asks the claimant, and
        the others' trees lead to the owner as before."""
        if self.policy.relay_wait_s is None or self.late:
            return None
        if self.claims.claimant(key) is not None:
            return None
        members, index = self._ranker.nodes, self._ranker.index
        offset = schedule.tree_offset(index, self.owners.get(key, root))
        fanout = self.policy.relay_fanout
        return schedule.live_parent(members, index, root, self.node, fanout, offset, avoided)

    def tree_parent(self, key: str) -> str | None:
        """This node's parent in the tree of ``key``'s owner, dead or alive (None: it is
        the owner, it joined late, or there are no relays): the node it lags when that
        one had held the chunk whole a while (slowrelay.py). Not an ancestor asked in a
        dead or shunned parent's place: the nodes below a slow node, behind it, catch up
        from above it, and are not slow themselves."""
        owner = self.owners.get(key)
        if self.policy.relay_wait_s is None or self.late or owner is None:
            return None
        index = self._ranker.index
        offset = schedule.tree_offset(index, owner)
        fanout = self.policy.relay_fanout
        return schedule.relay_parent(self._ranker.nodes, owner, self.node, fanout, offset, index)

    def _from_relay_parent(
        self, chunk: ChunkEntry, root: str, deadline: float, relayed: set[tuple[str, str]]
    ) -> bool:
        """Ask ``relay_source`` first, every round: ``relay_wait_s`` at most the first time
        for that relay and root (``relayed``, one chunk's fetch), at once (no wait) after:
        by a later round it mostly holds the chunk whole, and the nodes behind then take
        it from their parents, spread as the tree spreads them, not all from the root (the
        simulator at 1,000 nodes, 10 % killed: the nodes that had asked their parents
        once, while the stand-in had not started the chunk yet, all asked the stand-in
        after, three whole chunks at a time: 7.0x S/B). A relay found dead meanwhile is
        skipped for its own parent, asked at once: the children of a node killed
        mid-stage go on down the tree, not to the root. Asked as a node below it
        (``peer.BELOW_HEADER``): its whole chunks for this node are the tree's flow."""
        if self.policy.relay_wait_s is None:
            return False
        asked: set[str] = set()
        while True:
            parent = self.relay_source(chunk.key, root, self.health.avoided())
            if parent is None or parent in asked:
                return False
            asked.add(parent)
            wait_s = 0.0
            if (parent, root) not in relayed:
                relayed.add((parent, root))
                wait_s = min(self.policy.relay_wait_s, max(0.0, deadline - self._clock()))
            if self._from_peer(parent, chunk, wait_s, below=True):
                return True

    def _holder_candidates(self, key: str, owner: str, avoided: set[str]) -> list[str]:
        """The live peers asked whether they hold ``key`` whole before its ``owner``:
        ranked by this node and the key, so the nodes behind on one owner ask different
        peers."""
        count = self.policy.holder_probes
        skip = {*avoided, owner}
        return self._peers.top(f"{self.node}\0{key}", count, skip) if count else []

    def _granted_from_here(self, key: str) -> str | None:
        """The live peer this node granted ``key`` to, when it joined late and owns the
        chunk in its own view: the others count it as the owner there, so they may have
        claimed it from here. Then this node waits for that peer (the grant's TTL bounds
        it) instead of fetching the chunk from the origin a second time. Otherwise None,
        and the chunk is marked started here, so no claim on it is granted from now on."""
        if not (self.late and self.planned.get(key) == self.node):
            return None
        claimant = self.claims.start(key)
        if claimant in self.address and claimant not in self.health.avoided():
            return claimant
        return None

    def claim_tails(self) -> None:
        """Once this node's own origin queue is done (the origin lane runs this after
        it), keep its origin slot busy: claim a chunk of the owner it misses the most
        chunks of, again and again, until no owner is behind. The origin link then stays
        full to the end, instead of idling while the slowest owners finish their queues
        alone. Claims run here only, never in a peer-lane worker: a worker fetching a
        claimed chunk from the origin would leave the chunk it waits for, and its owner's
        lane, idle meanwhile. A node joining late claims nothing: nobody counts it, so
        its claims would be refused (403)."""
        if not self.policy.claims or self.late or self.node not in self.fetchers:
            return  # a node that fetches nothing from the origin claims nothing either
        while not self.cancel.is_set() and (owner := self._most_behind()) is not None:
            self._claim_next(owner)

    def _claimable(self, owner: str) -> list[str]:
        """``owner``'s chunks this node lacks and has not asked for, in its fetch order."""
        return [
            sha
            for sha in self._queues.get(owner, [])
            if sha not in self._claim_refused
            and sha not in self._claimed_here
            and not self.sink.has(sha)
        ]

    def _most_behind(self) -> str | None:
        """The live owner with the most claimable chunks, if it has any."""
        avoided = self.health.avoided()
        counts = {
            owner: len(self._claimable(owner))
            for owner in self._queues
            if owner in self.address and owner not in avoided
        }
        owner = max(counts, key=lambda o: counts[o], default=None)
        return owner if owner is not None and counts[owner] else None

    def _claim_next(self, owner: str) -> None:
        """``owner`` is slow: claim the chunk after the one it is fetching (the first this
        node lacks), the next the fleet asks it for, and fetch it from the origin here;
        its last one when only that is left (the owner grants it if it has not started
        it: an owner that does not stage this model, outside the rollout's selector,
        grants every claim). The last of the queue, claimed first instead, was asked for
        by every node only when it reached it, seconds after it was in (the fleet
        benchmark's traces)."""
        claimable = self._claimable(owner)
        if owner not in self.address or not claimable:
            return
        target = claimable[1] if len(claimable) > 1 else claimable[0]
        try:
            granted, holder = self.client.claim(self.address[owner], target, self.node)
        except PeerNotRelayingError as exc:  # its stand-in fetches its chunks
            self._claim_refused.add(target)
            self._peer_failed(owner, exc)
            return
        except PeerError:
            self._claim_refused.add(target)  # the fetch finds out whether it is dead
            return
        if not granted:
            self._claim_refused.add(target)
            if holder:
                self._holder_hint[target] = holder
            return
        # Marked started here too, so this node refuses anyone else's claim on it.
        self.claims.start(target)
        done = self._claimed_here[target] = threading.Event()
        log.info("chunk %s: claimed from slow owner %s, fetching from origin", target, owner)
        self.metrics.chunks_claimed.inc()
        try:
            self._from_origin(self._entries[target])
        finally:
            done.set()

    def _from_holders(self, chunk: ChunkEntry, avoided: set[str]) -> bool:
        """Ask up to ``peers_per_round`` live holders of the whole model (rendezvous order,
        so the load spreads) before this node fetches a chunk from the origin."""
        ranked = self._holders.top(chunk.key, self.policy.peers_per_round, avoided)
        return any(self._from_peer(n, chunk) for n in ranked)

    def _from_peer(
        self,
        node: str,
        chunk: ChunkEntry,
        wait_s: float = 0.0,
        *,
        spare_only: bool = False,
        below: bool = False,
    ) -> bool:
        """Get the chunk from ``node``; ``spare_only``: only if it holds it whole and its
        uplink has room (a holder asked before the owner); ``below``: this node is below
        ``node`` in the chunk's relay tree (``peer.BELOW_HEADER``; streams only)."""
        if node in self.health.avoided():
            return False  # found dead or demoted since this round listed it
        sink = self.sink
        if isinstance(sink, InPlaceSink):
            return self._stream_from_peer(node, chunk, sink, wait_s, spare_only, below)
        try:
            data = self.client.fetch(
                self.address[node], chunk.key, wait_s=wait_s, spare_only=spare_only
            )
        except PeerError as exc:
            self._peer_failed(node, exc, chunk.key)
            return False
        self._throttle(len(data))
        try:
            sink.put(chunk.key, data)  # verifies before storing
        except ChunkVerificationError:
            self._demote(node, chunk, "bad bytes")
            return False
        return True

    def _stream_from_peer(
        self,
        node: str,
        chunk: ChunkEntry,
        sink: InPlaceSink,
        wait_s: float,
        spare_only: bool,
        below: bool = False,
    ) -> bool:
        """Receive the chunk from ``node`` into its place, from this node's verified
        prefix on. A peer still receiving the chunk streams its verified pieces as they
        land; each piece is verified here as it arrives (version 2), so a bad one is
        caught at that piece and the peer demoted. A stream that ends early keeps what
        verified: the next attempt, at any source, starts there."""
        address = self.address[node]
        start = sink.resume_point(chunk.key)
        if start >= chunk.size:
            # Every piece verified in an attempt that ended before its commit (the source
            # gone while ending its answer): a range from the end is a 416 at every
            # peer, asked again until owner_wait_s. Nothing is left to fetch: commit it.
            return self._commit_verified(chunk, sink)
        try:
            body = self.client.open(
                address, chunk.key, start=start, wait_s=wait_s, spare_only=spare_only, below=below
            )
        except PeerError as exc:
            self._peer_failed(node, exc, chunk.key)
            return False
        held_s = body.held_s if body.whole else None
        if held_s is not None and node == self.tree_parent(chunk.key):
            self._parent_held(held_s)
        probe = None if body.whole else self._lag_probe(node, chunk)
        got = [start]
        split = self._splitter(node, chunk, sink, start) if body.whole else None

        def fill(view: memoryview, begin: int, landed: Callable[[int], None]) -> int:
            def counted(end: int) -> None:
                self._throttle(end - got[0])
                got[0] = end
                landed(end)
                if split is not None:
                    split.landed(end)
                if probe is not None:
                    probe()

            if split is None:
                return body.read_into(view, begin, counted)
            end = body.read_into(view, begin, counted, split.stop_at)
            return split.finish(view, end, landed)

        try:
            written = sink.receive(chunk.key, fill, start=start)
        except SplitPieceError as exc:
            self._demote(exc.node, chunk, f"a bad piece ({exc.piece}) of its part")
            return False
        except PieceVerificationError as exc:
            self._demote(node, chunk, f"a bad piece ({exc.piece})")
            return False
        except ChunkVerificationError:
            self._demote(node, chunk, "bad bytes")
            return False
        except (ChunkIncompleteError, ResumeMovedError):
            return False  # what verified is kept; ask again
        except PeerError as exc:
            self._peer_failed(node, exc)
            return False
        finally:
            body.close()
            if split is not None and split.cut is not None:
                self.metrics.chunk_splits.labels("used" if split.used else "unused").inc()
        if node == self.owners.get(chunk.key) and written > 0:
            self.behind_on[node] = body.whole
        # Nothing written: another worker of this node holds it (the loop says where from).
        return written > 0

    def _lag_probe(self, node: str, chunk: ChunkEntry) -> Callable[[], None] | None:
        """For a stream from this node's tree parent: each time it has run another
        ``LAG_S`` (looked at as bytes land), ask the parent how long it has held the
        chunk whole (``PeerClient.held``), until once it lags (``slowrelay.lags``). A
        slow node's first streams run most of a stage, each at its share of a slow link;
        looking only when it asked for its next chunks, it stopped relaying after 24-26 s
        of a 21.5 s S/B (the fleet benchmark, 16 hosts, one at a tenth of its link).
        None for a stream from any other node."""
        if node != self.tree_parent(chunk.key):
            return None
        began, looked = self._clock(), [0]

        def probe() -> None:
            step = int((self._clock() - began) // LAG_S)
            if step <= looked[0]:
                return
            looked[0] = step
            try:
                held_s = self.client.held(self.address[node], chunk.key)
            except PeerError:
                return  # the stream finds out what is wrong with it
            if held_s is not None and lags(held_s, self._clock() - self.started):
                looked[0] = sys.maxsize  # one notice a stream
                self._parent_held(held_s)

        return probe

    def _parent_held(self, held_s: float) -> None:
        """This node's tree parent had held a chunk it sent whole for ``held_s``: this node
        was that far behind it (slowrelay.py)."""
        if self.relaying.parent_held(held_s, self._clock() - self.started):
            self.metrics.relay_stops.inc()

    def _splitter(
        self, node: str, chunk: ChunkEntry, sink: InPlaceSink, start: int
    ) -> SplitTransfer | None:
        """A split for a whole chunk streaming from ``node`` (split.py), when the policy
        splits and the sink verifies pieces (so a bad one is told from the other's)."""
        after = self.policy.split_after_s
        piece = sink.piece_size
        if after is None or piece is None or not self.policy.split_peers:
            return None

        def fetch_rest(begin: int, end: int) -> tuple[str, bytes] | None:
            return self._fetch_part(chunk, node, begin, end)

        return SplitTransfer(
            chunk.size,
            piece,
            start,
            fetch_rest,
            after_s=after,
            eta_s=self.policy.split_eta_s,
            clock=self._clock,
        )

    def _fetch_part(
        self, chunk: ChunkEntry, source: str, begin: int, end: int
    ) -> tuple[str, bytes] | None:
        """Bytes [begin, end) of ``chunk``, whole, from a live peer other than ``source``
        (this node's ranking of them for the chunk, so the nodes behind on one owner ask
        different peers); None when none of ``split_peers`` has them to send."""
        if not self._split_slots.acquire(blocking=False):
            return None
        try:
            avoided = self.health.avoided()
            skip = {*avoided, source}
            for n in self._peers.top(f"{self.node}\0{chunk.key}", self.policy.split_peers, skip):
                try:
                    data = self.client.fetch(self.address[n], chunk.key, start=begin, end=end)
                except PeerError as exc:
                    self._peer_failed(n, exc, chunk.key)
                    continue
                self._throttle(len(data))
                return n, data
            return None
        finally:
            self._split_slots.release()

    def _commit_verified(self, chunk: ChunkEntry, sink: InPlaceSink) -> bool:
        """Commit a chunk whose every piece is verified in place (no bytes to fetch)."""

        def nothing(view: memoryview, begin: int, landed: Callable[[int], None]) -> int:
            return begin  # never called: the sink sees the prefix is whole

        try:
            return sink.receive(chunk.key, nothing, start=chunk.size) > 0
        except (ChunkIncompleteError, ResumeMovedError):
            return False  # moved meanwhile (another worker): ask again

    def _peer_failed(self, node: str, exc: PeerError, key: str | None = None) -> None:
        if isinstance(exc, ChunkBadAtOriginError) and key is not None:
            self._bad_at_origin.add(key)
        if isinstance(exc, ChunkNotOnPeerError) and exc.claimant and key is not None:
            self._holder_hint[key] = exc.claimant  # asked first from the next round on
        if isinstance(exc, PeerNotRelayingError):
            self.health.shun(node)  # its children ask above it (slowrelay.py)
            log.info("peer %s no longer relays (its link lags): skipping it this stage", node)
            return
        if isinstance(exc, (ChunkNotOnPeerError, PeerBusyError)):
            return
        if isinstance(exc, PeerUnavailableError):
            refused = isinstance(exc.__cause__, (ConnectionRefusedError, ConnectionResetError))
            dropped = self.health.mark_dead(node, self.policy.dead_cooldown_s, refused=refused)
            for_how_long = "the rest of the stage" if dropped else f"{self.policy.dead_cooldown_s}s"
            log.info("peer %s unreachable, skipping it for %s: %s", node, for_how_long, exc)
            return
        log.warning("peer %s: %s", node, exc)

    def _demote(self, node: str, chunk: ChunkEntry, what: str) -> None:
        log.warning("peer %s served %s for chunk %s: demoted", node, what, chunk.key)
        self.metrics.verification_failures.labels("peer").inc()
        self.metrics.peer_demotions.inc()
        self.health.demote(node, self.policy.demote_cooldown_s)

    def _from_origin(self, chunk: ChunkEntry) -> None:
        self._read_origin(chunk)
        self._renew_origin_connection()

    def _renew_origin_connection(self) -> None:
        """With peers (``renew_origin_connections``), close the connection the chunk just
        came on, so the next chunk starts a new flow: where its transfer took
        ``RENEW_AFTER_ROUND_TRIPS`` times its first-byte latency or more."""
        origin = self.origin
        if not (self.address and self.policy.renew_origin_connections):
            return
        if not isinstance(origin, RenewableOrigin) or (timing := origin.last_read()) is None:
            return
        first_byte_s, transfer_s = timing
        if transfer_s >= RENEW_AFTER_ROUND_TRIPS * first_byte_s:
            self.metrics.origin_renewals.inc()
            origin.renew_connection()

    def last_origin_read(self) -> tuple[float, float] | None:
        """The calling thread's last origin read, where the origin keeps it: seconds to
        its first byte and seconds from there to its last (``RenewableOrigin``)."""
        origin = self.origin
        return origin.last_read() if isinstance(origin, RenewableOrigin) else None

    def _read_origin(self, chunk: ChunkEntry) -> None:
        origin, sink = self.origin, self.sink
        short: ChunkIncompleteError | None = None  # the last attempt ended early
        step = self._origin_step(sink) if isinstance(sink, InPlaceSink) else {}
        for _ in range(self.policy.origin_attempts):
            short = None
            if isinstance(origin, FillingOrigin) and isinstance(sink, InPlaceSink):

                def fill(view: memoryview, begin: int, landed: Callable[[int], None]) -> int:
                    origin.read_range_into(
                        chunk.file,
                        chunk.offset + begin,
                        view[begin:],
                        lambda n: landed(begin + n),
                        **step,
                    )
                    self._throttle(len(view) - begin)
                    return len(view)

                try:
                    sink.receive(chunk.key, fill)  # verifies before journaling
                    return
                except ChunkVerificationError:
                    self.metrics.verification_failures.labels("origin").inc()
                    continue
                except ChunkIncompleteError as exc:
                    short = exc
                    continue
            data = self.origin.read_range(chunk.file, chunk.offset, chunk.size)
            self._throttle(len(data))
            if len(data) != chunk.size:
                short = ChunkIncompleteError(
                    f"chunk {chunk.key}: the origin answered {len(data)} of {chunk.size} bytes"
                )
                continue
            try:
                self.sink.put(chunk.key, data)
                return
            except ChunkVerificationError:
                self.metrics.verification_failures.labels("origin").inc()
        if short is not None:
            raise short  # a short read is no verdict on the origin's bytes
        self.claims.failed_at_origin(chunk.key)  # peers waiting for it here are told (410)
        raise OriginMismatchError(chunk)

    def _origin_step(self, sink: InPlaceSink) -> dict[str, int]:
        """How much an origin read takes before it says what landed: with peers, one
        piece, so each piece is verified and streamed on to the peers waiting for it the
        moment it is in (a 1 MiB read held four 256 KiB pieces back from every one of
        them: the fleet benchmark, 1.15x S/B against 1.18x, docs/benchmarks.md). Alone,
        the origin's default (fewer, larger reads cost less CPU: P1)."""
        piece = sink.piece_size
        if not self.address or not piece:
            return {}
        return {"step": max(MIN_ORIGIN_STEP, piece)}

    def _throttle(self, n: int) -> None:
        if self.bandwidth:
            self.bandwidth.consume(n)
