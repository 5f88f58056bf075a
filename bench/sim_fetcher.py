"""The fleet simulator with the agent's real fetcher in the loop (issue 38).

Every fetch of a chunk by a node, in either lane, is ``ChunkFetcher.fetch`` itself,
running in a thread of its own on the fleet's virtual time (the fetcher's ``clock`` and
``sleep``), talking to stand-ins that the fleet backs: a peer client whose answers follow
the peer server's rules (a long-poll held until the chunk's first piece lands, a stream of
a chunk still landing, a 503 past the whole-chunk uploads, a refused connection at a dead
node, a reset when a source dies), an origin, and the node's store (``InPlaceSink``, as
``ModelStaging``: the fetcher takes the path it takes in the agent). Whom a node asks,
how long it waits, what it does on each answer and when it goes to the origin are the
product's; the network, the lanes (``Fleet.next_tasks``) and the deaths are the
simulator's. tests/unit/test_sim_real_fetcher.py runs scenarios both ways and holds the
simulator's ``Task`` (its re-creation of the fetcher's rounds) to this.

What the simulator does not model is turned off in the policy (``unmodelled_off``):
tail claims and split transfers.

Lockstep: one fetch thread runs at a time, in the order the fleet made them ready (so a
run is deterministic), until it blocks in a world call (a transfer, a long-poll, a sleep,
an answer a round trip away) or returns; the fleet moves time only when none can run.
Every wait is bounded in real time: a thread that does not come back fails the run
(``LockstepError``), it never hangs.

    .venv/bin/python bench/sim_fetcher.py --nodes 8 --chunks 32 --link-mbit 32
"""

from __future__ import annotations

import argparse
import heapq
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace

import numpy as np
from prometheus_client import CollectorRegistry

from sim_fleet import Fetch, Fleet, MiB, Result, Scenario
from weightship.data.fetcher import ChunkFetcher, FetchPolicy, Peer
from weightship.data.metrics import DataPlaneMetrics
from weightship.data.modelstaging import ChunkIncompleteError, Fill
from weightship.data.peer import (
    ChunkNotOnPeerError,
    PeerBusyError,
    PeerError,
    PeerNotRelayingError,
    PeerUnavailableError,
)
from weightship.data.slowrelay import LAG_S, RelayStatus

# Real seconds one fetch thread may run before it blocks or returns, and a whole run may
# take: past either the run fails (a deadlock, a fetcher spinning on the virtual clock).
STALL_S = 10.0
RUN_S = 120.0


def unmodelled_off(policy: FetchPolicy) -> FetchPolicy:
    """``policy`` without what the simulator does not model (its docstring)."""
    return replace(policy, claims=False, split_after_s=None)


class LockstepError(RuntimeError):
    """A fetch thread did not come back in real time, or failed."""


class NodeKilled(BaseException):
    """Raised in a killed node's fetch threads: how they end, not an error (BaseException:
    the fetcher catches none)."""


class Abandoned(BaseException):
    """Raised in the fetch threads still blocked when the run ends."""


class RealFetch(Fetch):
    """A lane's fetch run by the node's real ``ChunkFetcher``, in a thread: what the call
    it is blocked in gets when the fleet wakes it."""

    __slots__ = (
        "error",
        "go",
        "head",
        "held_s",
        "lane",
        "moving",
        "on_timer",
        "outcome",
        "source",
        "thread",
        "whole",
    )

    def __init__(self, node: int, chunk: int, lane: str, go: threading.Condition) -> None:
        super().__init__(node, chunk)
        self.lane = lane  # "peer" or "origin"
        self.go = go  # notified when it is this thread's turn
        self.source = -1  # the node its current request went to (-1: the origin)
        self.whole = False  # that source held the chunk whole when it answered
        self.held_s: float | None = None  # for how long (``peer.HELD_HEADER``)
        # Its peer transfer is under way (``moving``), and the timer of the answer's first
        # byte, when the request returns (``head``; None: fired, or no transfer).
        self.moving = False
        self.head: int | None = None
        self.on_timer: BaseException | None = None  # raised when its timer fires
        self.outcome: BaseException | None = None  # raised in it when it runs next
        self.error: BaseException | None = None  # what its fetch raised
        self.thread: threading.Thread | None = None

    def landed(self, fleet: Fleet) -> None:
        self.transfer_over(fleet)
        resume(fleet, self, None)

    def cut(self, fleet: Fleet) -> None:
        self.transfer_over(fleet)
        if self.source >= 0 and not fleet.alive[self.source]:
            resume(fleet, self, reset(fleet.names[self.source]))
        else:  # a stalled stream ended (cleanly): the reader keeps its whole pieces
            resume(fleet, self, None)

    def timed_out(self, fleet: Fleet) -> None:
        self.head = None
        resume(fleet, self, self.on_timer)

    def transfer_over(self, fleet: Fleet) -> None:
        """Its transfer ended before or after its first byte: a first byte not yet come
        never comes (the request returns now, or raises)."""
        self.moving = False
        if self.head is not None:
            fleet.cancelled.add(self.head)
            self.head = None


