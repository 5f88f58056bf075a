"""Steady client load through a Service, as a router would send it: only to the Service's
ready endpoints (its EndpointSlices), round robin, each request with a client timeout.
Every answer is recorded with the revision the server stamped on it (the weightship vLLM
plugin's X-Weightship-Revision header), so a test can tell which weights answered.

Bounded: a fixed number of sender threads, at most ``max_requests`` requests, and it stops
by itself after ``max_seconds``. Like a router, it drops an upstream connection idle for
longer than ``IDLE_LIMIT_S`` rather than reuse it: under the server's keep-alive timeout
(vLLM's uvicorn: 5 s), so no request goes out on a connection the server is closing.
Loopback and the project's own namespaces only (the pods' addresses on the local
cluster's bridge).
"""

from __future__ import annotations

import json
import logging
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import urllib3
from kubernetes import client

from weightship.api.inference import DIGEST_HEADER, REVISION_HEADER

log = logging.getLogger(__name__)
IDLE_LIMIT_S = 2.0
"""Longest a pooled connection may sit idle and still be reused: well under uvicorn's
keep-alive timeout (5 s, vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE). A request sent as the server
closes an idle connection is lost (RemoteDisconnected with no answer); routers avoid that
race the same way (an upstream idle timeout below the backend's keep-alive)."""


def app_service(core: client.CoreV1Api, namespace: str, app: str, port: int) -> None:
    """A Service named ``app`` over the pods labelled ``app=<app>``: what the load sends to."""
    core.create_namespaced_service(
        namespace,
        {
            "metadata": {"name": app},
            "spec": {"selector": {"app": app}, "ports": [{"port": port, "targetPort": port}]},
        },
    )


def chat_load(
    api: client.ApiClient,
    namespace: str,
    app: str,
    *,
    max_tokens: int,
    rate: float,
    timeout_s: float,
) -> ServiceLoad:
    """Greedy chat requests to the ready endpoints of the Service ``app`` over real vLLM
    pods (``weightship_testing.tinyvllm.deploy``), ``rate`` a second: use it as a context
    manager, or call ``start``."""
    # Here, not at the top: tinyvllm imports torch (1.4 s), which other loads do not need.
    from weightship_testing.tinyvllm import deploy

    return ServiceLoad(
        api,
        namespace,
        app,
        deploy.PORT,
        deploy.CHAT_PATH,
        deploy.chat_request(max_tokens=max_tokens),
        rate=rate,
        timeout_s=timeout_s,
    )


class IdleBoundedPool(urllib3.HTTPConnectionPool):
    """A connection pool that closes a connection idle for longer than ``idle_limit_s``
    before reusing it (urllib3 reconnects it), instead of racing the server's close."""

    def __init__(self, host: str, port: int, *, idle_limit_s: float, maxsize: int) -> None:
        super().__init__(host, port, maxsize=maxsize, retries=False)
        self.idle_limit_s = idle_limit_s
        self._idle_since: weakref.WeakKeyDictionary[Any, float] = weakref.WeakKeyDictionary()

    def _get_conn(self, timeout: float | None = None) -> Any:
        conn = super()._get_conn(timeout)
        since = self._idle_since.pop(conn, None)
        if since is not None and time.monotonic() - since > self.idle_limit_s:
            conn.close()
        return conn

    def _put_conn(self, conn: Any) -> None:
        if conn is not None:
            self._idle_since[conn] = time.monotonic()
        super()._put_conn(conn)


@dataclass(frozen=True)
class Answer:
    started: float  # time.monotonic()
    finished: float
    endpoint: str
    status: int | None  # None: no HTTP answer (connection refused or reset, timeout)
    error: str | None = None
    revision: str | None = None
    digest: str | None = None
    text: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200


