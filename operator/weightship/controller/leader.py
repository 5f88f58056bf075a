"""Leader election on a coordination.k8s.io Lease: only the replica holding it runs kopf.

`weightship operator --leader-elect` (the chart's default) waits for the Lease before it
starts kopf at all, so a standby has no watches, no worker threads and no API writes,
only a GET of the Lease every `retry_period_s` and a liveness endpoint of its own. The
leader renews the Lease every `retry_period_s`; when it has not renewed it for
`renew_deadline_s` (an API server it cannot reach, a Lease someone else took) it exits
the process at once, without cleanup, before a standby may take the Lease
(`lease_duration_s` after it last saw it change). Kubernetes restarts it as a standby.
On a graceful stop the leader releases the Lease, so the standby takes over at once.
A standby serves /metrics too (`weightship_operator_leader 0` and nothing else), so a
scrape of every operator pod finds no target down and no second copy of the leader's
series.

This is client-go's scheme (tools/leaderelection), with its safety argument:

- A standby times the Lease by its own monotonic clock, from when it *saw* the record
  change, never by the renewTime written in it: the replicas' wall clocks need not agree.
- The leader counts its renew deadline from when it *sent* the last renewal that
  succeeded; that renewal landed after that, and a standby saw it later still. So the
  leader is gone `lease_duration_s - renew_deadline_s` (5 s by default) before a standby
  may write. A renewal's requests are cut at the renew deadline (as client-go's context
  does), so a hung request cannot keep the leader past it.
- Every write of the Lease is a replace guarded by its resourceVersion: two standbys that
  both see it expire race on one write, and one of them gets a 409.

Why not kopf peering (kopf.dev's peering objects): peers of the same priority all pause
(a Deployment gives its replicas the same one), a SIGKILLed peer's record holds the others
off until its `lifetime` (60 s) expires, and a paused kopf keeps the work queue's threads,
informers and timers running, which this operator drives its reconciles from.
"""

from __future__ import annotations

import functools
import logging
import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol
from urllib.parse import urlsplit

from weightship.httpserver import QuietHandler, Server

log = logging.getLogger(__name__)

DEFAULT_LEASE = "weightship-operator"
# controller-runtime's defaults (client-go's leaderelection).
LEASE_DURATION_S = 15.0
RENEW_DEADLINE_S = 10.0
RETRY_PERIOD_S = 2.0


@dataclass(frozen=True)
class LeaseConfig:
    namespace: str
    identity: str
    name: str = DEFAULT_LEASE
    lease_duration_s: float = LEASE_DURATION_S
    renew_deadline_s: float = RENEW_DEADLINE_S
    retry_period_s: float = RETRY_PERIOD_S

    def __post_init__(self) -> None:
        if not 0 < self.retry_period_s < self.renew_deadline_s < self.lease_duration_s:
            raise ValueError(
                "leader election needs 0 < retry period < renew deadline < lease duration, "
                f"got {self.retry_period_s}, {self.renew_deadline_s}, {self.lease_duration_s}"
            )

    @property
    def request_timeout_s(self) -> float:
        """The most one Lease request may take: half the renew deadline, so a leader
        whose first renewal hangs still has time for another (a busy managed API server
        can take seconds); a renewal's requests are cut at its deadline besides."""
        return self.renew_deadline_s / 2


@dataclass(frozen=True)
class Record:
    """What the Lease says (`version` None: there is no Lease yet)."""

    holder: str
    duration_s: float
    transitions: int
    version: str | None
    renew_time: str = ""


NO_LEASE = Record(holder="", duration_s=0.0, transitions=0, version=None)


class Conflict(Exception):
    """The Lease changed (409) or already exists: someone else wrote first."""


class LeaseStore(Protocol):
    """`timeout_s`: the most the request may take (None: the store's own limit)."""

    def get(self, timeout_s: float | None = None) -> Record: ...
    def create(self, spec: dict[str, Any], timeout_s: float | None = None) -> Record: ...
    def replace(
        self, version: str, spec: dict[str, Any], timeout_s: float | None = None
    ) -> Record: ...


def may_acquire(record: Record, identity: str, observed_at: float, now: float) -> bool:
    """May `identity` write itself into the Lease now? `observed_at`: when this replica
    saw `record` change last, on its own monotonic clock."""
    if record.version is None or not record.holder or record.holder == identity:
        return True
    return now >= observed_at + record.duration_s


