import functools
import threading
import time
from concurrent.futures import CancelledError

import pytest

from weightship.data.lanes import IntakePacer, KeyedLane


def test_a_blocked_key_never_takes_more_than_its_share_of_workers() -> None:
    release = threading.Event()
    lock = threading.Lock()
    running = {"slow": 0}
    most = {"slow": 0}

    def slow() -> None:
        with lock:
            running["slow"] += 1
            most["slow"] = max(most["slow"], running["slow"])
        release.wait(10)
        with lock:
            running["slow"] -= 1

    with KeyedLane(workers=4, per_key=2) as lane:
        blocked = [lane.submit("slow-owner", slow) for _ in range(6)]  # queued first
        fast = [lane.submit(f"owner-{i % 3}", functools.partial(int, i)) for i in range(9)]
        # The fast owners' tasks finish while the slow owner's hold two workers.
        assert [f.result(timeout=5) for f in fast] == list(range(9))
        assert not any(f.done() for f in blocked)
        release.set()
        for f in blocked:
            f.result(timeout=5)
    assert most["slow"] == 2


def test_tasks_start_in_submission_order() -> None:
    started: list[int] = []
    with KeyedLane(workers=1, per_key=1) as lane:
        gate = threading.Event()
        lane.submit("a", lambda: gate.wait(5))  # holds the one worker while we queue
        for i in range(6):
            lane.submit("abc"[i % 3], functools.partial(started.append, i))
        gate.set()
    assert started == list(range(6))


def test_a_widened_lane_runs_more_tasks_at_once_still_in_submission_order() -> None:
    lock = threading.Lock()
    started: list[int] = []
    running = [0, 0]  # now, most
    release = threading.Event()

    def task(i: int) -> None:
        with lock:
            started.append(i)
            running[0] += 1
            running[1] = max(running[1], running[0])
        release.wait(5)
        with lock:
            running[0] -= 1

    with KeyedLane(workers=2, per_key=8) as lane:
        futures = [lane.submit("origin", functools.partial(task, i)) for i in range(8)]
        deadline = time.monotonic() + 5
        while len(started) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        lane.widen(5)
        lane.widen(3)  # never narrower
        while len(started) < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert lane.workers == 5 and running[1] == 5
        release.set()
        for f in futures:
            f.result(timeout=5)
    assert started == list(range(8))


def test_errors_reach_the_future_and_cancelled_tasks_never_run() -> None:
    ran: list[int] = []
    gate = threading.Event()
    lane = KeyedLane(workers=1, per_key=1)
    failing = lane.submit("a", lambda: 1 / 0)
    holding = lane.submit("b", lambda: gate.wait(5))
    queued = lane.submit("c", lambda: ran.append(1))
    with pytest.raises(ZeroDivisionError):
        failing.result(timeout=5)
    while not holding.running():
        threading.Event().wait(0.01)
    lane.shutdown(wait=False, cancel_futures=True)
    gate.set()
    lane.shutdown(wait=True)
    with pytest.raises(CancelledError):
        queued.result(timeout=1)
    assert ran == []
    with pytest.raises(RuntimeError, match="after shutdown"):
        lane.submit("a", lambda: None)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_peer_intake_keeps_pace_with_the_nodes_own_origin_queue() -> None:
    clock = FakeClock()
    # 4 own chunks pay for 28 peer chunks: 7 per own chunk, and one round of slack.
    pacer = IntakePacer(own_bytes=4, peer_bytes=28, slack_bytes=7, stall_s=5, clock=clock)
    never = threading.Event()
    for _ in range(7):
        pacer.admit(1, never)  # the slack: returns at once
    assert not pacer.may_start(1)
    pacer.own_progress(1)
    assert pacer.may_start(7) and not pacer.may_start(8)

    admitted = threading.Event()

    def take_eight() -> None:
        for _ in range(8):
            pacer.admit(1, never)
        admitted.set()

    threading.Thread(target=take_eight, daemon=True).start()
    assert not admitted.wait(0.3)  # seven pass, the eighth waits for an own chunk
    pacer.own_progress(1)
    assert admitted.wait(5)


def test_peer_intake_is_never_held_by_an_origin_that_stalled_or_is_done() -> None:
    clock = FakeClock()
    pacer = IntakePacer(own_bytes=4, peer_bytes=28, slack_bytes=0, stall_s=5, clock=clock)
    assert not pacer.may_start(1)
    clock.now = 5.0  # no own progress for stall_s
    assert pacer.may_start(28)
    pacer.own_progress(1)  # it moves again, not done: paced again
    assert pacer.may_start(7) and not pacer.may_start(8)
    pacer.own_progress(3)  # own queue done: never paced again, however much it takes
    assert pacer.may_start(10**12)
    # A node that owns nothing is never paced, and a cancelled stage never waits.
    assert IntakePacer(own_bytes=0, peer_bytes=28, slack_bytes=0).may_start(28)
    cancelled = threading.Event()
    cancelled.set()
    IntakePacer(own_bytes=4, peer_bytes=28, slack_bytes=0).admit(28, cancelled)
