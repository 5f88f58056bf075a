"""The reconcile work queue's semantics, with real threads (controller/workqueue.py)."""

from __future__ import annotations

import operator
import threading
import time
from collections import Counter
from functools import partial

from weightship.controller.workqueue import Workers, WorkQueue


def test_a_burst_of_adds_is_worked_once() -> None:
    q: WorkQueue[str] = WorkQueue()
    for _ in range(100):
        q.add("a")
    q.add("b")
    assert len(q) == 2
    assert q.get(0) == "a"
    assert q.get(0) == "b"
    assert q.get(0) is None


def test_one_worker_per_key_and_a_re_add_while_worked_runs_once_after() -> None:
    q: WorkQueue[str] = WorkQueue()
    q.add("a")
    assert q.get(0) == "a"
    q.add("a")
    q.add("a")
    assert q.get(0) is None  # still being worked: not handed out again
    q.done("a")
    assert q.get(0) == "a"  # the re-add, once
    q.done("a")
    assert q.get(0) is None


def test_concurrent_workers_never_overlap_on_a_key() -> None:
    q: WorkQueue[int] = WorkQueue()
    active: set[int] = set()
    lock = threading.Lock()
    overlaps = []
    runs: Counter[int] = Counter()

    def work(key: int) -> None:
        with lock:
            if key in active:
                overlaps.append(key)
            active.add(key)
            runs[key] += 1
        time.sleep(0.001)
        with lock:
            active.discard(key)

    workers = Workers(q, work, 8)
    workers.start()
    for _ in range(50):
        for key in range(10):
            q.add(key)
        time.sleep(0.0005)
    deadline = time.monotonic() + 5
    while (len(q) or active) and time.monotonic() < deadline:
        time.sleep(0.01)
    workers.stop()
    assert not overlaps
    assert set(runs) == set(range(10))
    assert all(n < 50 for n in runs.values())  # de-duplicated, yet every key ran


class FakeClock:
    """The queue's clock, moved by the test: timers fall due when it says, not the wall."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_add_after_keeps_the_earliest_timer_and_get_waits_for_it() -> None:
    clock = FakeClock()
    q: WorkQueue[str] = WorkQueue(clock=clock)
    q.add_after("a", 5.0)
    q.add_after("a", 0.05)
    q.add_after("a", 10.0)
    assert q.waiting() == 1
    assert q.get(0) is None  # not due yet
    clock.now = 0.049
    assert q.get(0) is None
    clock.now = 0.05
    assert q.get(0) == "a"
    q.done("a")
    clock.now = 100.0
    assert q.get(0) is None  # the later timers were dropped, not kept


def test_taking_a_key_drops_its_timer() -> None:
    clock = FakeClock()
    q: WorkQueue[str] = WorkQueue(clock=clock)
    q.add_after("a", 0.1)
    q.add("a")
    assert q.get(0) == "a"
    q.done("a")
    assert q.waiting() == 0
    clock.now = 1.0
    assert q.get(0) is None


def test_a_zero_delay_is_now_not_later() -> None:
    q: WorkQueue[str] = WorkQueue()
    q.add_after("a", 0)
    assert q.get(0) == "a"


def test_rate_limited_back_off_doubles_until_forget() -> None:
    q: WorkQueue[str] = WorkQueue(base_delay_s=0.01, max_delay_s=0.05)
    assert [q.add_rate_limited("a") for _ in range(5)] == [0.01, 0.02, 0.04, 0.05, 0.05]
    assert q.failures("a") == 5
    q.forget("a")
    assert q.add_rate_limited("a") == 0.01


def test_workers_back_off_on_errors_requeue_conflicts_at_once_and_follow_delays() -> None:
    clock = FakeClock()
    q: WorkQueue[str] = WorkQueue(base_delay_s=1.0, clock=clock)
    calls: list[tuple[str, float]] = []
    errors: list[str] = []
    ran = threading.Condition()

    class Conflict(Exception):
        pass

    def work(key: str) -> float | None:
        with ran:
            calls.append((key, clock.now))
            ran.notify_all()
        n = sum(1 for k, _ in calls if k == key)
        if key == "fails" and n <= 3:
            raise RuntimeError("boom")
        if key == "conflicts" and n == 1:
            raise Conflict
        if key == "timer" and n == 1:
            return 10.0
        return None

    def settle(now: float) -> None:
        """Move the clock to `now` and return once the worker has run every key due by
        then: a probe taken at `now` promotes them ahead of a second probe, added after."""
        clock.now = now
        for probe in ("probe-1", "probe-2"):
            q.add(probe)
            with ran:
                assert ran.wait_for(partial(operator.contains, calls, (probe, now)), 10), calls
        calls[:] = [c for c in calls if not c[0].startswith("probe")]

    def runs(key: str) -> list[float]:
        return [t for k, t in calls if k == key]

    workers = Workers(
        q, work, 1, on_error=lambda key, e: errors.append(key), requeue_now=(Conflict,)
    )
    workers.start()
    try:
        for key in ("fails", "conflicts", "timer"):
            q.add(key)
        settle(0.0)
        assert runs("conflicts") == [0.0, 0.0]  # a conflict runs again at once
        assert runs("fails") == [0.0] and q.failures("fails") == 1
        assert runs("timer") == [0.0] and q.waiting() == 2
        # Back-off doubles per failure: due after 1, 2 and 4 s.
        for before, due in ((0.99, 1.0), (2.99, 3.0), (6.99, 7.0)):
            settle(before)
            assert runs("fails")[-1] < before
            settle(due)
            assert runs("fails")[-1] == due
        assert runs("fails") == [0.0, 1.0, 3.0, 7.0] and errors == ["fails"] * 3
        assert q.failures("fails") == 0  # forgotten after the success
        settle(9.99)
        assert runs("timer") == [0.0]
        settle(10.0)
        assert runs("timer") == [0.0, 10.0]  # the delay the work returned
        assert runs("conflicts") == [0.0, 0.0]
    finally:
        workers.stop()


def test_shutdown_releases_waiting_workers() -> None:
    q: WorkQueue[str] = WorkQueue()
    workers = Workers(q, lambda key: None, 4)
    workers.start()
    workers.stop(timeout_s=5)
    assert not any(t.is_alive() for t in workers.threads)
    q.add("late")
    assert len(q) == 0


def test_wait_idle_returns_once_the_worker_holding_the_key_is_done() -> None:
    """The workloadRef deletion handler waits out a reconcile in flight this way."""
    q: WorkQueue[str] = WorkQueue()
    assert q.wait_idle("a", 0)  # nobody holds it
    q.add("a")
    assert q.get(0) == "a"
    assert not q.wait_idle("a", 0.1)  # held: times out
    threading.Timer(0.2, q.done, args=("a",)).start()
    assert q.wait_idle("a", 5)
