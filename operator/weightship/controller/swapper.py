"""The swapper: carries out the core's in-place swaps (core.inplace) on running pods.

For one pod it (1) closes the pod's weights-verified gate (reason Swapping), so kubelet
marks it unready and Services and HTTPRoute backends drop it, and records the swap on the
pod (builders.SWAP_ANNOTATION); (2) waits for the pod to be unready, and then
ENDPOINTS_GRACE_S for routers to drop it; (3) asks the pod's
inference server to swap (POST /weightship/v1/swap on the weightship vLLM plugin, with a
token made from the rollout's seeding key for this pod and digest: seedtoken.join_token);
(4) follows GET /weightship/v1/swap until the server says Swapped or Failed, or the swap
times out; (5) on success moves the pod to its new revision (revision-hash label, digest
annotations) and leaves the gate Pending, so the verifier checks the loaded digest and the
golden prompts as for a new pod: only that opens the gate again (when the rollout
verifies anything, the server serves the new weights to the verifier alone until then:
holdUntilVerified, and the verifier's POST /weightship/v1/swap/verified). On failure the pod stays
out of traffic with the reason on it; the core decides what follows (abort, swap back,
restart).

Everything a swap needs to go on is on the pod: a restarted operator finds the record
(state Swapping) and follows the server's swap again (`resume`). Swaps run on a bounded
pool; the in-flight set only de-duplicates.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import urllib3

from weightship.api.models import ModelRollout
from weightship.api.names import (
    DIGEST_ANNOTATION,
    FAILED_PROMPT_ANNOTATION,
    LOADED_ANNOTATION,
    MODEL_REVISION_ANNOTATION,
    RESTARTS_ANNOTATION,
    REVISION_LABEL,
    SWAP_ANNOTATION,
    VERIFIED_GATE,
)
from weightship.controller import metrics
from weightship.controller.kube import Kube
from weightship.controller.pods import condition, is_true
from weightship.controller.seedkey import swap_token
from weightship.core.decision import SwapPod
from weightship.core.pod_gates import verifies
from weightship.core.verification import PENDING

log = logging.getLogger(__name__)

SWAP_PATH = "/weightship/v1/swap"
SWAPPING = "Swapping"
SWAP_FAILED = "SwapFailed"
DEFAULT_WORKERS = 4
POLL_S = 0.25
UNREADY_WAIT_S = 10.0  # for kubelet to mark the pod unready once its gate is False
# Then for the pod to leave the EndpointSlices and the routers that read them, as pods
# sleep in preStop before they stop: a request a stale router still sends waits at the
# server's gate through the swap and its verification (holdUntilVerified).
ENDPOINTS_GRACE_S = 2.0
REQUEST_TIMEOUT_S = 10.0
NOT_STAGED_WAIT_S = 30.0
MAX_ANSWER_BYTES = 64 * 1024


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class SwapJob:
    namespace: str
    rollout: str
    rollout_uid: str
    pod: str
    uid: str
    base_url: str
    swap: SwapPod
    from_revision_hash: str | None
    drain_timeout_s: int
    swap_timeout_s: int
    started_at: str
    resume: bool = False
    restarts: int = 0
    # The verifier checks the swapped weights: the server serves them to nobody else
    # until it says they passed (holdUntilVerified).
    hold_until_verified: bool = False


class SwapFailure(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason, self.message = reason, message


def swap_record(job: SwapJob, state: str, **extra: Any) -> str:
    doc: dict[str, Any] = {
        "state": state,
        "to": job.swap.to_revision_hash,
        "from": job.from_revision_hash,
        "manifestDigest": job.swap.manifest_digest,
        "revision": job.swap.revision,
        "purpose": job.swap.purpose,
        "startedAt": job.started_at,
        "restarts": job.restarts,
    }
    doc.update({k: v for k, v in extra.items() if v is not None})
    return json.dumps(doc, sort_keys=True)


def gate(status: str, reason: str, message: str) -> dict[str, Any]:
    return {
        "type": VERIFIED_GATE,
        "status": status,
        "reason": reason,
        "message": message[:1024],
        "lastTransitionTime": _now(),
    }


class Swapper:
    def __init__(
        self,
        kube: Kube,
        *,
        workers: int = DEFAULT_WORKERS,
        on_done: Callable[[str, str], None] = lambda namespace, name: None,
        endpoints_grace_s: float = ENDPOINTS_GRACE_S,
    ) -> None:
        self.kube = kube
        self.endpoints_grace_s = endpoints_grace_s
        self.on_done = on_done  # requeue the rollout when a swap ends
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="swap")
        self.http = urllib3.PoolManager(maxsize=workers, retries=False)
        self.lock = threading.Lock()
        self.in_flight: dict[tuple[str, str], str] = {}  # rollout -> the pod it swaps now

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    def submit(
        self, rollout: ModelRollout, swaps: Iterable[SwapPod], pods: list[dict[str, Any]]
    ) -> None:
        by_name = {p["metadata"]["name"]: p for p in pods}
        for swap in swaps:
            pod = by_name.get(swap.pod)
            if pod is not None:
                self._start(self._job(rollout, pod, swap, _now(), resume=False))

    def resume(self, rollout: ModelRollout, pods: list[dict[str, Any]]) -> bool:
        """Follow swaps a pod records as running that no worker here follows (the operator
        restarted mid-swap). True while any swap of this rollout runs."""
        running = False
        for pod in pods:
            record = _record(pod)
            if record.get("state") != SWAPPING:
                continue
            running = True
            swap = SwapPod(
                pod["metadata"]["name"],
                str(record.get("to") or ""),
                str(record.get("manifestDigest") or ""),
                str(record.get("revision") or ""),
                record.get("purpose") or "repair",
            )
            started = str(record.get("startedAt") or _now())
            self._start(self._job(rollout, pod, swap, started, resume=True))
        return running

    def _job(
        self,
        rollout: ModelRollout,
        pod: dict[str, Any],
        swap: SwapPod,
        started_at: str,
        *,
        resume: bool,
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
            uid=str(meta.get("uid") or meta["name"]),
            base_url=f"http://{ip}:{validation.endpoint.port}",
            swap=swap,
            from_revision_hash=(meta.get("labels") or {}).get(REVISION_LABEL),
            drain_timeout_s=in_place.drain_timeout_seconds,
            swap_timeout_s=in_place.swap_timeout_seconds,
            started_at=started_at,
            resume=resume,
            hold_until_verified=verifies(validation),
            restarts=sum(
                int(c.get("restartCount") or 0)
                for c in (pod.get("status") or {}).get("containerStatuses") or []
            ),
        )

    def _start(self, job: SwapJob) -> None:
        """One swap per rollout at a time (the core asks for one; a decision made before
        the running swap's first write must not start a second)."""
        key = (job.namespace, job.rollout)
        with self.lock:
            if key in self.in_flight:
                return
            self.in_flight[key] = job.pod
        self.pool.submit(self._run, job)

    def _run(self, job: SwapJob) -> None:
        started = time.monotonic()
        try:
            if not job.resume:
                self._leave_traffic(job)
            answer = self._swap(job)
            self._swapped(job, answer)
            metrics.SWAPS.labels(job.namespace, "Swapped", "").inc()
            metrics.SWAP_SECONDS.observe(time.monotonic() - started)
            log.info(
                "pod %s/%s swapped to %s in %.2f s",
                job.namespace,
                job.pod,
                job.swap.revision,
                time.monotonic() - started,
            )
        except SwapFailure as failure:
            metrics.SWAPS.labels(job.namespace, "Failed", failure.reason).inc()
            log.warning(
                "pod %s/%s: swap to %s failed: %s",
                job.namespace,
                job.pod,
                job.swap.revision,
                failure,
            )
            self._failed(job, failure)
        except Exception:
            log.exception(
                "swapping pod %s/%s failed; the next reconcile retries", job.namespace, job.pod
            )
        finally:
            with self.lock:
                self.in_flight.pop((job.namespace, job.rollout), None)
            self.on_done(job.namespace, job.rollout)

    def _leave_traffic(self, job: SwapJob) -> None:
        self.kube.patch_pod_condition(
            job.namespace,
            job.pod,
            gate("False", SWAPPING, f"out of traffic: swapping to {job.swap.revision} in place"),
            {SWAP_ANNOTATION: swap_record(job, SWAPPING)},
        )
        deadline = time.monotonic() + UNREADY_WAIT_S
        while time.monotonic() < deadline:
            pod = self.kube.pod(job.namespace, job.pod)
            if pod is None:
                raise SwapFailure("PodGone", "the pod was deleted")
            if not is_true(pod, "Ready"):
                time.sleep(self.endpoints_grace_s)
                return
            time.sleep(POLL_S)
        log.warning(
            "pod %s/%s still Ready %.0f s after its gate closed",
            job.namespace,
            job.pod,
            UNREADY_WAIT_S,
        )

    def _token(self, job: SwapJob) -> str:
        try:
            return swap_token(
                self.kube,
                job.namespace,
                job.rollout,
                job.rollout_uid,
                job.swap.manifest_digest,
                job.pod,
            )
        except Exception as e:
            raise SwapFailure(
                "NoSwapKey", f"cannot read the rollout's seeding key: {type(e).__name__}"
            ) from None

    def _swap(self, job: SwapJob) -> dict[str, Any]:
        """The swap, asked for again while the server finds the target not staged yet
        (the node agent links a model into the rollout's view right after staging it)."""
        deadline = time.monotonic() + NOT_STAGED_WAIT_S
        while True:
            try:
                return self._swap_once(job)
            except SwapFailure as failure:
                if failure.reason != "NotStaged" or time.monotonic() >= deadline:
                    raise
            time.sleep(1.0)

    def _swap_once(self, job: SwapJob) -> dict[str, Any]:
        body = {
            "manifestDigest": job.swap.manifest_digest,
            "revision": job.swap.revision,
            "drainTimeoutSeconds": job.drain_timeout_s,
            "swapTimeoutSeconds": job.swap_timeout_s,
            "holdUntilVerified": job.hold_until_verified,
        }
        status, answer = self._request(
            "POST", job, body, {"Authorization": f"Bearer {self._token(job)}"}
        )
        if status == 200 and answer.get("accepted"):
            # Already loaded and verified (the pod holds them: a swap back after a refused
            # swap, or a request resent after an operator restart): nothing paused.
            return {"state": "Swapped", "manifestDigest": job.swap.manifest_digest}
        if status in (401, 403):
            raise SwapFailure("Unauthorized", str(answer.get("message") or f"HTTP {status}"))
        if status in (404, 501):
            message = answer.get("message") or "the server has no in-place swap"
            raise SwapFailure("NotSupported", f"POST {SWAP_PATH}: HTTP {status}: {message}")
        if status in (400, 413):
            raise SwapFailure("Refused", str(answer.get("message") or f"HTTP {status}"))
        if status not in (202, 409):
            raise SwapFailure("EngineError", f"POST {SWAP_PATH}: HTTP {status}")
        deadline = time.monotonic() + job.drain_timeout_s + job.swap_timeout_s
        while True:
            nested = answer.get("swap")
            doc: dict[str, Any] = nested if isinstance(nested, dict) else answer
            if doc.get("manifestDigest") == job.swap.manifest_digest:
                if doc.get("state") == "Swapped":
                    return doc
                if doc.get("state") == "Failed":
                    raise SwapFailure(
                        str(doc.get("reason") or "Failed"), str(doc.get("message") or "")
                    )
            if time.monotonic() >= deadline:
                limit = job.drain_timeout_s + job.swap_timeout_s
                raise SwapFailure("SwapTimeout", f"not swapped within {limit} s")
            time.sleep(POLL_S)
            try:
                status, answer = self._request("GET", job, None, {})
            except SwapFailure:
                continue  # the server restarts or is busy: keep following until the deadline

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
                "EngineUnreachable", f"{method} {SWAP_PATH}: {type(e).__name__}"
            ) from None
        try:
            doc = json.loads(data) if data and len(data) <= MAX_ANSWER_BYTES else {}
        except ValueError:
            doc = {}
        return response.status, doc if isinstance(doc, dict) else {}

    def _swapped(self, job: SwapJob, doc: dict[str, Any]) -> None:
        """The pod holds the new weights: move it to their revision, gate Pending (the
        verifier's turn), and record how long the swap took."""
        record = swap_record(
            job,
            "Swapped",
            finishedAt=_now(),
            seconds=_number(doc.get("seconds")),
            pausedSeconds=_number(doc.get("pausedSeconds")),
        )
        self.kube.patch_pod_condition(
            job.namespace,
            job.pod,
            gate("False", PENDING, f"swapped to {job.swap.revision} in place; verifying"),
            {
                SWAP_ANNOTATION: record,
                DIGEST_ANNOTATION: job.swap.manifest_digest,
                MODEL_REVISION_ANNOTATION: job.swap.revision,
                LOADED_ANNOTATION: None,
                FAILED_PROMPT_ANNOTATION: None,
                RESTARTS_ANNOTATION: None,
            },
            labels={REVISION_LABEL: job.swap.to_revision_hash},
        )

    def _failed(self, job: SwapJob, failure: SwapFailure) -> None:
        self.kube.patch_pod_condition(
            job.namespace,
            job.pod,
            gate(
                "False",
                SWAP_FAILED,
                f"swap to {job.swap.revision} failed ({failure.reason}): {failure.message}",
            ),
            {
                SWAP_ANNOTATION: swap_record(
                    job,
                    "Failed",
                    finishedAt=_now(),
                    reason=failure.reason,
                    message=failure.message[:500],
                )
            },
        )


def _record(pod: dict[str, Any]) -> dict[str, Any]:
    try:
        doc = json.loads(
            ((pod.get("metadata") or {}).get("annotations") or {}).get(SWAP_ANNOTATION) or "{}"
        )
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) else None


def swapping(pod: dict[str, Any]) -> bool:
    gate_ = condition(pod, VERIFIED_GATE)
    return gate_ is not None and gate_.get("reason") == SWAPPING
