"""The readiness-gate verifier: judges the weights of inference pods.

For each pod whose gate `weightship.io/weights-verified` has no verdict yet it asks the
inference server what it loaded (GET /weightship/v1/loaded), compares the digest with
the manifest digest the operator stamped on the pod, then sends the golden prompts.
Checks run on a bounded thread pool, so a slow replica never blocks the reconcile loop.

The verifier is an observation source, like the analysis queries: a verdict waits here
(`pending`) until the rollout's next reconcile, which it wakes (`on_verdict`); the
snapshot hands it to the core, which sets the gate (core.pod_gates), and apply writes it
with its annotations in one status write. A verdict is dropped once the gate shows it;
one lost with a restarted operator is simply made again (the pod still has no verdict).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any

import urllib3
from tenacity import retry, retry_if_exception_type, stop_after_attempt, wait_exponential_jitter

from weightship.api.env import MODEL_DIR_ENV
from weightship.api.inference import (
    AUTHORIZATION_HEADER,
    LOADED_PATH,
    VERIFIED_PATH,
    VERIFY_HEADER,
    FailureReason,
    LoadReport,
    SwapAnswer,
    bearer,
    report_from_termination,
    verified_request,
)
from weightship.api.models import ModelRollout
from weightship.api.names import (
    DIGEST_ANNOTATION,
    FAILED_PROMPT_ANNOTATION,
    LOADED_ANNOTATION,
    RESTARTS_ANNOTATION,
    SWAP_ANNOTATION,
    VERIFIED_GATE,
    staged_node_label,
)
from weightship.api.spec import ChecksumMode, GoldenPrompt
from weightship.controller import metrics
from weightship.controller.builders import (
    DEFAULT_CACHE_DIR,
    NODE_VOLUMES,
    mounts_view,
    pod_model_dir,
)
from weightship.controller.kube import Kube
from weightship.controller.pods import condition
from weightship.controller.seedkey import swap_token
from weightship.core.observed import PodVerdict
from weightship.core.pod_gates import verifies
from weightship.core.verification import (
    DRAINING,
    IN_PROGRESS_REASONS,
    PENDING,
    GateVerdict,
    PromptOutcome,
    StagedEvidence,
    VerifyMode,
    gate_changed,
    judge_prompt,
    load_verdict,
    prompts_verdict,
    staged_verdict,
)

log = logging.getLogger(__name__)

DEFAULT_WORKERS = 8
VERDICT_TTL = timedelta(minutes=10)  # a verdict reaches its gate in a reconcile or two
PROMPT_ATTEMPTS = 4


class ServerError(Exception):
    """The server did not answer usefully (connection, timeout, 5xx): not a verdict."""


class NotFound(ServerError):
    """HTTP 404: the server has no such route (a server without the weightship plugin)."""


def restarts(pod: dict[str, Any]) -> str:
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    return str(sum(int(c.get("restartCount") or 0) for c in statuses))


def serving(pod: dict[str, Any]) -> bool:
    """Pure: a running pod with an IP, not being deleted (its server can be asked)."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    return (
        not meta.get("deletionTimestamp")
        and status.get("phase") == "Running"
        and bool(status.get("podIP"))
    )


def needs_check(pod: dict[str, Any]) -> bool:
    """Pure: a running pod with an IP whose gate has no final verdict for its containers
    as they run now (a container restarted since the verdict loads its weights again)."""
    if not serving(pod):
        return False
    meta = pod.get("metadata") or {}
    gate = condition(pod, VERIFIED_GATE)
    if gate is None:
        return True
    if gate.get("reason") == DRAINING:
        return False  # about to be deleted; the core hands it back (Pending) if not
    if gate.get("reason") in IN_PROGRESS_REASONS:  # open, too, for a pod swapping in traffic
        return True
    verified_at = (meta.get("annotations") or {}).get(RESTARTS_ANNOTATION)
    return verified_at is not None and verified_at != restarts(pod)