def micro_time(at: datetime | None = None) -> str:
    """A MicroTime as the API server writes it."""
    return (at or datetime.now(UTC)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class Elector:
    def __init__(
        self,
        store: LeaseStore,
        config: LeaseConfig,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], object] = time.sleep,
    ) -> None:
        self.store = store
        self.config = config
        self.clock = clock
        self.sleep = sleep
        self.record = NO_LEASE
        self._seen: tuple[str, str, str | None] | None = None
        self._observed_at = 0.0

    # ---- standby ------------------------------------------------------------------------
    def try_acquire(self) -> bool:
        """One round: read the Lease and take it if it is free, ours or expired."""
        try:
            record = self.store.get()
        except Exception as e:  # an API server we cannot reach: try again next round
            log.warning("reading Lease %s/%s failed: %s", *self._where(), e)
            return False
        now = self.clock()
        seen = (record.holder, record.renew_time, record.version)
        if seen != self._seen:
            self._seen, self._observed_at = seen, now
        self.record = record
        if not may_acquire(record, self.config.identity, self._observed_at, now):
            return False
        spec = self._spec(record, taking=record.holder != self.config.identity)
        try:
            if record.version is None:
                self.record = self.store.create(spec)
            else:
                self.record = self.store.replace(record.version, spec)
        except Conflict:
            return False
        except Exception as e:
            log.warning("taking Lease %s/%s failed: %s", *self._where(), e)
            return False
        return True

    def acquire(self, stop: threading.Event | None = None) -> bool:
        """Block until this replica holds the Lease (False: `stop` was set first)."""
        logged = False
        while stop is None or not stop.is_set():
            if self.try_acquire():
                return True
            if not logged:
                log.info(
                    "standby: Lease %s/%s is held by %s; taking over when it expires",
                    *self._where(),
                    self.record.holder,
                )
                logged = True
            self.sleep(self.config.retry_period_s * random.uniform(1.0, 1.2))  # noqa: S311 (jitter)
        return False

    # ---- leader -------------------------------------------------------------------------
    def renew(self, deadline: float | None = None) -> bool:
        """One renewal. False: the Lease is someone else's now (no point retrying).
        `deadline` (on `clock`): no request of it runs past that."""
        record = self.record
        if record.version is None:
            raise Conflict("no Lease to renew")

        def timeout() -> float | None:
            if deadline is None:
                return None
            left = deadline - self.clock()
            if left <= 0:
                raise TimeoutError("renew deadline reached")
            return min(left, self.config.request_timeout_s)

        try:
            spec = self._spec(record, taking=False)
            self.record = self.store.replace(record.version, spec, timeout_s=timeout())
            return True
        except Conflict:
            pass
        # 409: who changed it? (errors count against the deadline)
        current = self.store.get(timeout_s=timeout())
        self.record = current
        if current.holder != self.config.identity:
            return False
        raise Conflict("the Lease changed under its holder; renewing again")

    def keep(self, lost: Callable[[str], object], stop: threading.Event) -> None:
        """Renew every retry period until `stop`; call `lost` once the Lease is lost."""
        config = self.config
        last_ok = self.clock()
        while not stop.wait(config.retry_period_s):
            started = self.clock()
            try:
                if not self.renew(deadline=last_ok + config.renew_deadline_s):
                    lost(f"Lease taken by {self.record.holder}")
                    return
                last_ok = started
            except Exception as e:
                log.warning("renewing Lease %s/%s failed: %s", *self._where(), e)
            if self.clock() - last_ok >= config.renew_deadline_s:
                lost(f"Lease not renewed for {config.renew_deadline_s:g} s")
                return

    def release(self) -> None:
        """Give the Lease up (graceful stop): a standby takes it at its next look."""
        record = self.record
        if record.version is None or record.holder != self.config.identity:
            return
        spec = self._spec(record, taking=False)
        spec.update(holderIdentity="", leaseDurationSeconds=1)
        try:
            self.record = self.store.replace(record.version, spec)
        except Exception as e:
            log.warning("releasing Lease %s/%s failed: %s", *self._where(), e)

    def _spec(self, record: Record, taking: bool) -> dict[str, Any]:
        now = micro_time()
        spec: dict[str, Any] = {
            "holderIdentity": self.config.identity,
            "leaseDurationSeconds": max(1, round(self.config.lease_duration_s)),
            "renewTime": now,
            "leaseTransitions": record.transitions + (1 if taking and record.holder else 0),
        }
        if taking:
            spec["acquireTime"] = now
        return spec

    def _where(self) -> tuple[str, str]:
        return self.config.namespace, self.config.name


