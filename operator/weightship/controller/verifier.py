"""The readiness-gate verifier: sets `weightship.io/weights-verified` on inference pods.

For each pod whose gate has no verdict yet it asks the inference server what it loaded
(GET /weightship/v1/loaded), compares the digest with the manifest digest the operator
stamped on the pod, then sends the golden prompts. Checks run on a bounded thread pool,
so a slow replica never blocks the reconcile loop. The verdict is written to the pod
(condition + annotations, one status write); the in-flight set only de-duplicates work,
so a restarted operator simply checks again every pod that has no verdict.
"""

from __future__ import annotations

import json
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import urllib3
from tenacity import retry, retry_if_exception_type, stop_after_attempt, wait_exponential_jitter

from weightship.api.models import ModelRollout
from weightship.api.spec import GoldenPrompt
from weightship.controller import metrics
from weightship.controller.builders import DIGEST_ANNOTATION, GROUP, VERIFIED_GATE
from weightship.controller.kube import Kube
from weightship.controller.pods import condition
from weightship.core.verification import (
    IN_PROGRESS_REASONS,
    PENDING,
    GateVerdict,
    LoadReport,
    PromptOutcome,
    gate_changed,
    judge_prompt,
    load_verdict,
    prompts_verdict,
)

log = logging.getLogger(__name__)

LOADED_PATH = "/weightship/v1/loaded"
LOADED_ANNOTATION = f"{GROUP}/loaded"
FAILED_PROMPT_ANNOTATION = f"{GROUP}/failed-prompt"
# Container restarts when the verdict was written: a restarted server loads again, so its
# old verdict no longer says anything about what it serves.
RESTARTS_ANNOTATION = f"{GROUP}/verified-restarts"
DEFAULT_WORKERS = 8
PROMPT_ATTEMPTS = 4


class ServerError(Exception):
    """The server did not answer usefully (connection, timeout, 5xx): not a verdict."""


def restarts(pod: dict[str, Any]) -> str:
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    return str(sum(int(c.get("restartCount") or 0) for c in statuses))