@dataclass
class ServiceLoad:
    api: client.ApiClient
    namespace: str
    service: str
    port: int
    path: str
    body: dict[str, Any]
    rate: float = 4.0  # requests per second, all senders together
    senders: int = 4
    timeout_s: float = 30.0
    max_requests: int = 20_000
    max_seconds: float = 1800.0
    answers: list[Answer] = field(default_factory=list)
    no_endpoint_waits: int = 0
    """Times a sender found no ready endpoint and waited (a router would queue or 503)."""
    endpoint_samples: list[tuple[float, int]] = field(default_factory=list)
    """Each read of the Service's EndpointSlices (every 0.2 s): when (time.monotonic())
    and how many ready endpoints it had; bounded by ``max_seconds``."""
    idle_limit_s: float = IDLE_LIMIT_S

    def __post_init__(self) -> None:
        self._discovery = client.DiscoveryV1Api(self.api)
        self._pools: dict[str, IdleBoundedPool] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._endpoints: list[str] = []
        self._next = 0
        self._threads: list[threading.Thread] = []

    def __enter__(self) -> ServiceLoad:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self._refresh()
        self._deadline = time.monotonic() + self.max_seconds
        watcher = threading.Thread(target=self._watch_endpoints, name="load-endpoints", daemon=True)
        self._threads = [watcher] + [
            threading.Thread(target=self._send, name=f"load-{i}", daemon=True)
            for i in range(self.senders)
        ]
        for thread in self._threads:
            thread.start()

    def stop(self) -> list[Answer]:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=self.timeout_s + 5)
        return list(self.answers)

    def failed(self) -> list[Answer]:
        with self._lock:
            return [a for a in self.answers if not a.ok]

    def count(self) -> int:
        with self._lock:
            return len(self.answers)

    def _refresh(self) -> None:
        slices = self._discovery.list_namespaced_endpoint_slice(
            self.namespace, label_selector=f"kubernetes.io/service-name={self.service}"
        ).items
        ready = sorted(
            address
            for s in slices
            for e in s.endpoints or []
            if e.conditions is not None and e.conditions.ready
            for address in e.addresses or []
        )
        with self._lock:
            self._endpoints = ready
            self.endpoint_samples.append((time.monotonic(), len(ready)))

    def _watch_endpoints(self) -> None:
        while not self._stop.wait(0.2):
            try:
                self._refresh()
            except Exception as e:  # the API server is busy: keep the last set
                log.debug("endpoint slices of %s not read: %s", self.service, e)

    def _pick(self) -> str | None:
        with self._lock:
            if not self._endpoints:
                return None
            self._next += 1
            return self._endpoints[self._next % len(self._endpoints)]

    def _send(self) -> None:
        interval = self.senders / self.rate
        while not self._stop.is_set() and time.monotonic() < self._deadline:
            if self.count() >= self.max_requests:
                return
            tick = time.monotonic()
            endpoint = self._pick()
            if endpoint is None:
                with self._lock:
                    self.no_endpoint_waits += 1
                self._stop.wait(0.1)
                continue
            answer = self._one(endpoint)
            with self._lock:
                self.answers.append(answer)
            self._stop.wait(max(0.0, interval - (time.monotonic() - tick)))

    def _pool(self, endpoint: str) -> IdleBoundedPool:
        with self._lock:
            pool = self._pools.get(endpoint)
            if pool is None:
                pool = IdleBoundedPool(
                    endpoint, self.port, idle_limit_s=self.idle_limit_s, maxsize=self.senders
                )
                self._pools[endpoint] = pool
            return pool

    def _one(self, endpoint: str) -> Answer:
        started = time.monotonic()
        try:
            response = self._pool(endpoint).request(
                "POST",
                self.path,
                body=json.dumps(self.body).encode(),
                headers={"Content-Type": "application/json"},
                timeout=urllib3.Timeout(connect=5.0, read=self.timeout_s),
            )
        except urllib3.exceptions.HTTPError as e:
            # The cause too (reset, refused, timed out): a failure must say what happened.
            why = f"{type(e).__name__}: {e}"[:300]
            return Answer(started, time.monotonic(), endpoint, None, error=why)
        text = None
        try:
            doc = json.loads(response.data)
            choice = doc["choices"][0]
            text = choice.get("message", {}).get("content") or choice.get("text")
        except (ValueError, KeyError, IndexError, TypeError, AttributeError):
            pass
        return Answer(
            started,
            time.monotonic(),
            endpoint,
            response.status,
            revision=response.headers.get(REVISION_HEADER),
            digest=response.headers.get(DIGEST_HEADER),
            text=text,
        )


@dataclass
class RevisionTimeline:
    """Which revisions a rollout allowed to serve, sampled over time: the stable, and the
    canary unless aborted. A response may carry any revision allowed while it ran."""

    api: client.ApiClient
    namespace: str
    name: str
    samples: list[tuple[float, frozenset[str]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._custom = client.CustomObjectsApi(self.api)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="timeline", daemon=True)

    def __enter__(self) -> RevisionTimeline:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _sample(self) -> None:
        body = self._custom.get_namespaced_custom_object(
            "weightship.io", "v1alpha1", self.namespace, "modelrollouts", self.name
        )
        status = body.get("status") or {}
        allowed = {(status.get("stableRevision") or {}).get("revision")}
        if status.get("canaryRevision") and not status.get("abort"):
            allowed.add(status["canaryRevision"].get("revision"))
        self.samples.append((time.monotonic(), frozenset(r for r in allowed if r)))

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            try:
                self._sample()
            except Exception as e:
                log.debug("rollout %s not read: %s", self.name, e)

    def allowed(self, start: float, end: float) -> frozenset[str]:
        """Revisions allowed at any moment of [start, end] (the sample before start too)."""
        out: set[str] = set()
        before = [s for s in self.samples if s[0] <= start]
        if before:
            out |= before[-1][1]
        for at, revisions in self.samples:
            if start <= at <= end + 0.5:
                out |= revisions
        return frozenset(out)