class KubeLeaseStore:
    """The Lease through the API (coordination.k8s.io/v1)."""

    def __init__(self, api: Any, namespace: str, name: str, timeout_s: float) -> None:
        """`timeout_s`: the limit of a request given none of its own."""
        from kubernetes import client

        self.leases = client.CoordinationV1Api(api)
        self.namespace, self.name, self.timeout_s = namespace, name, timeout_s

    def get(self, timeout_s: float | None = None) -> Record:
        from kubernetes.client.rest import ApiException

        try:
            lease = self.leases.read_namespaced_lease(
                self.name, self.namespace, _request_timeout=timeout_s or self.timeout_s
            )
        except ApiException as e:
            if e.status == 404:
                return NO_LEASE
            raise
        return self._record(lease)

    def create(self, spec: dict[str, Any], timeout_s: float | None = None) -> Record:
        body = {"metadata": {"name": self.name, "namespace": self.namespace}, "spec": spec}
        return self._write(
            lambda: self.leases.create_namespaced_lease(
                self.namespace, body, _request_timeout=timeout_s or self.timeout_s
            )
        )

    def replace(self, version: str, spec: dict[str, Any], timeout_s: float | None = None) -> Record:
        body = {
            "metadata": {
                "name": self.name,
                "namespace": self.namespace,
                "resourceVersion": version,
            },
            "spec": spec,
        }
        return self._write(
            lambda: self.leases.replace_namespaced_lease(
                self.name, self.namespace, body, _request_timeout=timeout_s or self.timeout_s
            )
        )

    def _write(self, call: Callable[[], Any]) -> Record:
        from kubernetes.client.rest import ApiException

        try:
            return self._record(call())
        except ApiException as e:
            if e.status == 409:
                raise Conflict(str(e.reason)) from e
            raise

    @staticmethod
    def _record(lease: Any) -> Record:
        spec = lease.spec
        renew = spec.renew_time
        return Record(
            holder=spec.holder_identity or "",
            duration_s=float(spec.lease_duration_seconds or 0),
            transitions=int(spec.lease_transitions or 0),
            version=lease.metadata.resource_version,
            renew_time=renew.isoformat() if isinstance(renew, datetime) else str(renew or ""),
        )


class _Healthz(QuietHandler):
    def do_GET(self) -> None:
        self.send_json(200, {"leader": False, "status": "standby"})


def standby_liveness(url: str | None) -> Server | None:
    """Serve kopf's liveness endpoint while kopf does not run yet (a standby is alive)."""
    if not url:
        return None
    parts = urlsplit(url)
    host, port = parts.hostname or "localhost", 80 if parts.port is None else parts.port
    return Server((host, port), _Healthz).start("standby-liveness")


@functools.cache
def _standby_registry() -> Any:
    from prometheus_client import CollectorRegistry, Gauge

    from weightship.controller.metrics import LEADER_HELP

    registry = CollectorRegistry()
    Gauge("weightship_operator_leader", LEADER_HELP, registry=registry).set(0)
    return registry


class _StandbyMetrics(QuietHandler):
    def do_GET(self) -> None:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        if urlsplit(self.path).path != "/metrics":
            self.send_bytes(404, b"", "text/plain")
            return
        self.send_bytes(200, generate_latest(_standby_registry()), CONTENT_TYPE_LATEST)


def standby_metrics(port: int | None, host: str = "0.0.0.0") -> Server | None:  # noqa: S104
    """Serve /metrics on the leader's port while this replica is a standby: the metrics
    Service selects every operator pod, and a pod that refused the scrape would be a
    target down (kube-prometheus' TargetDown). Only `weightship_operator_leader 0`: none
    of the leader's series, so absent(weightship_workqueue_depth) still means no leader."""
    if port is None:
        return None
    return Server((host, port), _StandbyMetrics).start("standby-metrics")


def _exit_now(reason: str) -> None:
    log.critical("lost leadership (%s): exiting now, before a standby takes over", reason)
    logging.shutdown()
    os._exit(1)


def run_elected(
    run: Callable[[], None],
    config: LeaseConfig,
    liveness_url: str | None,
    api: Any = None,
    lost: Callable[[str], object] = _exit_now,
    metrics_port: int | None = None,
) -> None:
    """Run `run` (kopf) only while this process holds the Lease; until then, answer the
    liveness probe and the metrics scrape as a standby."""
    if api is None:
        from weightship.kube.client import load_client

        api = load_client()
    store = KubeLeaseStore(api, config.namespace, config.name, config.request_timeout_s)
    elector = Elector(store, config)
    waited = time.monotonic()
    servers = [standby_liveness(liveness_url), standby_metrics(metrics_port)]
    try:
        elector.acquire()
    finally:
        for server in servers:
            if server is not None:
                server.stop()  # kopf's startup binds these ports next
    log.info(
        "leader: took Lease %s/%s as %s after %.2f s (transitions: %d)",
        config.namespace,
        config.name,
        config.identity,
        time.monotonic() - waited,
        elector.record.transitions,
    )
    stop = threading.Event()
    keeper = threading.Thread(
        target=elector.keep, args=(lost, stop), name="lease-renewer", daemon=True
    )
    keeper.start()
    try:
        run()
    finally:
        stop.set()
        keeper.join(config.retry_period_s * 2)
        elector.release()
        log.info("leader: released Lease %s/%s", config.namespace, config.name)