def needs_check(pod: dict[str, Any]) -> bool:
    """Pure: a running pod with an IP whose gate has no final verdict for its containers
    as they run now (a container restarted since the verdict loads its weights again)."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    if meta.get("deletionTimestamp") or status.get("phase") != "Running" or not status.get("podIP"):
        return False
    gate = condition(pod, VERIFIED_GATE)
    if gate is None:
        return True
    if gate.get("status") != "True" and gate.get("reason") in IN_PROGRESS_REASONS:
        return True
    verified_at = (meta.get("annotations") or {}).get(RESTARTS_ANNOTATION)
    return verified_at is not None and verified_at != restarts(pod)


def verdict_annotations(report: LoadReport | None, verdict: GateVerdict) -> dict[str, str | None]:
    """What the rollout status is built from: how the weights arrived, and the failing prompt."""
    out: dict[str, str | None] = {}
    if report is not None and report.state == "Loaded":
        out[LOADED_ANNOTATION] = json.dumps(
            {
                "source": report.source,
                "seededFrom": report.seeded_from,
                "seconds": report.load_seconds,
            },
            sort_keys=True,
        )
    prompt = verdict.failed_prompt
    if prompt is not None:
        out[FAILED_PROMPT_ANNOTATION] = json.dumps(
            {"name": prompt.name, "expected": prompt.expected, "got": prompt.got[:1000]},
            sort_keys=True,
        )
    return out


@dataclass
class _Check:
    namespace: str
    name: str
    uid: str
    base_url: str
    want_digest: str
    checksum: bool
    prompts: list[GoldenPrompt]
    path: str
    timeout_s: float
    current: dict[str, Any] | None
    restarts: str
    restarted: bool


class Verifier:
    def __init__(self, kube: Kube, *, workers: int = DEFAULT_WORKERS) -> None:
        self.kube = kube
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="verify")
        self.http = urllib3.PoolManager(maxsize=workers, retries=False)
        self.lock = threading.Lock()
        self.in_flight: set[str] = set()

    def submit(self, rollout: ModelRollout, pods: list[dict[str, Any]]) -> bool:
        """Start checks for pods without a verdict; True while any pod still waits for one."""
        validation = rollout.spec.validation
        if not (validation.checksum or validation.golden_prompts):
            return False  # nothing to verify: apply.open_trivial_gates opens the gate
        waiting = False
        for pod in pods:
            if not needs_check(pod):
                continue
            waiting = True
            check = self._plan(rollout, pod)
            with self.lock:
                if check.uid in self.in_flight:
                    continue
                self.in_flight.add(check.uid)
            self.pool.submit(self._run, check)
        return waiting

    def _plan(self, rollout: ModelRollout, pod: dict[str, Any]) -> _Check:
        validation = rollout.spec.validation
        meta = pod["metadata"]
        return _Check(
            namespace=meta["namespace"],
            name=meta["name"],
            uid=meta.get("uid") or meta["name"],
            base_url=f"http://{pod['status']['podIP']}:{validation.endpoint.port}",
            want_digest=(meta.get("annotations") or {}).get(DIGEST_ANNOTATION, ""),
            checksum=validation.checksum,
            prompts=list(validation.golden_prompts),
            path=validation.endpoint.path,
            timeout_s=float(validation.timeout_seconds),
            current=condition(pod, VERIFIED_GATE),
            restarts=restarts(pod),
            restarted=(meta.get("annotations") or {}).get(RESTARTS_ANNOTATION, restarts(pod))
            != restarts(pod),
        )

    def _run(self, check: _Check) -> None:
        try:
            with metrics.VERIFICATION_SECONDS.time():
                report, verdict = self._verify(check)
            if check.restarted or gate_changed(check.current, verdict):
                annotations = verdict_annotations(report, verdict)
                annotations[RESTARTS_ANNOTATION] = check.restarts
                self._write(check, verdict, annotations)
                metrics.VERIFICATIONS.labels(check.namespace, verdict.status, verdict.reason).inc()
                log.info(
                    "pod %s/%s: %s %s: %s",
                    check.namespace,
                    check.name,
                    verdict.status,
                    verdict.reason,
                    verdict.message,
                )
        except Exception:
            log.exception("verifying pod %s/%s failed; will retry", check.namespace, check.name)
        finally:
            with self.lock:
                self.in_flight.discard(check.uid)

    def _verify(self, check: _Check) -> tuple[LoadReport | None, GateVerdict]:
        try:
            loaded = self._request("GET", check.base_url + LOADED_PATH, None, check.timeout_s)
            report = LoadReport.from_json(loaded)
        except (ServerError, ValueError) as e:
            return None, GateVerdict("False", PENDING, f"waiting for the server: {e}")
        verdict = load_verdict(report, check.want_digest, check.checksum)
        if verdict is not None:
            return report, verdict
        outcomes: list[PromptOutcome] = []
        for prompt in check.prompts:
            try:
                outcome = judge_prompt(prompt, self._complete(check, prompt))
            except ServerError as e:
                message = f"golden prompt {prompt.name!r} not answered yet: {e}"
                return report, GateVerdict("False", PENDING, message)
            outcomes.append(outcome)
            if not outcome.passed:
                break
        return report, prompts_verdict(report, outcomes, check.checksum)

    @retry(
        retry=retry_if_exception_type(ServerError),
        wait=wait_exponential_jitter(multiplier=0.2, max=2.0),
        stop=stop_after_attempt(PROMPT_ATTEMPTS),
        reraise=True,
    )
    def _complete(self, check: _Check, prompt: GoldenPrompt) -> str:
        body = {"prompt": prompt.prompt, "max_tokens": prompt.max_tokens, "temperature": 0}
        answer = self._request("POST", check.base_url + check.path, body, check.timeout_s)
        try:
            return str(answer["choices"][0]["text"])
        except (KeyError, IndexError, TypeError) as e:
            raise ServerError(f"unexpected completion shape: {e!r}") from None

    def _request(
        self, method: str, url: str, body: dict[str, Any] | None, timeout_s: float
    ) -> dict[str, Any]:
        try:
            response = self.http.request(
                method,
                url,
                body=json.dumps(body).encode() if body is not None else None,
                headers={"Content-Type": "application/json"},
                timeout=urllib3.Timeout(connect=min(timeout_s, 5.0), read=timeout_s),
            )
        except urllib3.exceptions.HTTPError as e:
            raise ServerError(f"{method} {url}: {type(e).__name__}") from None
        if response.status >= 300:
            raise ServerError(f"{method} {url}: HTTP {response.status}")
        try:
            doc = json.loads(response.data)
        except ValueError as e:
            raise ServerError(f"{method} {url}: not JSON ({e})") from None
        if not isinstance(doc, dict):
            raise ServerError(f"{method} {url}: not a JSON object")
        return doc

    def _write(
        self, check: _Check, verdict: GateVerdict, annotations: dict[str, str | None]
    ) -> None:
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        self.kube.patch_pod_condition(
            check.namespace,
            check.name,
            {
                "type": VERIFIED_GATE,
                "status": verdict.status,
                "reason": verdict.reason,
                "message": verdict.message[:1024],
                "lastTransitionTime": now,
            },
            annotations,
        )