def resume(fleet: Fleet, f: RealFetch, outcome: BaseException | None) -> None:
    """Make ``f`` ready to run: the call it is blocked in returns, or raises ``outcome``."""
    assert isinstance(fleet, RealFleet)
    f.outcome = outcome
    fleet.lockstep.ready.append(f)


def refused(node: str) -> PeerUnavailableError:
    """What a request to a dead node raises (``PeerClient``: nothing listens there)."""
    exc = PeerUnavailableError(f"{node}: connection refused")
    exc.__cause__ = ConnectionRefusedError(111, "Connection refused")
    return exc


def reset(node: str) -> PeerUnavailableError:
    """What a request held or streaming at a node that dies raises."""
    exc = PeerUnavailableError(f"{node}: connection reset")
    exc.__cause__ = ConnectionResetError(104, "Connection reset by peer")
    return exc


class Lockstep:
    """Runs the fetch threads one at a time for the fleet (the main thread), in the order
    they were made ready, each until it blocks in a world call or returns."""

    def __init__(self, stall_s: float = STALL_S, run_s: float = RUN_S) -> None:
        self.lock = threading.Lock()
        self.ready: deque[RealFetch] = deque()  # touched only by whoever has the turn
        self.turn: RealFetch | None = None  # None: the fleet's
        self._fleet = threading.Condition(self.lock)
        self._closed = False
        self.stall_s, self.run_s = stall_s, run_s

    def run_ready(self) -> None:
        """(The fleet) Run every ready thread, and those they make ready, in turn."""
        with self.lock:
            while self.ready:
                f = self.ready.popleft()
                self.turn = f
                f.go.notify()
                if not self._fleet.wait_for(lambda: self.turn is None, self.stall_s):
                    raise LockstepError(
                        f"node {f.node}'s fetch of chunk {f.chunk} neither blocked nor "
                        f"returned within {self.stall_s:.0f} s of real time"
                    )
                if f.error is not None and not isinstance(f.error, NodeKilled):
                    raise LockstepError(
                        f"node {f.node}'s fetch of chunk {f.chunk} failed: {f.error!r}"
                    ) from f.error

    def block(self, f: RealFetch) -> None:
        """(A fetch thread) Give the turn back and wait for it; raise what woke it with."""
        self.finished(f)
        self.wait_turn(f)
        outcome, f.outcome = f.outcome, None
        if outcome is not None:
            raise outcome

    def wait_turn(self, f: RealFetch) -> None:
        """(A fetch thread) Wait until it is its turn."""
        with self.lock:
            if not f.go.wait_for(lambda: self.turn is f or self._closed, self.run_s):
                raise LockstepError(f"node {f.node}'s fetch of chunk {f.chunk} never resumed")
            if self._closed:
                raise Abandoned

    def finished(self, f: RealFetch) -> None:
        """(A fetch thread) Give the turn back."""
        with self.lock:
            if self.turn is f:
                self.turn = None
                self._fleet.notify()

    def has_turn(self, f: RealFetch) -> bool:
        with self.lock:
            return self.turn is f and not self._closed

    def close(self, fetches: list[RealFetch]) -> None:
        """End the run: every thread still blocked raises Abandoned."""
        with self.lock:
            self._closed, self.turn = True, None
            for f in fetches:
                f.go.notify()
        for f in fetches:
            if f.thread is not None:
                f.thread.join(self.stall_s)


