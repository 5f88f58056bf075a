"""A work queue with controller-runtime's semantics, for a fixed pool of reconcile workers.

- A key is never handed to two workers at once.
- A key added any number of times before a worker takes it is worked once (a burst of
  watch events makes one reconcile).
- A key added while a worker has it is worked once more after `done` (nothing is lost).
- `add_after` schedules a key; a key keeps only its earliest timer, and taking the key
  drops its timer (the reconcile that runs returns its own next time).
- `add_rate_limited` backs off per key, exponentially, until `forget`.

Waiting workers sleep on one condition until the earliest timer is due: no timer thread.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class WorkQueue(Generic[K]):
    def __init__(
        self,
        *,
        base_delay_s: float = 0.005,
        max_delay_s: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.base_delay_s = base_delay_s
        self.max_delay_s = max_delay_s
        self.clock = clock
        self._cond = threading.Condition()
        self._queue: deque[K] = deque()
        self._dirty: set[K] = set()  # queued, or re-added while being worked
        self._processing: set[K] = set()
        self._timers: dict[K, float] = {}  # key -> earliest due time
        self._heap: list[tuple[float, int, K]] = []  # lazily pruned against _timers
        self._seq = itertools.count()
        self._failures: dict[K, int] = {}
        self._shutdown = False

    # ---- adding -----------------------------------------------------------------------
    def add(self, key: K) -> None:
        with self._cond:
            self._add_locked(key)

    def _add_locked(self, key: K) -> None:
        if self._shutdown or key in self._dirty:
            return
        self._dirty.add(key)
        if key not in self._processing:
            self._queue.append(key)
            self._cond.notify()

    def add_after(self, key: K, delay_s: float) -> None:
        if delay_s <= 0:
            self.add(key)
            return
        with self._cond:
            if self._shutdown:
                return
            due = self.clock() + delay_s
            if key in self._timers and self._timers[key] <= due:
                return
            self._timers[key] = due
            heapq.heappush(self._heap, (due, next(self._seq), key))
            self._cond.notify()

    def add_rate_limited(self, key: K) -> float:
        """Schedule `key` after its back-off (doubling per failure); returns the delay."""
        with self._cond:
            failures = self._failures.get(key, 0)
            self._failures[key] = failures + 1
        delay = min(self.max_delay_s, self.base_delay_s * 2.0**failures)
        self.add_after(key, delay)
        return delay

    def forget(self, key: K) -> None:
        """The key succeeded: its next failure backs off from the base delay again."""
        with self._cond:
            self._failures.pop(key, None)

    def failures(self, key: K) -> int:
        with self._cond:
            return self._failures.get(key, 0)

    # ---- working ----------------------------------------------------------------------
    def get(self, timeout_s: float | None = None) -> K | None:
        """The next key to work (the caller must call `done`), or None on shutdown or when
        `timeout_s` passes."""
        deadline = None if timeout_s is None else self.clock() + timeout_s
        with self._cond:
            while True:
                self._promote_due_locked()
                if self._shutdown:
                    return None
                if self._queue:
                    key = self._queue.popleft()
                    self._dirty.discard(key)
                    self._processing.add(key)
                    self._timers.pop(key, None)
                    return key
                now = self.clock()
                wait = None if not self._heap else max(0.0, self._heap[0][0] - now)
                if deadline is not None:
                    if now >= deadline:
                        return None
                    wait = deadline - now if wait is None else min(wait, deadline - now)
                self._cond.wait(wait)

    def done(self, key: K) -> None:
        with self._cond:
            self._processing.discard(key)
            if key in self._dirty:
                self._queue.append(key)
                self._cond.notify()

    def wait_idle(self, key: K, timeout_s: float) -> bool:
        """Wait until no worker holds ``key`` (at most ``timeout_s``); True when none does."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._cond:
                if key not in self._processing:
                    return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)

    def _promote_due_locked(self) -> None:
        now = self.clock()
        while self._heap and self._heap[0][0] <= now:
            due, _seq, key = heapq.heappop(self._heap)
            if self._timers.get(key) == due:
                del self._timers[key]
                self._add_locked(key)

    # ---- lifecycle and introspection --------------------------------------------------
    def shutdown(self) -> None:
        with self._cond:
            self._shutdown = True
            self._cond.notify_all()

    def __len__(self) -> int:
        """Keys ready to be worked now (not those being worked or waiting on a timer)."""
        with self._cond:
            return len(self._queue)

    def waiting(self) -> int:
        with self._cond:
            return len(self._timers)


class Workers(Generic[K]):
    """A fixed number of threads that take keys from a queue and run `work(key)`.

    `work` returns seconds until the key's next run (None: no timer); raising
    `requeue_now` types (a 409 Conflict) re-adds the key at once, without back-off; any
    other exception re-adds it with back-off.
    """

    def __init__(
        self,
        queue: WorkQueue[K],
        work: Callable[[K], float | None],
        count: int,
        *,
        on_error: Callable[[K, BaseException], None] = lambda key, error: None,
        requeue_now: tuple[type[BaseException], ...] = (),
        name: str = "reconcile",
    ) -> None:
        self.queue = queue
        self.work = work
        self.on_error = on_error
        self.requeue_now = requeue_now
        self.threads = [
            threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True)
            for i in range(count)
        ]

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self.queue.shutdown()
        deadline = time.monotonic() + timeout_s
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _run(self) -> None:
        while (key := self.queue.get()) is not None:
            try:
                delay = self.work(key)
            except self.requeue_now:
                self.queue.add(key)
            except Exception as e:
                self.on_error(key, e)
                self.queue.add_rate_limited(key)
            else:
                self.queue.forget(key)
                if delay is not None:
                    self.queue.add_after(key, delay)
            finally:
                self.queue.done(key)
