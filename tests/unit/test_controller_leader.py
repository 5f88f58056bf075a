"""Leader election on a Lease (controller/leader.py), against an in-memory Lease with the
API server's optimistic concurrency (a replace with a stale resourceVersion is a 409)."""

from __future__ import annotations

import threading
import time
import urllib.request
from typing import Any

import pytest

from weightship.controller import leader
from weightship.controller.leader import Conflict, Elector, LeaseConfig, Record


class MemoryLease:
    def __init__(self) -> None:
        self.spec: dict[str, Any] | None = None
        self.version = 0
        self.fail = False
        self.timeouts: list[float | None] = []  # each request's timeout_s

    def _record(self) -> Record:
        if self.spec is None:
            return leader.NO_LEASE
        return Record(
            holder=self.spec.get("holderIdentity") or "",
            duration_s=float(self.spec["leaseDurationSeconds"]),
            transitions=int(self.spec.get("leaseTransitions") or 0),
            version=str(self.version),
            renew_time=self.spec["renewTime"],
        )

    def get(self, timeout_s: float | None = None) -> Record:
        self.timeouts.append(timeout_s)
        if self.fail:
            raise OSError("API server unreachable")
        return self._record()

    def create(self, spec: dict[str, Any], timeout_s: float | None = None) -> Record:
        self.timeouts.append(timeout_s)
        if self.fail:
            raise OSError("API server unreachable")
        if self.spec is not None:
            raise Conflict("exists")
        self.spec, self.version = dict(spec), self.version + 1
        return self._record()

    def replace(self, version: str, spec: dict[str, Any], timeout_s: float | None = None) -> Record:
        self.timeouts.append(timeout_s)
        if self.fail:
            raise OSError("API server unreachable")
        if self.spec is None or version != str(self.version):
            raise Conflict("stale resourceVersion")
        old = self.spec
        self.spec = {"acquireTime": old.get("acquireTime"), **spec}
        self.version += 1
        return self._record()


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def config(identity: str) -> LeaseConfig:
    return LeaseConfig(namespace="ws", identity=identity)


def test_the_first_replica_creates_the_lease_and_the_second_waits_for_it_to_expire() -> None:
    lease, clock = MemoryLease(), Clock()
    a, b = Elector(lease, config("a"), clock), Elector(lease, config("b"), clock)
    assert a.try_acquire()
    assert lease.spec is not None and lease.spec["holderIdentity"] == "a"
    # controller-runtime's defaults: 15 s Lease, 10 s renew deadline, 2 s retry period.
    assert lease.spec["leaseDurationSeconds"] == 15 and "acquireTime" in lease.spec
    assert not b.try_acquire()  # b sees it for the first time now: 15 s from now
    clock.now += 14.9
    assert not b.try_acquire()
    clock.now += 0.2
    assert b.try_acquire()
    assert lease.spec["holderIdentity"] == "b" and lease.spec["leaseTransitions"] == 1


def test_a_renewing_leader_keeps_the_standby_off_however_long() -> None:
    lease, clock = MemoryLease(), Clock()
    a, b = Elector(lease, config("a"), clock), Elector(lease, config("b"), clock)
    assert a.try_acquire()
    for _ in range(40):
        assert not b.try_acquire()
        clock.now += 1.0
        assert a.renew()
    assert lease.spec is not None and lease.spec["holderIdentity"] == "a"


def test_the_standby_times_the_lease_by_its_own_clock_not_renew_time() -> None:
    """A leader whose wall clock is far behind writes an old renewTime: the standby times
    the Lease from when it saw the record change, so that changes nothing."""
    lease, clock = MemoryLease(), Clock()
    a, b = Elector(lease, config("a"), clock), Elector(lease, config("b"), clock)
    assert a.try_acquire()
    assert lease.spec is not None
    lease.spec["renewTime"] = "2001-01-01T00:00:00.000000Z"
    assert not b.try_acquire()
    clock.now += 7.0
    assert not b.try_acquire()


def test_two_standbys_racing_for_an_expired_lease_take_it_once() -> None:
    lease, clock = MemoryLease(), Clock()
    a = Elector(lease, config("a"), clock)
    b, c = Elector(lease, config("b"), clock), Elector(lease, config("c"), clock)
    assert a.try_acquire()
    assert not b.try_acquire() and not c.try_acquire()
    clock.now += 16

    class Racing(MemoryLease):
        """c reads the expired Lease, then b takes it before c's write lands."""

        def replace(
            self, version: str, spec: dict[str, Any], timeout_s: float | None = None
        ) -> Record:
            assert b.try_acquire()
            return lease.replace(version, spec)

        def get(self, timeout_s: float | None = None) -> Record:
            return lease.get()

    c.store = Racing()
    assert not c.try_acquire()
    assert lease.spec is not None and lease.spec["holderIdentity"] == "b"
    assert lease.spec["leaseTransitions"] == 1


def test_a_released_lease_is_taken_at_once() -> None:
    lease, clock = MemoryLease(), Clock()
    a, b = Elector(lease, config("a"), clock), Elector(lease, config("b"), clock)
    assert a.try_acquire()
    assert not b.try_acquire()
    a.release()
    assert lease.spec is not None and lease.spec["holderIdentity"] == ""
    assert b.try_acquire()
    assert lease.spec["holderIdentity"] == "b"