class RealFleet(Fleet):
    """``Fleet`` whose lanes run each node's real ``ChunkFetcher``."""

    def __init__(
        self, s: Scenario, dt: float | None = None, lockstep: Lockstep | None = None
    ) -> None:
        super().__init__(s, dt)
        self.policy = unmodelled_off(self.policy)
        self.lockstep = lockstep or Lockstep()
        self.live: dict[RealFetch, None] = {}  # started, not returned (insertion order)
        self.sources: dict[str, int] = {}  # fetches that returned, by what they said
        self.stranded = 0  # fetches of live nodes still blocked when the run ended
        self._watchdog = math.inf  # the real time the run must end by
        self.view = memoryview(bytearray(s.chunk))  # where every chunk "lands"
        peers = [Peer(name, name) for name in self.names]  # an address is the node's name
        metrics = DataPlaneMetrics.create(CollectorRegistry())
        # Each node's RelayStatus, which its fetcher tells and its peer server answers by.
        self.relay_status = [RelayStatus(self.clock) for _ in self.names]
        self.agents = [
            ChunkFetcher(
                node=name,
                peers=peers,
                origin=WorldOrigin(self),
                sink=WorldSink(self, d),
                metrics=metrics,
                chunks=self.entries,
                policy=self.policy,
                client=WorldClient(self),  # type: ignore[arg-type]
                relaying=self.relay_status[d],
                clock=self.clock,
                sleep=self.sleep,
            )
            for d, name in enumerate(self.names)
        ]

    # The lanes start real fetches.
    def begin(self, d: int, c: int) -> None:
        self.launch(d, c, "peer")

    def fetch_own(self, d: int, c: int) -> None:
        self.launch(d, c, "origin")

    def launch(self, d: int, c: int, lane: str) -> None:
        f = RealFetch(d, c, lane, threading.Condition(self.lockstep.lock))
        f.thread = threading.Thread(
            target=self._fetch, args=(f,), name=f"{self.names[d]}-{lane}-{c}", daemon=True
        )
        self.live[f] = None
        f.thread.start()
        self.lockstep.ready.append(f)

    def _fetch(self, f: RealFetch) -> None:
        try:
            self.lockstep.wait_turn(f)  # its first
            source = self.agents[f.node].fetch(self.entries[f.chunk])
        except Abandoned:
            return
        except BaseException as exc:  # the fleet reports it (run_ready)
            f.error = exc
        else:
            if not self.lockstep.has_turn(f):
                return  # the run ended while it ran (the watchdog): leave the fleet alone
            self.sources[source] = self.sources.get(source, 0) + 1
            if f.lane == "peer":
                self.release(f)
            else:
                self.next_origin(f.node)
        finally:
            self.live.pop(f, None)
        self.lockstep.finished(f)

    def settle(self) -> None:
        self.lockstep.run_ready()

    def run(self) -> Result:
        started = time.monotonic()
        self._watchdog = started + self.lockstep.run_s
        try:
            result = super().run()
            self.settle()  # the fetches whose chunk landed last return
            self.stranded = sum(1 for f in self.live if self.alive[f.node])
            return result
        finally:
            self.lockstep.close(list(self.live))

    def step(self) -> None:
        if time.monotonic() > self._watchdog:
            raise LockstepError(f"the run took over {self.lockstep.run_s:.0f} s of real time")
        super().step()

    def kill(self, nodes: np.ndarray) -> None:
        super().kill(nodes)
        for f in list(self.live):  # every fetch is blocked now (settled before the kill)
            if not self.alive[f.node]:
                resume(self, f, NodeKilled())

    # What the stand-ins ask of the world, from the fetch thread whose turn it is.
    def current(self) -> RealFetch:
        f = self.lockstep.turn
        assert f is not None and f.thread is threading.current_thread(), "not a fetch's turn"
        if not self.alive[f.node]:
            raise NodeKilled
        return f

    def sleep(self, seconds: float) -> None:
        f = self.current()
        f.on_timer = None
        self.timer(self.now + seconds, f)
        self.lockstep.block(f)

    def request(
        self, src: int, wait_s: float, spare_only: bool = False, below: bool = False
    ) -> WorldBody:
        """The current fetch's GET of its chunk from ``src`` (``PeerClient.open``), answered
        as the peer server answers it; returns once the body is in, or cut short.
        ``spare_only`` (a holder probe): only the whole chunk, never held; ``below``: from
        below ``src`` in the chunk's tree (``peer.BELOW_HEADER``)."""
        f = self.current()
        c, name = f.chunk, self.names[src]
        self.asks += 1
        f.source, f.below = src, below and not spare_only
        if not self.alive[src]:
            self.answer(f, refused(name))
        elif not self.relays(src):
            self.not_relaying(f)
        elif spare_only and not self.done[src, c]:
            self.answer(f, ChunkNotOnPeerError(f"{name} has no whole chunk {c}"))
        elif self.got[src, c] >= min(self.piece, self.sizes[c]) or self.done[src, c]:
            if not self.admits(src, bool(self.done[src, c]), spare_only, f.below):
                self.busy(f)
            else:
                self.transfer(src, f.node, c, f, self.s.rtt_s)
        elif wait_s > 0:
            f.on_timer = ChunkNotOnPeerError(f"{name} has no chunk {c} (held {wait_s:.1f} s)")
            self.hold(f, src, wait_s)  # ``Fleet.wake`` starts its transfer when a piece lands
        else:
            self.answer(f, ChunkNotOnPeerError(f"{name} has no chunk {c}"))
        self.lockstep.block(f)  # raises the answer, or returns at its first byte
        return WorldBody(self, f)

    def busy(self, task: Fetch) -> None:
        assert isinstance(task, RealFetch)
        self.answer(task, PeerBusyError(f"{self.names[task.source]} is busy"))

    def not_relaying(self, task: Fetch) -> None:
        assert isinstance(task, RealFetch)
        self.answer(task, PeerNotRelayingError(f"{self.names[task.source]} no longer relays"))

    def answer_later(self, f: RealFetch) -> None:
        """Resume ``f`` a round trip from now, with no error."""
        f.on_timer = None
        self.timer(self.now + self.s.rtt_s, f)

    def answer(self, f: RealFetch, error: PeerError) -> None:
        """Answer ``f``'s request with ``error`` a round trip from now."""
        f.on_timer = error
        self.timer(self.now + self.s.rtt_s, f)

    def from_origin(self) -> None:
        """The current fetch's origin GET of its chunk; returns once it is in."""
        f = self.current()
        f.source = -1
        self.transfer(-1, f.node, f.chunk, f, self.s.origin_latency_s)
        self.lockstep.block(f)
        if not self.done[f.node, f.chunk]:  # never: only a dead node's are cut
            raise ChunkIncompleteError(f"chunk {f.chunk}: the origin's answer was cut short")

    def transfer(self, src: int, dst: int, c: int, task: Fetch | None, latency: float) -> None:
        if isinstance(task, RealFetch) and src >= 0:
            task.whole = bool(self.done[src, c])  # else a stream (chunked)
            task.held_s = self.now - float(self.came_at[src, c, 1]) if task.whole else None
            # The request returns with the answer's first byte: its headers say whether it
            # is whole and how long the source had held it; the body is read after.
            task.moving, task.on_timer = True, None
            self.seq += 1
            task.head = self.seq
            heapq.heappush(self.timers, (self.now + latency, self.seq, task, self.seq))
        super().transfer(src, dst, c, task, latency)

    def relays(self, d: int) -> bool:
        return self.relay_status[d].relaying

    def wake_at(self, f: RealFetch, at: float) -> None:
        """Resume ``f``, blocked mid-transfer, at ``at`` (unless the transfer ends first)."""
        f.on_timer = None
        self.seq += 1
        f.head = self.seq
        heapq.heappush(self.timers, (at, self.seq, f, self.seq))

    def held(self, src: int) -> float | None:
        """The current fetch's HEAD to ``src`` (``PeerClient.held``), beside its stream
        from there: how long ``src`` has held the chunk whole, answered a round trip
        later (sooner when the stream ends meanwhile); None when it does not hold it
        whole, is dead, or no longer relays (the fetcher takes those as nothing learned)."""
        f = self.current()
        c = f.chunk
        whole = self.alive[src] and self.relays(src) and self.done[src, c]
        held_s = self.now - float(self.came_at[src, c, 1]) if whole else None
        if f.moving:
            self.wake_at(f, self.now + self.s.rtt_s)
        else:
            self.answer_later(f)
        self.lockstep.block(f)
        return held_s

    def verified(self, d: int, c: int) -> int:
        """Node ``d``'s verified prefix of chunk ``c``: its whole pieces."""
        if self.done[d, c]:
            return int(self.sizes[c])
        return int(self.got[d, c] // self.piece * self.piece)


class WorldBody:
    """A peer's answer from its first byte on (``PeerBody``): reading it waits for the
    transfer to end, and says where it ended."""

    def __init__(self, fleet: RealFleet, f: RealFetch) -> None:
        self.fleet, self.f = fleet, f
        self.whole, self.held_s = f.whole, f.held_s
        self.began = fleet.now

    def read_into(
        self,
        view: memoryview,
        begin: int,
        landed: Callable[[int], None],
        stop_at: Callable[[int], int] | None = None,
    ) -> int:
        """Wait for the transfer to end, saying what landed; a stream still running says
        so each ``LAG_S`` after its first byte too, when the fetcher looks whether to ask
        its parent how long it has held the chunk (``ChunkFetcher._lag_probe``)."""
        fleet, f = self.fleet, self.f
        seen, step = begin, 1
        while f.moving and not self.whole:
            fleet.wake_at(f, self.began + step * LAG_S + 1e-9)  # past it however it rounds
            fleet.lockstep.block(f)  # raises a reset
            step += 1
            if f.moving and (part := fleet.verified(f.node, f.chunk)) > seen:
                seen = part
                landed(part)
        if f.moving:
            fleet.lockstep.block(f)  # until the transfer ends; raises a reset
        end = fleet.verified(f.node, f.chunk)
        if end > begin:
            landed(end)
        return max(begin, end)

    def close(self) -> None:
        pass


class WorldClient:
    """``PeerClient``, answered by the fleet."""

    def __init__(self, fleet: RealFleet) -> None:
        self.fleet = fleet

    def open(
        self,
        address: str,
        key: str,
        *,
        start: int = 0,
        wait_s: float = 0.0,
        spare_only: bool = False,
        below: bool = False,
    ) -> WorldBody:
        fleet = self.fleet
        assert key == fleet.keys[fleet.current().chunk], "a fetch asks for its own chunk"
        return fleet.request(fleet.index[address], wait_s, spare_only, below)

    def fetch(self, address: str, key: str, **kwargs: object) -> bytes:
        raise AssertionError("whole-chunk fetches (splits) are not simulated")

    def has(self, address: str, key: str) -> bool:
        raise AssertionError("late joins are not simulated")

    def held(self, address: str, key: str) -> float | None:
        fleet = self.fleet
        assert key == fleet.keys[fleet.current().chunk], "a fetch asks of its own chunk"
        return fleet.held(fleet.index[address])

    def claim(self, address: str, key: str, node: str) -> tuple[bool, str | None]:
        raise AssertionError("tail claims are not simulated (unmodelled_off)")


class WorldOrigin:
    """The origin (``FillingOrigin``): a chunk's bytes come at the origin link's share."""

    def __init__(self, fleet: RealFleet) -> None:
        self.fleet = fleet

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
        fleet = self.fleet
        entry = fleet.entries[fleet.current().chunk]
        assert entry.offset <= offset < entry.offset + entry.size, "a fetch reads its own chunk"
        fleet.from_origin()
        if landed is not None:
            landed(len(view))


class WorldSink:
    """Node ``d``'s store (``InPlaceSink``, as ``ModelStaging``): what the fleet holds.
    Nothing is verified (the simulator's digests are made up); the bytes never exist."""

    def __init__(self, fleet: RealFleet, d: int) -> None:
        self.fleet, self.d = fleet, d

    def has(self, key: str) -> bool:
        return bool(self.fleet.done[self.d, self._chunk(key)])

    def put(self, key: str, data: object, *, verified_digest: str | None = None) -> int:
        raise AssertionError("the in-place sink receives, it is not put to")

    def receive(self, key: str, fill: Fill, *, start: int | None = None) -> int:
        fleet, c = self.fleet, self._chunk(key)
        begin = self.resume_point(key) if start is None else start
        size = int(fleet.sizes[c])
        end = fill(fleet.view[:size], begin, lambda n: None)
        if end < size:
            raise ChunkIncompleteError(f"chunk {key}: the source stopped at {end} of {size}")
        return end - begin

    def resume_point(self, key: str) -> int:
        return self.fleet.verified(self.d, self._chunk(key))

    @property
    def piece_size(self) -> int | None:
        return self.fleet.piece

    def _chunk(self, key: str) -> int:
        c = self.fleet.current().chunk
        assert key == self.fleet.keys[c], "a fetch asks about its own chunk"
        return c


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--nodes", type=int, default=8)
    p.add_argument("--chunks", type=int, default=32, help="1 MiB chunks")
    p.add_argument("--link-mbit", type=float, default=32)
    p.add_argument("--kill", type=float, default=0.0, help="fraction of nodes killed mid-stage")
    args = p.parse_args()
    link = args.link_mbit * 1e6 / 8
    s = Scenario(args.nodes, args.chunks * MiB, MiB, link, link, kill_fraction=args.kill)
    for name, fleet in (("simulated", Fleet(s)), ("real fetcher", RealFleet(s))):
        r = fleet.run()
        print(f"{r.line()} [{name}, {r.sim_wall_s:.1f} s]", flush=True)


if __name__ == "__main__":
    main()