def verdict_annotations(
    report: LoadReport | None, verdict: GateVerdict, held_seconds: float | None = None
) -> dict[str, str | None]:
    """What the rollout status is built from: how the weights arrived and which mode
    verified them, and the failing prompt."""
    out: dict[str, str | None] = {}
    loaded = report is not None and report.state == "Loaded"
    if loaded or (verdict.mode is not None and verdict.final):
        note: dict[str, object] = {
            "source": report.source if report and loaded else None,
            "seededFrom": report.seeded_from if report and loaded else None,
            "seconds": report.load_seconds if report and loaded else None,
            "mode": verdict.mode,
        }
        if held_seconds is not None:  # a swap in traffic: its server held requests so long
            note["heldSeconds"] = round(held_seconds, 3)
        out[LOADED_ANNOTATION] = json.dumps(note, sort_keys=True)
    prompt = verdict.failed_prompt
    if prompt is not None:
        out[FAILED_PROMPT_ANNOTATION] = json.dumps(
            {"name": prompt.name, "expected": prompt.expected, "got": prompt.got[:1000]},
            sort_keys=True,
        )
    return out


def completion_request(prompt: GoldenPrompt, *, chat: bool, model: str | None) -> dict[str, Any]:
    """The request body of a golden prompt: greedy, on the completions or the chat API."""
    body: dict[str, Any] = {"max_tokens": prompt.max_tokens, "temperature": 0}
    if chat:
        body["messages"] = prompt.chat_messages()
    else:
        body["prompt"] = prompt.text()
    if model:
        body["model"] = model
    if prompt.stop:
        body["stop"] = list(prompt.stop)
    return body


def staged_evidence(pod: dict[str, Any], model_dir: str | None) -> StagedEvidence:
    """Pure: what the pod object says for checksum staged (the node's label is read later).
    The node cache it mounts is its model's three paths, or its rollout's view (which
    shows only the models the rollout pins, each once staged): either read-only."""
    spec = pod.get("spec") or {}
    containers = spec.get("containers") or []
    mounts = [
        m for c in containers for m in c.get("volumeMounts") or [] if m.get("name") in NODE_VOLUMES
    ]
    words = [
        str(w) for c in containers for w in [*(c.get("command") or []), *(c.get("args") or [])]
    ]
    serves = any(
        f"$({MODEL_DIR_ENV})" in w or (model_dir is not None and model_dir in w) for w in words
    )
    return StagedEvidence(
        node=spec.get("nodeName"),
        cache_read_only=bool(mounts) and all(m.get("readOnly") for m in mounts),
        node_staged=False,
        serves_model_dir=serves,
    )


def _swap_record(pod: dict[str, Any]) -> dict[str, Any]:
    raw = ((pod.get("metadata") or {}).get("annotations") or {}).get(SWAP_ANNOTATION)
    try:
        record = json.loads(raw or "{}")
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


def swapped_to(pod: dict[str, Any]) -> str:
    """The manifest digest the pod's last in-place swap put in, if it succeeded ('')."""
    record = _swap_record(pod)
    if record.get("state") != "Swapped":
        return ""
    return str(record.get("manifestDigest") or "")


def termination_messages(pod: dict[str, Any]) -> tuple[str, ...]:
    """The termination messages of the pod's containers, this run's and the last one's."""
    out = []
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        for state in (status.get("state") or {}, status.get("lastState") or {}):
            message = (state.get("terminated") or {}).get("message")
            if message:
                out.append(str(message))
    return tuple(out)


@dataclass
class _Check:
    namespace: str
    name: str
    uid: str
    rollout: str
    base_url: str
    want_digest: str
    mode: ChecksumMode
    prompts: list[GoldenPrompt]
    path: str
    timeout_s: float
    current: dict[str, Any] | None
    restarts: str
    restarted: bool
    chat: bool = False
    model: str | None = None
    evidence: StagedEvidence | None = None  # node_staged filled in by the check
    terminations: tuple[str, ...] = ()  # containers' termination messages
    # Swapped in place to want_digest: its server lets only the verifier reach those
    # weights (X-Weightship-Verify) until told they passed (POST VERIFIED_PATH).
    swapped: bool = False
    rollout_uid: str = ""
    swap_token: str | None = None  # signed once per check, for a swapped pod
    # Swapped in traffic: its server held client requests until told the weights passed,
    # and says for how long (held_seconds, once told).
    in_traffic: bool = False
    held_seconds: float | None = None


def _never(namespace: str, name: str) -> None:
    return None