def test_a_restarted_leader_with_the_same_identity_takes_its_lease_back_at_once() -> None:
    """A container restarted in its pod keeps its pod name (POD_ID): its old process is
    dead, so waiting out the Lease would only add downtime."""
    lease, clock = MemoryLease(), Clock()
    assert Elector(lease, config("pod-a"), clock).try_acquire()
    again = Elector(lease, config("pod-a"), clock)
    assert again.try_acquire()
    assert lease.spec is not None and lease.spec["leaseTransitions"] == 0


def test_an_unreachable_api_server_is_only_a_failed_round_for_a_standby() -> None:
    lease, clock = MemoryLease(), Clock()
    lease.fail = True
    b = Elector(lease, config("b"), clock)
    assert not b.try_acquire()
    lease.fail = False
    assert b.try_acquire()


class Lost:
    def __init__(self) -> None:
        self.reasons: list[str] = []
        self.called = threading.Event()

    def __call__(self, reason: str) -> None:
        self.reasons.append(reason)
        self.called.set()


def fast(identity: str) -> LeaseConfig:
    return LeaseConfig(
        namespace="ws",
        identity=identity,
        lease_duration_s=0.8,
        renew_deadline_s=0.3,
        retry_period_s=0.05,
    )


def test_the_leader_gives_up_past_its_renew_deadline_before_the_lease_expires() -> None:
    lease = MemoryLease()
    a = Elector(lease, fast("a"))
    assert a.try_acquire()
    lost, stop = Lost(), threading.Event()
    keeper = threading.Thread(target=a.keep, args=(lost, stop), daemon=True)
    keeper.start()
    lease.fail = True  # renewals fail from now on
    assert lost.called.wait(5)
    stop.set()
    keeper.join(5)
    assert lost.reasons == ["Lease not renewed for 0.3 s"]


def test_the_leader_gives_up_at_once_when_someone_else_holds_the_lease() -> None:
    lease = MemoryLease()
    a = Elector(lease, fast("a"))
    assert a.try_acquire()
    assert lease.spec is not None
    lease.replace(str(lease.version), {**lease.spec, "holderIdentity": "intruder"})
    lost, stop = Lost(), threading.Event()
    keeper = threading.Thread(target=a.keep, args=(lost, stop), daemon=True)
    keeper.start()
    assert lost.called.wait(5)
    stop.set()
    assert lost.reasons == ["Lease taken by intruder"]


def test_a_renewals_requests_end_by_its_renew_deadline() -> None:
    """A hung request cannot keep a leader past its renew deadline: each request of a
    renewal gets at most the time left (and at most half the deadline, so a first hung
    one leaves time for another); past the deadline none is sent."""
    lease, clock = MemoryLease(), Clock()
    a = Elector(lease, config("a"), clock)
    assert a.try_acquire()
    assert a.config.request_timeout_s == 5.0
    lease.timeouts.clear()
    assert a.renew(deadline=clock.now + 3)
    assert a.renew(deadline=clock.now + 10)
    assert lease.timeouts == [3.0, 5.0]
    with pytest.raises(TimeoutError):
        a.renew(deadline=clock.now)
    assert len(lease.timeouts) == 2


def test_the_leaders_renewals_are_bounded_by_its_deadline() -> None:
    """keep() passes the deadline: every renewal's request is given at most what is left
    of renew_deadline_s since the last renewal that succeeded."""
    lease = MemoryLease()
    a = Elector(lease, fast("a"))
    assert a.try_acquire()
    lease.timeouts.clear()
    lost, stop = Lost(), threading.Event()
    keeper = threading.Thread(target=a.keep, args=(lost, stop), daemon=True)
    keeper.start()
    time.sleep(0.3)
    stop.set()
    keeper.join(5)
    assert lease.timeouts and not lost.reasons
    assert all(t is not None and 0 < t <= 0.15 for t in lease.timeouts), lease.timeouts


def test_settings_must_leave_the_leader_time_to_stop() -> None:
    with pytest.raises(ValueError, match="renew deadline < lease duration"):
        LeaseConfig(namespace="ws", identity="a", lease_duration_s=5, renew_deadline_s=5)


def test_a_standby_answers_its_liveness_probe() -> None:
    server = leader.standby_liveness("http://127.0.0.1:0/healthz")
    assert server is not None
    try:
        port = server.server_address[1]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as resp:
            assert resp.status == 200
            assert b"standby" in resp.read()
    finally:
        server.stop()


def test_a_standby_serves_metrics_that_say_it_is_not_the_leader() -> None:
    """The metrics Service selects every operator pod: a standby answers the scrape (no
    target down) with `weightship_operator_leader 0` and none of the leader's series, so
    absent(weightship_workqueue_depth) (WeightshipOperatorDown) still means no leader."""
    server = leader.standby_metrics(0, host="127.0.0.1")
    assert server is not None
    try:
        port = server.server_address[1]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            assert resp.status == 200
            text = resp.read().decode()
    finally:
        server.stop()
    series = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert series == ["weightship_operator_leader 0.0"]
    assert leader.standby_metrics(None) is None
