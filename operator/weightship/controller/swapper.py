"""The swapper: follows the core's in-place swaps (core.inplace) on running pods' inference
servers, and reports how each ended. It writes nothing to Kubernetes.

The swapper is an observation source, as the verifier is: the core starts a swap
(``Decision.swaps``) and apply records it on the pod in the same write that closes the
pod's weights-verified gate (reason Swapping), so kubelet marks it unready and Services
and HTTPRoute backends drop it. Then the swapper (1) waits for the pod to be unready, and
then ENDPOINTS_GRACE_S for routers to drop it; (2) asks the pod's inference server to swap
(POST SWAP_PATH, ``api.inference``: the contract's SwapRequest, with a token made from the
rollout's seeding key for this pod and digest: seedtoken.join_token); (3) follows GET
SWAP_PATH until the server says Swapped or Failed, or the swap times out; (4) keeps its
report (``pending``) until the rollout's next reconcile, which it wakes (``on_done``): the
snapshot hands it to the core, which records it on the pod (core.inplace.swap_records),
and apply writes it. On success the pod moves to its new revision with its gate Pending,
so the verifier checks the loaded digest and the golden prompts as for a new pod (when
the rollout verifies anything, the server serves the new weights to the verifier alone
until then: holdUntilVerified, and the verifier's POST VERIFIED_PATH). On failure the pod
stays out of traffic with the reason on it; the core decides what follows (abort, swap
back, restart).

A swap the core keeps **in traffic** (the record's inTraffic: the last serving pod, or
maxUnavailable 0) skips step (1): the pod's gate stays open, and its server holds the
requests it gets (each at most inPlace.maxHoldSeconds) through the swap and the checks,
until the verifier tells it the new weights passed, or a swap back brings the old ones.

Everything a swap needs to go on is on the pod: a restarted operator finds the record
(state Swapping) and follows the server's swap again (``resume``); a report lost with it
is made again. A report is dropped once the pod's record shows it.

As many swaps run at once as the core starts (it bounds them by inPlace.maxUnavailable, on
a view that holds apply's writes); the in-flight set only de-duplicates, per pod. Each swap
is a coroutine on the swapper's own event loop, so its waits (for unready, the routers'
grace, the server's swap) hold no thread: a thread of a small pool is held only for one
blocking call (an HTTP request to the server, a read of the seeding key). With a thread
per swap held through its waits, 16 threads ran 1,000 stand-in swaps at ~4 a second. The
pod's readiness comes from the pods each reconcile reads (watch-fed, ``resume``): one GET
only when a pod seems gone, or when no reconcile showed it unready in UNREADY_WAIT_S.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

import urllib3

from weightship.api.inference import (
    AUTHORIZATION_HEADER,
    SWAP_PATH,
    FailureReason,
    SwapAnswer,
    SwapRequest,
    SwapState,
    bearer,
)
from weightship.api.models import ModelRollout
from weightship.controller import metrics
from weightship.controller.kube import Kube
from weightship.controller.pods import is_true
from weightship.controller.seedkey import swap_token
from weightship.controller.snapshot import pod_swap
from weightship.core.decision import SwapPod
from weightship.core.observed import PodSwap, SwapPhase
from weightship.core.pod_gates import verifies

log = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_WORKERS = 16  # blocking calls at once (HTTP to servers, reads), over all swaps
POLL_S = 0.25  # for a reconcile to show the pod unready (in memory: no request)
# The server's swap state, asked for at 0.1, 0.3, 0.7 s, then every 0.5 s: a swap of 0.1 s
# (a small model) is seen soon, and 250 swaps of tens of seconds ask 500 times a second.
FIRST_STATE_POLL_S = 0.1
MAX_STATE_POLL_S = 0.5
UNREADY_WAIT_S = 10.0  # for kubelet to mark the pod unready once its gate is False
# Then for the pod to leave the EndpointSlices and the routers that read them, as pods
# sleep in preStop before they stop: a request a stale router still sends waits at the
# server's gate through the swap and its verification (holdUntilVerified).
ENDPOINTS_GRACE_S = 2.0
REQUEST_TIMEOUT_S = 10.0
NOT_STAGED_WAIT_S = 30.0
MAX_ANSWER_BYTES = 64 * 1024
REPORT_TTL = timedelta(minutes=10)  # a report reaches its pod in a reconcile or two


@dataclass(frozen=True)
class SwapJob:
    namespace: str
    rollout: str
    rollout_uid: str
    pod: str
    uid: str
    base_url: str
    record: PodSwap
    """The swap as the pod records it while it runs (state Swapping)."""
    drain_timeout_s: int
    swap_timeout_s: int
    resume: bool = False
    # The verifier checks the swapped weights: the server serves them to nobody else
    # until it says they passed (holdUntilVerified).
    hold_until_verified: bool = False
    max_hold_s: int | None = None  # the longest one request waits at the server's gate

    def request(self) -> SwapRequest:
        return SwapRequest(
            manifest_digest=self.record.manifest_digest,
            revision=self.record.revision,
            drain_timeout_s=self.drain_timeout_s,
            swap_timeout_s=self.swap_timeout_s,
            hold_until_verified=self.hold_until_verified,
            max_hold_s=self.max_hold_s,
        )


class SwapFailure(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason, self.message = reason, message


@dataclass(frozen=True)
class _Report:
    swap: PodSwap
    at: datetime


def _ended(record: PodSwap, state: SwapPhase, **changes: Any) -> PodSwap:
    return replace(record, state=state, finished_at=datetime.now(UTC), **changes)


UNREADY, GONE = "unready", "gone"


class Swapper:
    def __init__(
        self,
        kube: Kube,
        *,
        workers: int = DEFAULT_WORKERS,
        on_done: Callable[[str, str], None] = lambda namespace, name: None,
        endpoints_grace_s: float = ENDPOINTS_GRACE_S,
    ) -> None:
        self.kube = kube  # reads only: the pod's readiness, the rollout's seeding key
        self.endpoints_grace_s = endpoints_grace_s
        self.on_done = on_done  # requeue the rollout when a swap ends
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="swap")
        self.http = urllib3.PoolManager(maxsize=workers, retries=False)
        self.loop = asyncio.new_event_loop()
        self.loop.set_default_executor(self.pool)
        threading.Thread(target=self.loop.run_forever, name="swap-loop", daemon=True).start()
        self.lock = threading.Lock()
        self.in_flight: dict[tuple[str, str], str] = {}
        """The pods (namespace, name) swapping now, and their rollouts."""
        self.seen: dict[tuple[str, str], str] = {}
        """What a reconcile showed of a pod swapping now: UNREADY, or GONE from its list."""
        self.reports: dict[str, _Report] = {}
        """How swaps ended, not yet on their pods' records, by pod uid (one per pod)."""

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.pool.shutdown(wait=False, cancel_futures=True)

    def pending(self, pods: list[dict[str, Any]]) -> dict[str, PodSwap]:
        """The reports waiting for these pods' records, by pod uid."""
        with self.lock:
            return {
                uid: self.reports[uid].swap for pod in pods if (uid := _uid(pod)) in self.reports
            }

    def submit(
        self, rollout: ModelRollout, swaps: Iterable[SwapPod], pods: list[dict[str, Any]]
    ) -> None:
        """Follow the swaps the core just started (apply recorded them on their pods)."""
        by_name = {p["metadata"]["name"]: p for p in pods}
        for swap in swaps:
            pod = by_name.get(swap.pod)
            if pod is not None:
                self._start(self._job(rollout, pod, swap.record(), resume=False))
        self._observe(rollout, pods)

    def resume(self, rollout: ModelRollout, pods: list[dict[str, Any]]) -> bool:
        """Drop the reports the pods' records show; follow swaps a pod records as running
        that no worker here follows, and no report ended (the operator restarted
        mid-swap). True while any swap of this rollout runs."""
        running = False
        now = datetime.now(UTC)
        with self.lock:
            for uid in [u for u, r in self.reports.items() if now - r.at > REPORT_TTL]:
                del self.reports[uid]  # its pod went before its record was written
        for pod in pods:
            record = pod_swap((pod.get("metadata") or {}).get("annotations") or {})
            uid = _uid(pod)
            with self.lock:
                report = self.reports.get(uid)
                if report is not None and (
                    record is None
                    or not record.same_swap(report.swap)
                    or record.state == report.swap.state
                ):
                    del self.reports[uid]  # shown, or its swap is no longer recorded
            if record is not None and record.state == "Swapping":
                running = True
                self._start(self._job(rollout, pod, record, resume=True))
        self._observe(rollout, pods)
        return running

    def _observe(self, rollout: ModelRollout, pods: list[dict[str, Any]]) -> None:
        """Note what the reconcile's pods show of this rollout's pods swapping now."""
        namespace, name = rollout.metadata.namespace, rollout.metadata.name
        by_name = {p["metadata"]["name"]: p for p in pods}
        with self.lock:
            for key, owner in self.in_flight.items():
                if key[0] == namespace and owner == name:
                    pod = by_name.get(key[1])
                    if pod is None:
                        self.seen[key] = GONE
                    elif not is_true(pod, "Ready"):
                        self.seen[key] = UNREADY

    def _job(
        self, rollout: ModelRollout, pod: dict[str, Any], record: PodSwap, *, resume: bool
    ) -> SwapJob:
        meta = pod["metadata"]
        validation = rollout.spec.validation
        in_place = rollout.spec.strategy.canary.in_place
        ip = (pod.get("status") or {}).get("podIP") or ""
        return SwapJob(
            namespace=meta["namespace"],
            rollout=rollout.metadata.name,
            rollout_uid=rollout.metadata.uid or "",
            pod=meta["name"],
            uid=_uid(pod),
            base_url=f"http://{ip}:{validation.endpoint.port}",
            record=record,
            drain_timeout_s=in_place.drain_timeout_seconds,
            swap_timeout_s=in_place.swap_timeout_seconds,
            resume=resume,
            hold_until_verified=verifies(validation),
            max_hold_s=in_place.max_hold_seconds,
        )

    def _start(self, job: SwapJob) -> None:
        """One swap per pod at a time. A swap that ended is not followed again while its
        report waits for the pod's record."""
        key = (job.namespace, job.pod)
        with self.lock:
            if key in self.in_flight:
                return
            report = self.reports.get(job.uid)
            if report is not None and job.resume and report.swap.same_swap(job.record):
                return
            if not job.resume:
                self.reports.pop(job.uid, None)  # of an earlier swap: this one supersedes it
            self.in_flight[key] = job.rollout
            self.seen.pop(key, None)
        asyncio.run_coroutine_threadsafe(self._run(job), self.loop)

    async def _blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """A blocking call, on the pool: the only time a swap holds a thread."""
        return await self.loop.run_in_executor(None, functools.partial(fn, *args))

    async def _run(self, job: SwapJob) -> None:
        started = time.monotonic()
        report: PodSwap | None = None
        try:
            if not job.resume and not job.record.in_traffic:
                await self._await_unready(job)
            state = await self._swap(job)
            report = _ended(
                job.record, "Swapped", seconds=state.seconds, paused_seconds=state.paused_seconds
            )
            metrics.SWAPS.labels(job.namespace, "Swapped", "").inc()
            metrics.SWAP_SECONDS.observe(time.monotonic() - started)
            log.info(
                "pod %s/%s swapped to %s in %.2f s",
                job.namespace,
                job.pod,
                job.record.revision,
                time.monotonic() - started,
            )
        except SwapFailure as failure:
            metrics.SWAPS.labels(job.namespace, "Failed", failure.reason).inc()
            log.warning(
                "pod %s/%s: swap to %s failed: %s",
                job.namespace,
                job.pod,
                job.record.revision,
                failure,
            )
            report = _ended(job.record, "Failed", reason=failure.reason, message=failure.message)
        except Exception:
            log.exception(
                "swapping pod %s/%s failed; the next reconcile retries", job.namespace, job.pod
            )
        finally:
            with self.lock:
                if report is not None:
                    self.reports[job.uid] = _Report(report, datetime.now(UTC))
                self.in_flight.pop((job.namespace, job.pod), None)
                self.seen.pop((job.namespace, job.pod), None)
            self.on_done(job.namespace, job.rollout)

    async def _await_unready(self, job: SwapJob) -> None:
        """The gate closed with the swap's record: kubelet marks the pod unready (a
        reconcile's pods show it), then the routers drop it."""
        key = (job.namespace, job.pod)
        deadline = time.monotonic() + UNREADY_WAIT_S
        while time.monotonic() < deadline:
            with self.lock:
                seen = self.seen.pop(key, None)
            if seen == UNREADY:
                await asyncio.sleep(self.endpoints_grace_s)
                return
            if seen == GONE and await self._blocking(self.kube.pod, *key) is None:
                raise SwapFailure(FailureReason.POD_GONE, "the pod was deleted")
            await asyncio.sleep(POLL_S)
        pod = await self._blocking(self.kube.pod, *key)
        if pod is None:
            raise SwapFailure(FailureReason.POD_GONE, "the pod was deleted")
        if is_true(pod, "Ready"):
            log.warning(
                "pod %s/%s still Ready %.0f s after its gate closed",
                job.namespace,
                job.pod,
                UNREADY_WAIT_S,
            )
        else:
            await asyncio.sleep(self.endpoints_grace_s)

    def _token(self, job: SwapJob) -> str:
        try:
            return swap_token(
                self.kube,
                job.namespace,
                job.rollout,
                job.rollout_uid,
                job.record.manifest_digest,
                job.pod,
            )
        except Exception as e:
            raise SwapFailure(
                FailureReason.NO_SWAP_KEY,
                f"cannot read the rollout's seeding key: {type(e).__name__}",
            ) from None

    async def _swap(self, job: SwapJob) -> SwapState:
        """The swap, asked for again while the server finds the target not staged yet
        (the node agent links a model into the rollout's view right after staging it)."""
        deadline = time.monotonic() + NOT_STAGED_WAIT_S
        while True:
            try:
                return await self._swap_once(job)
            except SwapFailure as failure:
                if failure.reason != FailureReason.NOT_STAGED or time.monotonic() >= deadline:
                    raise
            await asyncio.sleep(1.0)

    async def _swap_once(self, job: SwapJob) -> SwapState:
        digest = job.record.manifest_digest
        token = await self._blocking(self._token, job)
        status, doc = await self._blocking(
            self._request,
            "POST",
            job,
            job.request().to_json(),
            {AUTHORIZATION_HEADER: bearer(token)},
        )
        answer = SwapAnswer.from_json(doc)
        if status == 200 and answer.accepted:
            # Already loaded and verified (the pod holds them: a swap back after a refused
            # swap, or a request resent after an operator restart): nothing paused.
            return SwapState("Swapped", manifest_digest=digest)
        if status in (401, 403):
            raise SwapFailure(FailureReason.UNAUTHORIZED, answer.message or f"HTTP {status}")
        if status in (404, 501):
            message = answer.message or "the server has no in-place swap"
            raise SwapFailure(
                FailureReason.NOT_SUPPORTED, f"POST {SWAP_PATH}: HTTP {status}: {message}"
            )
        if status in (400, 413):
            raise SwapFailure(FailureReason.REFUSED, answer.message or f"HTTP {status}")
        if status not in (202, 409):
            raise SwapFailure(FailureReason.ENGINE_ERROR, f"POST {SWAP_PATH}: HTTP {status}")
        deadline = time.monotonic() + job.drain_timeout_s + job.swap_timeout_s
        poll_s = FIRST_STATE_POLL_S
        while True:
            # The POST's answer names the swap; a GET answers its state document.
            state = answer.swap if answer.swap is not None else SwapState.from_json(doc)
            if state.manifest_digest == digest:
                if state.state == "Swapped":
                    return state
                if state.state == "Failed":
                    raise SwapFailure(state.reason or state.state, state.message or "")
            if time.monotonic() >= deadline:
                limit = job.drain_timeout_s + job.swap_timeout_s
                raise SwapFailure(FailureReason.SWAP_TIMEOUT, f"not swapped within {limit} s")
            await asyncio.sleep(poll_s)
            poll_s = min(2 * poll_s, MAX_STATE_POLL_S)
            try:
                status, doc = await self._blocking(self._request, "GET", job, None, {})
            except SwapFailure:
                continue  # the server restarts or is busy: keep following until the deadline
            answer = SwapAnswer.from_json(doc)

    def _request(
        self, method: str, job: SwapJob, body: dict[str, Any] | None, headers: dict[str, str]
    ) -> tuple[int, dict[str, Any]]:
        try:
            response = self.http.request(
                method,
                job.base_url + SWAP_PATH,
                body=json.dumps(body).encode() if body is not None else None,
                headers={"Content-Type": "application/json", **headers},
                timeout=urllib3.Timeout(connect=5.0, read=REQUEST_TIMEOUT_S),
                preload_content=False,
            )
            data = response.read(MAX_ANSWER_BYTES + 1)
            response.release_conn()
        except urllib3.exceptions.HTTPError as e:
            raise SwapFailure(
                FailureReason.ENGINE_UNREACHABLE, f"{method} {SWAP_PATH}: {type(e).__name__}"
            ) from None
        try:
            doc = json.loads(data) if data and len(data) <= MAX_ANSWER_BYTES else {}
        except ValueError:
            doc = {}
        return response.status, doc if isinstance(doc, dict) else {}


def _uid(pod: dict[str, Any]) -> str:
    meta = pod.get("metadata") or {}
    return str(meta.get("uid") or meta.get("name") or "")
