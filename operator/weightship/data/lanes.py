"""A thread pool that keeps one slow source from taking every worker.

The peer lane fetches chunks from their owners. With a plain FIFO pool, the workers that
reach a lagging owner's chunks all wait on it (the owner holds each request until the
chunk lands) while chunks that other owners already have sit in the queue, and the
node's downlink idles. ``KeyedLane`` runs tasks in submission order, but never more than
``per_key`` at once for one key (the owner): a worker skips to the next owner that has
room. Two per owner lets the request for an owner's next chunk wait at the owner while
the current one transfers, so a chunk leaves as soon as it lands, and a receiver that
fell behind an owner can catch up on two streams.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

from weightship.data import schedule

T = TypeVar("T")


class KeyedLane:
    """``workers`` threads; tasks start in submission order among keys under their limit."""

    def __init__(self, workers: int, per_key: int, name: str = "lane") -> None:
        if workers < 1 or per_key < 1:
            raise ValueError("workers and per_key must be at least 1")
        self.per_key = per_key
        self._cond = threading.Condition()
        self._pending: dict[str, deque[tuple[int, Future[object], Callable[[], object]]]] = {}
        self._running: Counter[str] = Counter()
        self._seq = itertools.count()
        self._closed = False
        self._name = name
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
            for i in range(workers)
        ]
        for t in self._threads:
            t.start()

    @property
    def workers(self) -> int:
        return len(self._threads)

    def widen(self, workers: int) -> None:
        """Run with ``workers`` threads from now on (never fewer than now)."""
        with self._cond:
            if self._closed:
                return
            while len(self._threads) < workers:
                t = threading.Thread(
                    target=self._work, name=f"{self._name}-{len(self._threads)}", daemon=True
                )
                self._threads.append(t)
                t.start()
            self._cond.notify_all()

    def submit(self, key: str, fn: Callable[[], T]) -> Future[T]:
        future: Future[T] = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("submit after shutdown")
            queue = self._pending.setdefault(key, deque())
            queue.append((next(self._seq), future, fn))  # type: ignore[arg-type]
            self._cond.notify()
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop taking tasks; queued ones still run unless ``cancel_futures``."""
        with self._cond:
            self._closed = True
            if cancel_futures:
                for queue in self._pending.values():
                    for _, future, _ in queue:
                        future.cancel()
                self._pending.clear()
            self._cond.notify_all()
        if wait:
            for t in self._threads:
                t.join()

    def __enter__(self) -> KeyedLane:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown(wait=True)

    def _take(self) -> tuple[str, Future[object], Callable[[], object]] | None:
        """The earliest-submitted task whose key has room (call with the lock held)."""
        best: str | None = None
        best_seq = -1
        for key, queue in self._pending.items():
            if self._running[key] >= self.per_key:
                continue
            if best is None or queue[0][0] < best_seq:
                best, best_seq = key, queue[0][0]
        if best is None:
            return None
        _, future, fn = self._pending[best].popleft()
        if not self._pending[best]:
            del self._pending[best]
        self._running[best] += 1
        return best, future, fn

    def _work(self) -> None:
        while True:
            with self._cond:
                while (task := self._take()) is None:
                    if self._closed and not self._pending:
                        return
                    self._cond.wait()
            key, future, fn = task
            try:
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn())
                    except BaseException as exc:  # the caller gets it, as from an executor
                        future.set_exception(exc)
            finally:
                with self._cond:
                    self._running[key] -= 1
                    self._cond.notify_all()


class IntakePacer:
    """Keeps a node from taking other owners' chunks much faster than it fetches its own.

    An owner's downlink carries its own origin stream and its peer fetches, and TCP gives
    each flow about the same share: a node that pulls many peer chunks at once starves
    the origin stream that every other node is waiting on (measured: one such owner got
    1 MiB/s from the origin while the others got 3). So a peer fetch starts only while
    the bytes taken from peers stay within this node's own origin progress, scaled, plus
    ``slack_bytes``: take as you give. It never waits on what may not come: when this node
    owns nothing, its own queue is done, or its origin has not moved for ``stall_s``, every
    fetch may start.
    """

    def __init__(
        self,
        own_bytes: int,
        peer_bytes: int,
        slack_bytes: int,
        stall_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.own_bytes, self.peer_bytes, self.slack_bytes = own_bytes, peer_bytes, slack_bytes
        self.stall_s = stall_s
        self._clock = clock
        self._cond = threading.Condition()
        self._own_done = 0
        self._peer_started = 0
        self._moved_at = clock()

    def own_progress(self, n: int) -> None:
        """``n`` bytes of this node's own queue are done (fetched, or handed to a claimant)."""
        with self._cond:
            self._own_done += n
            self._moved_at = self._clock()
            self._cond.notify_all()

    def admit(self, n: int, cancel: threading.Event) -> None:
        """Wait until this node may start taking ``n`` more bytes from peers."""
        with self._cond:
            while not self.may_start(n) and not cancel.is_set():
                self._cond.wait(0.25)  # also wakes to notice a stalled origin
            self._peer_started += n

    def may_start(self, n: int) -> bool:
        if self._own_done >= self.own_bytes or self._clock() - self._moved_at >= self.stall_s:
            return True
        allowed = self._own_done / self.own_bytes * self.peer_bytes + self.slack_bytes
        return self._peer_started + n <= allowed


class OriginReads:
    """An origin lane's last reads (``schedule.OriginRead``), as they end; says how many
    requests the lane should keep in flight (``schedule.widened_origin_requests``).
    Thread-safe."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._reads: deque[schedule.OriginRead] = deque(maxlen=2 * schedule.ORIGIN_REQUESTS_MAX)

    def read(self, first_byte_s: float, transfer_s: float, *, in_flight: int) -> int:
        """A read just ended that waited ``first_byte_s`` for its first byte and moved
        bytes for ``transfer_s``; the lane runs ``in_flight`` requests."""
        end = self._clock()
        with self._lock:
            first_byte = end - transfer_s
            self._reads.append(schedule.OriginRead(first_byte - first_byte_s, first_byte, end))
            return schedule.widened_origin_requests(in_flight, list(self._reads))

    def idle_share(self, last: int) -> float:
        with self._lock:
            return schedule.origin_idle_share(list(self._reads)[-last:])
