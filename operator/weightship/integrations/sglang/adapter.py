"""The weightship interface for an SGLang server: what it loaded, and in-place swaps.

    GET  /weightship/v1/loaded   a LoadReport (api.inference) of what SGLang serves
    POST /weightship/v1/swap     swap to a staged revision (the contract's request, token
                                 and answers: api.inference, integrations.serving)
    GET  /weightship/v1/swap     the latest swap's state document
    POST /weightship/v1/swap/verified   the verifier passed the swapped weights

A swap, one at a time:

    verify     the target is staged, its manifest is its digest, config and tokenizer
               unchanged, and every chunk of every file matches (``verify``), before
               anything is paused
    drain      the gate closes (new requests wait); in-flight requests finish, up to the
               drain timeout. None is ever aborted by default: requests still running
               then refuse the swap (DrainTimeout), before anything changed, and are
               answered by the old weights. With ``abort_on_drain_timeout``
               (``--abort-on-drain-timeout``) they are cut instead and the swap goes on
    seal       requests still in flight are cut (none, unless abort_on_drain_timeout);
               SGLang's pause_generation(mode=retract, which aborts nothing and lets the
               cache be flushed; abort with the flag)
    update     update_weights_from_disk(model_path=<the verified folder>,
               weight_version=<revision>, flush_cache=True, abort_all_requests=False;
               True with the flag)
    readback   model_info: weight_version is the revision and model_path the folder;
               weights_checker: a checksum of what SGLang now holds, compared with what it
               said the last time this digest was loaded here (and it must have changed)
    resume     continue_generation; the gate opens with the new weights (with
               holdUntilVerified: to the verifier's requests only, until it says they passed)

A failure before ``update`` changes nothing: generation resumes on the old weights and
the gate reopens with them. From ``update`` on SGLang may hold a mix of two revisions
(it rolls back after a failed load by reading the path it was given again, unchecked), so
any failure there leaves generation paused, the gate refusing (503) and the report
Failed/MixedWeights until a later swap succeeds; the operator swaps the pod back or
restarts it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from weightship.api.inference import (
    FailureReason,
    LoadReport,
    LoadSource,
    SwapAnswer,
    SwapRequest,
    parse_verified,
)
from weightship.integrations.serving import (
    Answer,
    Parsed,
    StepTimes,
    SwapAuth,
    SwapTracker,
    Weights,
    accepted,
    already_loaded,
    busy,
    config_changes,
    verified_answer,
)

from .client import NOT_FLUSHED_TEXT, ModelInfo, SGLangClient, SGLangError, WeightsChecksum
from .gate import Gate
from .verify import (
    VerifiedModel,
    VerifyFailure,
    same_folder,
    staged_manifest,
    verify_staged,
)

log = logging.getLogger("weightship.sglang")
# Beyond the swap's own bounds: what requests may wait at the closed gate for.
HOLD_GRACE_S = 30.0
# Calls that are no load: pause, resume, model_info, flush.
CONTROL_TIMEOUT_S = 30.0
# A checksum pass over every weight (SGLang hashes them on the device).
CHECKSUM_TIMEOUT_S = 300.0
MODE = "sglang"

Verify = Callable[[Path | None, str], VerifiedModel]


@dataclass(frozen=True)
class Held:
    """What SGLang serves, as far as the adapter checked it."""

    model: VerifiedModel
    revision: str
    source: LoadSource
    info: ModelInfo
    checksum: WeightsChecksum | None
    checksum_note: str | None  # why there is no checksum
    load_seconds: float


class StepFailed(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message[:1000]


@dataclass
class Adapter:
    client: SGLangClient
    auth: SwapAuth
    cache_dir: Path | None
    start: Weights
    verify: Verify = field(default=verify_staged)
    # Requests still running at the drain timeout are cut (and SGLang aborts its own)
    # rather than refusing the swap: SGLang's own default, and never this adapter's.
    abort_on_drain_timeout: bool = False
    gate: Gate = field(init=False)
    tracker: SwapTracker = field(default_factory=SwapTracker)
    # The state /weightship/v1/loaded answers from (before the live readback).
    held: Held | None = None
    failure: LoadReport | None = None  # set when the start or a swap went wrong
    mixed: str | None = None
    # SGLang's checksum each digest had the last time it was loaded here.
    checksums: dict[str, str] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _thread: threading.Thread | None = None

    def __post_init__(self) -> None:
        self.gate = Gate(self.start)

    # -- the start -------------------------------------------------------------------------

    def verify_start(self) -> VerifiedModel | None:
        """Check the files SGLang starts from (WEIGHTSHIP_MANIFEST_DIGEST's staged folder)
        before it reads them; None (and a Failed report) when they do not match."""
        digest = self.start.manifest_digest
        if not digest:
            self.failure = LoadReport(
                "Failed",
                reason=FailureReason.NOT_STAGED,
                message="WEIGHTSHIP_MANIFEST_DIGEST is not set",
            )
            return None
        try:
            return self.verify(self.cache_dir, digest)
        except VerifyFailure as exc:
            self.failure = LoadReport(
                "Failed", manifest_digest=digest, reason=exc.reason, message=exc.message
            )
            log.error("the start weights %s failed verification: %s", digest, exc.message)
            return None

    def await_server(self, model: VerifiedModel, timeout: float, poll_s: float = 1.0) -> bool:
        """Once SGLang answers, check it serves ``model`` at the start revision; then the
        report is Loaded. False when it did not answer within ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                info = self.client.model_info(min(CONTROL_TIMEOUT_S, max(timeout, 1.0)))
                break
            except SGLangError as exc:
                if time.monotonic() >= deadline:
                    self.failure = LoadReport(
                        "Failed",
                        manifest_digest=model.digest,
                        reason=FailureReason.ENGINE_ERROR,
                        message=f"SGLang did not come up within {timeout:.0f} s: {exc}",
                    )
                    return False
            time.sleep(poll_s)
        problem = readback_problem(info, model, self.start.revision)
        if problem is not None:
            self.failure = LoadReport(
                "Failed",
                manifest_digest=model.digest,
                reason=FailureReason.READBACK_MISMATCH,
                message=problem,
            )
            return False
        checksum, note = self._checksum()
        if checksum is not None:
            self.checksums[model.digest] = checksum.engine
        self.held = Held(model, self.start.revision, "cache", info, checksum, note, model.seconds)
        self.failure = None
        log.info("SGLang serves %s (%s), verified", model.digest, self.start.revision)
        return True

    def _checksum(
        self, timeout: float = CHECKSUM_TIMEOUT_S
    ) -> tuple[WeightsChecksum | None, str | None]:
        try:
            checksum = self.client.weights_checksum(timeout)
        except SGLangError as exc:
            return None, f"weights_checker failed: {exc}"
        if checksum is None:
            return None, "this SGLang has no weights_checker"
        return checksum, None

    # -- GET /weightship/v1/loaded ---------------------------------------------------------

    def loaded_document(self) -> dict[str, Any]:
        """The report, with SGLang asked again what it serves now."""
        if self.failure is not None:
            return self.failure.to_json() | {"mode": MODE}
        held = self.held
        if held is None:
            return LoadReport(
                "Loading", message="verifying the weights and starting SGLang"
            ).to_json()
        if self.running:
            current = self.tracker.current
            return LoadReport(
                "Loading", message=f"swapping to {current.manifest_digest} ({current.revision})"
            ).to_json() | {"mode": MODE}
        try:
            info = self.client.model_info(5.0)
        except SGLangError as exc:
            return LoadReport("Loading", message=f"SGLang does not answer: {exc}").to_json()
        problem = readback_problem(info, held.model, held.revision)
        if problem is not None:
            return LoadReport(
                "Failed",
                manifest_digest=held.model.digest,
                reason=FailureReason.READBACK_MISMATCH,
                message=problem,
            ).to_json() | {"mode": MODE}
        return loaded_report(held, info).to_json() | details(held, info)

    # -- POST/GET /weightship/v1/swap ------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def post_verified(self, authorization: str | None, body: bytes | None) -> Answer:
        """POST /weightship/v1/swap/verified (api.inference)."""
        digest = self._authorized(authorization, body, parse_verified)
        if isinstance(digest, tuple):
            return digest
        opened = self.gate.verified(digest)
        if opened:
            log.info("swapped weights %s verified: serving every request", digest)
        return verified_answer(opened, self.gate.mode, self.gate.weights.manifest_digest)

    def _authorized(
        self, authorization: str | None, body: bytes | None, parse: Callable[[bytes], Parsed]
    ) -> Parsed | Answer:
        return self.auth.authorize(authorization, body, parse, time.time())

    def is_verifier(self, header: str | None) -> bool:
        return self.auth.opens_verification(header, self.gate.weights.manifest_digest, time.time())

    def post_swap(self, authorization: str | None, body: bytes | None) -> Answer:
        swap = self._authorized(authorization, body, SwapRequest.parse)
        if isinstance(swap, tuple):
            return swap
        with self._lock:
            if self.running:
                return busy(self.tracker.current)
            held = self.held
            if held is None:
                message = "SGLang is not serving verified weights yet"
                return 503, SwapAnswer(False, FailureReason.NOT_READY, message)
            if (
                self.mixed is None
                and self.failure is None
                and held.model.digest == swap.manifest_digest
            ):
                return already_loaded(swap.manifest_digest, self.tracker.current)
            state = self.tracker.begin(swap, held.model.digest)
            self._thread = threading.Thread(
                target=self._run, args=(swap, held), name="sglang-swap", daemon=True
            )
            self._thread.start()
        log.info("swap to %s (%s) accepted", swap.manifest_digest, swap.revision)
        return accepted(state)

    def swap_document(self) -> dict[str, Any]:
        return self.tracker.current.to_json()

    def wait(self, timeout: float | None = None) -> None:
        """Until the running swap, if any, is done (for tests and shutdown)."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)

    # -- the swap --------------------------------------------------------------------------

    def _run(self, request: SwapRequest, old: Held) -> None:
        steps = StepTimes()
        try:
            model = self._precheck(request.manifest_digest, old)
        except Exception as exc:  # nothing was paused: the old weights serve on
            failure = (
                exc
                if isinstance(exc, VerifyFailure)
                else VerifyFailure(FailureReason.LOAD_ERROR, _text(exc))
            )
            self.tracker.failed(failure.reason, failure.message, paused_seconds=0.0)
            log.warning("swap to %s refused: %s", request.manifest_digest, failure.message)
            return
        steps.done("verify")
        hold = request.drain_timeout_s + request.swap_timeout_s + HOLD_GRACE_S
        self.gate.close(hold)
        closed = time.monotonic()
        if not self.gate.wait_idle(request.drain_timeout_s) and not self.abort_on_drain_timeout:
            self._undrained(request, old, closed)
            return
        changing = False
        abort = self.abort_on_drain_timeout
        try:
            steps.done("drain")
            self.tracker.loading(time.monotonic() - closed)
            deadline = time.monotonic() + request.swap_timeout_s
            cut = self.gate.seal()
            if cut:
                log.info("drain timeout: %d requests cut", cut)
            self.client.pause("abort" if abort else "retract", _left(deadline, CONTROL_TIMEOUT_S))
            steps.done("pause")
            changing = True
            update_started = time.monotonic()
            result = self.client.update_weights_from_disk(
                str(model.files), request.revision, _left(deadline), abort_all_requests=abort
            )
            if not result.success:
                if NOT_FLUSHED_TEXT not in result.message:
                    raise StepFailed(
                        FailureReason.ENGINE_ERROR, f"update_weights_from_disk: {result.message}"
                    )
                if not self.client.flush_cache(_left(deadline, CONTROL_TIMEOUT_S)):
                    raise StepFailed(
                        FailureReason.ENGINE_ERROR,
                        f"the radix cache could not be flushed: {result.message}",
                    )
            update_seconds = time.monotonic() - update_started
            steps.done("update")
            info = self.client.model_info(_left(deadline, CONTROL_TIMEOUT_S))
            problem = readback_problem(info, model, request.revision)
            if problem is not None:
                raise StepFailed(FailureReason.READBACK_MISMATCH, problem)
            checksum, note = self._checksum(_left(deadline, CHECKSUM_TIMEOUT_S))
            if checksum is not None:
                self._check_checksum(checksum, model, old)
            steps.done("readback")
            self.client.resume(_left(deadline, CONTROL_TIMEOUT_S))
            steps.done("resume")
        except Exception as exc:  # a refused step, a timeout, or anything else
            self._failed(exc, request, old, closed, changing)
            return
        if checksum is not None:
            self.checksums[model.digest] = checksum.engine
        self.held = Held(
            model, request.revision, "swap", info, checksum, note, model.seconds + update_seconds
        )
        self.failure = None
        self.mixed = None
        new = Weights(request.revision, request.manifest_digest)
        if request.hold_until_verified:
            self.gate.verifying(new, request.swap_timeout_s)
        else:
            self.gate.open(new)
        state = self.tracker.swapped(time.monotonic() - closed, update_seconds, steps.seconds)
        log.info(
            "swapped %s -> %s (%s) in %.2f s, requests held %.2f s (%s)",
            old.model.digest,
            model.digest,
            request.revision,
            state.seconds or 0.0,
            state.paused_seconds or 0.0,
            steps,
        )

    def _precheck(self, digest: str, old: Held) -> VerifiedModel:
        """What can be refused before pausing anything; the target's bytes checked."""
        _, manifest = staged_manifest(self.cache_dir, digest)
        changes = config_changes(old.model.manifest, manifest)
        if changes:
            raise VerifyFailure(
                FailureReason.CONFIG_CHANGED,
                f"{digest} cannot be swapped in: {'; '.join(changes[:5])} (SGLang read those "
                "at startup; roll it out by replacing pods)",
            )
        return self.verify(self.cache_dir, digest)

    def _check_checksum(self, checksum: WeightsChecksum, model: VerifiedModel, old: Held) -> None:
        known = self.checksums.get(model.digest)
        if known is not None and known != checksum.engine:
            raise StepFailed(
                FailureReason.READBACK_MISMATCH,
                f"SGLang's weights checksum is {checksum.engine[:16]}…, but {model.digest} "
                f"gave {known[:16]}… when it was loaded here before",
            )
        if (
            old.checksum is not None
            and checksum.engine == old.checksum.engine
            and tensor_files(model) != tensor_files(old.model)
        ):
            raise StepFailed(
                FailureReason.READBACK_MISMATCH,
                "SGLang's weights checksum did not change although the weight files did: "
                "it still holds the old weights",
            )

    def _failed(
        self,
        exc: Exception,
        request: SwapRequest,
        old: Held,
        closed: float,
        changing: bool,
    ) -> None:
        if isinstance(exc, StepFailed):
            reason, message = exc.reason, exc.message
        elif isinstance(exc, SGLangError) and exc.status == 0 and "timed out" in str(exc):
            reason, message = FailureReason.SWAP_TIMEOUT, str(exc)
        elif isinstance(exc, TimeoutError):
            reason, message = FailureReason.SWAP_TIMEOUT, str(exc) or "the swap timed out"
        else:
            reason, message = FailureReason.ENGINE_ERROR, _text(exc)
        if changing:
            # The weights may be anything between the two revisions: nothing serves.
            message = f"{message} (the weights may be mixed: generation stays paused)"
            self.mixed = message
            self.gate.refuse(FailureReason.MIXED_WEIGHTS, message)
            self.failure = LoadReport(
                "Failed",
                manifest_digest=request.manifest_digest,
                reason=FailureReason.MIXED_WEIGHTS,
                message=message,
            )
            self.tracker.failed(
                FailureReason.MIXED_WEIGHTS,
                f"{reason}: {message}",
                paused_seconds=time.monotonic() - closed,
            )
            log.error("swap to %s left mixed weights: %s", request.manifest_digest, message)
            return
        try:
            self.client.resume(CONTROL_TIMEOUT_S)
        except SGLangError as again:
            message = f"{message}; then SGLang did not resume: {again}"
            self.gate.refuse(FailureReason.ENGINE_ERROR, message)
            self.failure = LoadReport(
                "Failed",
                manifest_digest=old.model.digest,
                reason=FailureReason.ENGINE_ERROR,
                message=message,
            )
            self.tracker.failed(reason, message, paused_seconds=None)
            return
        self._reopen(old)
        self.tracker.failed(reason, message, paused_seconds=time.monotonic() - closed)
        log.warning(
            "swap to %s failed, still serving %s: %s",
            request.manifest_digest,
            old.model.digest,
            message,
        )

    def _undrained(self, request: SwapRequest, old: Held, closed: float) -> None:
        """Requests still ran at the drain timeout: the swap is refused, nothing paused or
        aborted; they finish on the old weights, which serve on."""
        message = (
            f"{self.gate.in_flight} request(s) still ran after the drain timeout "
            f"({request.drain_timeout_s} s): nothing was aborted or changed (the adapter "
            "cuts them only with --abort-on-drain-timeout)"
        )
        self._reopen(old)
        self.tracker.failed(
            FailureReason.DRAIN_TIMEOUT, message, paused_seconds=time.monotonic() - closed
        )
        log.warning("swap to %s refused: %s", request.manifest_digest, message)

    def _reopen(self, old: Held) -> None:
        """After a failed swap that changed nothing: the old weights serve again (unless an
        earlier swap left them mixed)."""
        if self.mixed is not None:
            self.gate.refuse(FailureReason.MIXED_WEIGHTS, self.mixed)
        else:
            self.gate.open(Weights(old.revision, old.model.digest))


def _text(exc: BaseException) -> str:
    return (str(exc) or type(exc).__name__)[:1000]


def _left(deadline: float, cap: float | None = None) -> float:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError("the swap timed out")
    return min(remaining, cap) if cap is not None else remaining


def tensor_files(model: VerifiedModel) -> dict[str, str]:
    return {f.path: f.sha256 for f in model.manifest.files if f.path.endswith(".safetensors")}


def readback_problem(info: ModelInfo, model: VerifiedModel, revision: str) -> str | None:
    """Why SGLang's word does not match what the adapter verified, or None."""
    if not same_folder(info.model_path, model.files):
        return (
            f"SGLang serves model_path {info.model_path!r}, not the verified {model.files} "
            f"of {model.digest} (start it with --model-path $(WEIGHTSHIP_MODEL_DIR))"
        )
    if info.weight_version != revision:
        return (
            f"SGLang reports weight_version {info.weight_version!r}, not {revision!r} (start "
            "it with --weight-version $(WEIGHTSHIP_MODEL_REVISION))"
        )
    return None


def loaded_report(held: Held, info: ModelInfo) -> LoadReport:
    model = held.model
    checked = (
        f"weights_checker {held.checksum.engine[:16]}… over {held.checksum.ranks} rank(s)"
        if held.checksum is not None
        else (held.checksum_note or "no weights_checker")
    )
    return LoadReport(
        state="Loaded",
        manifest_digest=model.digest,
        verified=True,
        source=held.source,
        load_seconds=round(held.load_seconds, 4),
        message=(
            f"SGLang reports weight_version {info.weight_version} from {info.model_path}; "
            f"the adapter checked every chunk of its {model.file_count} files "
            f"({model.algorithm}) before SGLang read them; {checked}"
        ),
    )


def details(held: Held, info: ModelInfo) -> dict[str, Any]:
    """What the report rests on, beside the LoadReport fields."""
    return {
        "mode": MODE,
        "sglang": {
            "weightVersion": info.weight_version,
            "modelPath": info.model_path,
            "loadFormat": info.load_format,
            "weightsChecksum": held.checksum.engine if held.checksum else None,
            "checksumRanks": held.checksum.ranks if held.checksum else None,
            "checksumNote": held.checksum_note,
        },
        "files": {
            "count": held.model.file_count,
            "bytes": held.model.bytes,
            "algorithm": held.model.algorithm,
            "verifySeconds": round(held.model.seconds, 4),
        },
    }