def on_gate(pod: dict[str, Any], verdict: PodVerdict) -> bool:
    """Pure: the pod's gate (and restart count) show the verdict: it can be dropped."""
    gate = condition(pod, VERIFIED_GATE) or {}
    if gate.get("reason") == DRAINING:
        return True  # about to be deleted: nobody sets its gate any more
    shown = (gate.get("status"), gate.get("reason"), gate.get("message"))
    wanted = (verdict.status, verdict.reason, verdict.message[:1024])
    written = dict(verdict.annotations).get(RESTARTS_ANNOTATION)
    noted = ((pod.get("metadata") or {}).get("annotations") or {}).get(RESTARTS_ANNOTATION)
    # An open gate with the verdict's reason and message shows it: the core keeps a pod
    # swapping in traffic open whatever the verdict (core.pod_gates.held_in_traffic).
    shows = shown == wanted or (shown[0] == "True" and shown[1:] == wanted[1:])
    return shows and (written is None or written == noted)


class Verifier:
    def __init__(
        self,
        kube: Kube,
        *,
        workers: int = DEFAULT_WORKERS,
        cache_dir: str = DEFAULT_CACHE_DIR,
        on_verdict: Callable[[str, str], None] = _never,
    ) -> None:
        self.kube = kube
        self.cache_dir = cache_dir  # the node cache, as the operator was installed with it
        self.on_verdict = on_verdict
        """Called with the rollout's namespace and name when a verdict waits (requeue)."""
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="verify")
        self.http = urllib3.PoolManager(maxsize=workers, retries=False)
        self.lock = threading.Lock()
        self.in_flight: set[str] = set()
        self.verdicts: dict[str, PodVerdict] = {}
        """Verdicts not yet on their pods' gates, by pod uid (bounded: one per pod)."""
        self.released: dict[tuple[str, str], dict[str, str]] = {}
        """By rollout (namespace, name): its swapped pods' servers told to serve, by pod
        uid, with the digest (``_release_swapped``)."""

    def pending(self, pods: list[dict[str, Any]]) -> dict[str, PodVerdict]:
        """The verdicts waiting for these pods' gates, by pod uid."""
        with self.lock:
            return {uid: self.verdicts[uid] for pod in pods if (uid := _uid(pod)) in self.verdicts}

    def submit(self, rollout: ModelRollout, pods: list[dict[str, Any]]) -> bool:
        """Start checks for pods without a verdict; True while any pod still waits for one."""
        if not verifies(rollout.spec.validation):
            self._release_swapped(rollout, pods)
            return False  # nothing to verify: core.pod_gates opens the gate
        waiting = False
        for pod in pods:
            uid = _uid(pod)
            with self.lock:
                verdict = self.verdicts.get(uid)
                if verdict is not None and on_gate(pod, verdict):
                    del self.verdicts[uid]
                elif verdict is not None:
                    waiting = True
                    continue  # its verdict waits for the core to set the gate
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
        digest = (meta.get("annotations") or {}).get(DIGEST_ANNOTATION, "")
        return _Check(
            namespace=meta["namespace"],
            name=meta["name"],
            uid=_uid(pod),
            rollout=rollout.metadata.name,
            base_url=f"http://{pod['status']['podIP']}:{validation.endpoint.port}",
            want_digest=digest,
            mode=validation.mode,
            prompts=list(validation.golden_prompts),
            path=validation.endpoint.path,
            timeout_s=float(validation.timeout_seconds),
            current=condition(pod, VERIFIED_GATE),
            restarts=restarts(pod),
            restarted=(meta.get("annotations") or {}).get(RESTARTS_ANNOTATION, restarts(pod))
            != restarts(pod),
            chat=validation.endpoint.chat,
            model=validation.endpoint.model,
            evidence=staged_evidence(pod, self._model_dir(rollout, pod, digest)),
            terminations=termination_messages(pod),
            swapped=swapped_to(pod) == digest != "",
            rollout_uid=rollout.metadata.uid or "",
            in_traffic=_swap_record(pod).get("inTraffic") is True,
        )

    def _model_dir(self, rollout: ModelRollout, pod: dict[str, Any], digest: str) -> str | None:
        """The folder the pod's `$(WEIGHTSHIP_MODEL_DIR)` names: in its rollout's view
        when it mounts one, else in the node cache."""
        view = rollout.metadata.uid if mounts_view(pod) else None
        try:
            return pod_model_dir(self.cache_dir, digest, view_uid=view)
        except ValueError:
            return None

    def _run(self, check: _Check) -> None:
        try:
            with metrics.VERIFICATION_SECONDS.time():
                report, verdict = self._verify(check)
                if check.swap_token is not None and verdict.status == "True":
                    verdict = self._open_to_traffic(check, verdict)
            if check.restarted or gate_changed(check.current, verdict):
                held = check.held_seconds if verdict.status == "True" else None
                annotations = verdict_annotations(report, verdict, held)
                annotations[RESTARTS_ANNOTATION] = check.restarts
                self._record(check, verdict, annotations)
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

    def _open_to_traffic(self, check: _Check, verdict: GateVerdict) -> GateVerdict:
        """The swapped weights passed: tell the server, which serves them to the verifier
        only until then. Pending while it has not heard (the check runs again)."""
        error = self._tell_passed(check)
        if error is not None:
            message = f"the weights passed, but the server was not told: {error}"
            return GateVerdict("False", PENDING, message, mode=verdict.mode)
        if check.in_traffic and check.held_seconds is not None:
            metrics.SWAP_HELD_SECONDS.observe(check.held_seconds)
        return verdict

    def _sign(self, check: _Check) -> None:
        """The swapped pod's token, once per check (a Secret read)."""
        check.swap_token = swap_token(
            self.kube,
            check.namespace,
            check.rollout,
            check.rollout_uid,
            check.want_digest,
            check.name,
        )

    def _tell_passed(self, check: _Check) -> str | None:
        """POST VERIFIED_PATH to the swapped pod's server; why it did not hear, or None.
        For a pod swapped in traffic, keeps how long its server held requests."""
        try:
            answer = self._request(
                "POST",
                check.base_url + VERIFIED_PATH,
                verified_request(check.want_digest),
                check.timeout_s,
                {AUTHORIZATION_HEADER: bearer(check.swap_token or "")},
            )
        except NotFound:
            return None  # a server without the route serves what it loaded anyway
        except ServerError as e:  # a 409, the server gone
            return str(e)
        if check.in_traffic:
            check.held_seconds = SwapAnswer.from_json(answer).held_seconds
        return None

    def _release_swapped(self, rollout: ModelRollout, pods: list[dict[str, Any]]) -> None:
        """Nothing to verify: a pod swapped in place while the rollout still verified (its
        validation switched off since) holds its new weights from traffic for a check
        nobody runs now. Tell each such server they passed (the user asked for no check),
        once per pod and weights (a failure is tried again at the next reconcile; a
        server that was not holding answers that it serves them already)."""
        key = (rollout.metadata.namespace or "", rollout.metadata.name)
        with self.lock:
            told = self.released.get(key, {})
            # Only this rollout's current pods are remembered: the map stays bounded.
            told = {p: told[p] for pod in pods if (p := _uid(pod)) in told}
            self.released[key] = told
        for pod in pods:
            if not (serving(pod) and swapped_to(pod)):
                continue
            check = self._plan(rollout, pod)
            if not check.swapped or told.get(check.uid) == check.want_digest:
                continue
            with self.lock:
                if check.uid in self.in_flight:
                    continue
                self.in_flight.add(check.uid)
            self.pool.submit(self._release, key, check)

    def _release(self, key: tuple[str, str], check: _Check) -> None:
        try:
            self._sign(check)
            error = self._tell_passed(check)
            if error is None:
                with self.lock:
                    self.released.setdefault(key, {})[check.uid] = check.want_digest
                log.info(
                    "pod %s/%s: nothing to verify; its server now serves the weights it swapped in",
                    check.namespace,
                    check.name,
                )
            else:
                log.warning(
                    "pod %s/%s: nothing to verify, but its server was not told to serve the "
                    "weights it swapped in: %s; will retry",
                    check.namespace,
                    check.name,
                    error,
                )
        except Exception as e:  # its text could quote what the API read: not shown
            log.warning(
                "pod %s/%s: cannot release its swapped weights: %s; will retry",
                check.namespace,
                check.name,
                type(e).__name__,
            )
        finally:
            with self.lock:
                self.in_flight.discard(check.uid)

    def _verify(self, check: _Check) -> tuple[LoadReport | None, GateVerdict]:
        mode: VerifyMode
        report: LoadReport | None = None
        if check.swapped:
            try:
                self._sign(check)
            except Exception as e:  # its text could quote what the API read: not shown
                message = f"cannot sign the checks of swapped weights: {type(e).__name__}"
                return None, GateVerdict("False", PENDING, message)
        if check.mode in ("auto", "loaded"):
            try:
                loaded = self._request("GET", check.base_url + LOADED_PATH, None, check.timeout_s)
                report = LoadReport.from_json(loaded)
            except NotFound:
                if check.mode == "loaded":
                    return None, GateVerdict(
                        "False",
                        "NoLoadReport",
                        f"checksum loaded: the server has no {LOADED_PATH}; use checksum "
                        "staged (or auto) for a server without the weightship plugin",
                        mode="loaded",
                    )
            except (ServerError, ValueError) as e:
                refused = next(filter(None, map(report_from_termination, check.terminations)), None)
                if refused is not None:  # the server exited, saying why (vLLM does)
                    return refused, GateVerdict(
                        "False",
                        refused.reason or FailureReason.LOAD_FAILED,
                        refused.message or "the server refused its weights",
                        mode="loaded",
                    )
                return None, GateVerdict("False", PENDING, f"waiting for the server: {e}")
        if report is not None:
            mode = "loaded"
            verdict = load_verdict(report, check.want_digest, True)
            if verdict is not None:
                return report, replace(verdict, mode=mode)
        elif check.mode in ("auto", "staged"):
            mode = "staged"
            assert check.evidence is not None
            check.evidence = replace(check.evidence, node_staged=self._node_staged(check))
            verdict = staged_verdict(check.evidence, check.want_digest)
            if verdict is not None:
                return None, verdict
        else:
            mode = "none"
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
        return report, prompts_verdict(report, outcomes, mode, check.evidence, check.want_digest)

    def _node_staged(self, check: _Check) -> bool:
        node = check.evidence.node if check.evidence else None
        if not node or not check.want_digest:
            return False
        try:
            labels = self.kube.core.read_node(node).metadata.labels or {}
        except Exception as e:
            raise ServerError(f"reading node {node}: {type(e).__name__}") from None
        return bool(labels.get(staged_node_label(check.want_digest)) == "true")

    @retry(
        retry=retry_if_exception_type(ServerError),
        wait=wait_exponential_jitter(multiplier=0.2, max=2.0),
        stop=stop_after_attempt(PROMPT_ATTEMPTS),
        reraise=True,
    )
    def _complete(self, check: _Check, prompt: GoldenPrompt) -> str:
        body = completion_request(prompt, chat=check.chat, model=check.model)
        url = check.base_url + check.path
        signed = {VERIFY_HEADER: bearer(check.swap_token)} if check.swap_token else {}
        answer = self._request("POST", url, body, check.timeout_s, signed)
        try:
            choice = answer["choices"][0]
            return str(choice["message"]["content"] if check.chat else choice["text"])
        except (KeyError, IndexError, TypeError) as e:
            raise ServerError(f"unexpected completion shape: {e!r}") from None

    def _request(
        self,
        method: str,
        url: str,
        body: dict[str, Any] | None,
        timeout_s: float,
        headers: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        try:
            response = self.http.request(
                method,
                url,
                body=json.dumps(body).encode() if body is not None else None,
                headers={"Content-Type": "application/json", **(headers or {})},
                timeout=urllib3.Timeout(connect=min(timeout_s, 5.0), read=timeout_s),
            )
        except urllib3.exceptions.HTTPError as e:
            raise ServerError(f"{method} {url}: {type(e).__name__}") from None
        if response.status == 404:
            raise NotFound(f"{method} {url}: HTTP 404")
        if response.status >= 300:
            raise ServerError(f"{method} {url}: HTTP {response.status}")
        try:
            doc = json.loads(response.data)
        except ValueError as e:
            raise ServerError(f"{method} {url}: not JSON ({e})") from None
        if not isinstance(doc, dict):
            raise ServerError(f"{method} {url}: not a JSON object")
        return doc

    def _record(
        self, check: _Check, verdict: GateVerdict, annotations: dict[str, str | None]
    ) -> None:
        """Keep the verdict for the core and wake the rollout's reconcile."""
        now = datetime.now(UTC)
        with self.lock:
            for uid in [u for u, v in self.verdicts.items() if now - v.at > VERDICT_TTL]:
                del self.verdicts[uid]  # its pod went before its gate was set
            self.verdicts[check.uid] = PodVerdict(
                status="True" if verdict.status == "True" else "False",
                reason=verdict.reason,
                message=verdict.message[:1024],
                at=now,
                annotations=tuple(sorted(annotations.items())),
                restarted=check.restarted,
                held_seconds=check.held_seconds
                if check.in_traffic and verdict.status == "True"
                else None,
            )
        self.on_verdict(check.namespace, check.rollout)


def _uid(pod: dict[str, Any]) -> str:
    meta = pod.get("metadata") or {}
    return str(meta.get("uid") or meta.get("name") or "")
