"""The API server's side of an in-place swap: it drains, drives every rank through the
``weightship`` weight-transfer engine, and reopens the gate (asyncio; no vLLM imports: the
engine client comes in, typed by what it is used for).

    precheck   the engine is awake (an update while vLLM sleeps would crash it), the
               target is staged, its manifest is its digest, config unchanged
    drain      gate closed (new requests wait); in-flight requests finish, up to the drain
               timeout; pause_generation(mode="wait"), or "abort" once that has passed
    seal       requests still in flight are cut from now on (stamp.WeightsGate.seal)
    stage      every rank reads and verifies the target into host memory
    apply      every rank loads it (only if every rank staged it)
    commit     every rank reports the new digest (only if every rank applied it)
    finish     finish_weight_update(weight_version=revision), reset_prefix_cache(),
               resume_generation(), the gate opens with the new weights (or, asked to
               hold until verified, lets only the verifier's requests reach them until
               POST /weightship/v1/swap/verified)

A failure before ``apply`` changes nothing: generation resumes on the old weights and the
gate reopens with them. A failure from ``apply`` on leaves mixed weights: every rank
reports Failed/MixedWeights, generation stays paused and the gate refuses (503) until a
later swap succeeds.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from weightship.api.inference import FailureReason, SwapRequest, SwapState
from weightship.integrations.serving import StepTimes, SwapTracker, Weights, config_changes
from weightship.loader.load import locate_staged
from weightship.weightformat.cachedir import MANIFEST_FILE
from weightship.weightformat.manifest import Manifest, ManifestError

from .reports import merge, read_rank_reports
from .stamp import WeightsGate
from .swap import RankOutcome, first_failure, ranked, read_outcomes

log = logging.getLogger("vllm.weightship")
# Beyond the swap's own timeout: what cleaning up after a timed-out step may take.
CLEANUP_GRACE_S = 30.0


class EngineClient(Protocol):
    """The parts of vLLM's engine client (AsyncLLM) a swap uses."""

    async def pause_generation(self, *, mode: Any = ..., clear_cache: bool = ...) -> None: ...

    async def resume_generation(self) -> None: ...

    async def start_weight_update(self) -> None: ...

    async def update_weights(self, request: Any) -> None: ...

    async def finish_weight_update(self, weight_version: str | None = None) -> None: ...

    async def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool: ...

    async def is_sleeping(self) -> bool: ...  # vLLM's sleep mode (its absence: never)


class StepFailed(Exception):
    def __init__(self, outcome: RankOutcome) -> None:
        super().__init__(ranked(outcome))
        self.outcome = outcome


class Timeout(Exception):
    pass


@dataclass
class SwapDriver:
    engine: EngineClient
    gate: WeightsGate
    tracker: SwapTracker
    run_dir: Path
    cache_dir: Path | None
    world: int
    # vLLM's WeightTransferUpdateRequest(update_info=...), made by the endpoint.
    make_update: Callable[[dict[str, Any]], Any] = lambda info: info
    task: asyncio.Task[None] | None = None
    # Set when a swap failed after parameters changed; only a successful swap clears it.
    mixed: str | None = None
    # A start_weight_update was sent and its finish_weight_update not yet: every rank's
    # worker refuses (raises) an update outside a session, or a second start, and vLLM's
    # executor must never see a rank raise (see engine.py). vLLM runs the engine's calls
    # in the order they were sent, so what counts is what was sent, not what completed.
    session: bool = False
    # A swap paused generation and no resume_generation has succeeded since (a swap that
    # left mixed weights keeps it paused): vLLM counts the engine as sleeping then.
    paused: bool = False

    def running(self) -> bool:
        return self.task is not None and not self.task.done()

    def loaded_digest(self) -> str | None:
        """The digest every rank loaded and verified, if they all did."""
        merged = merge(read_rank_reports(self.run_dir))
        return merged.manifest_digest if merged.state == "Loaded" and merged.verified else None

    def start(self, request: SwapRequest) -> SwapState:
        """Begin a swap in the background (the caller checked none runs)."""
        state = self.tracker.begin(request, self.gate.weights.manifest_digest)
        self.task = asyncio.get_running_loop().create_task(self._run(request))
        return state

    # -- the swap --------------------------------------------------------------------------

    async def _run(self, request: SwapRequest) -> None:
        swap_id = uuid.uuid4().hex[:16]
        started = time.monotonic()
        deadline = started + request.swap_timeout_s
        deadline_epoch = time.time() + request.swap_timeout_s
        old = self.gate.weights
        new = Weights(request.revision, request.manifest_digest)
        stage: dict[str, Any] = {
            "swapId": swap_id,
            "manifestDigest": request.manifest_digest,
            "revision": request.revision,
            "deadline": deadline_epoch,
        }

        precheck = await self._asleep(deadline) or await asyncio.to_thread(
            self._precheck, request.manifest_digest
        )
        if precheck is not None:
            self.tracker.failed(*precheck, paused_seconds=0.0)
            log.warning("swap to %s refused: %s", request.manifest_digest, precheck[1])
            return

        self.gate.close(
            request.drain_timeout_s + request.swap_timeout_s + CLEANUP_GRACE_S, request.max_hold_s
        )
        closed = time.monotonic()
        changing = False
        steps = StepTimes()
        try:
            await self._drain(request.drain_timeout_s, deadline)
            steps.done("drain")
            self.gate.seal()
            self.tracker.loading(time.monotonic() - closed)
            await self._start(deadline)
            staged = await self._step("stage", stage, deadline)
            steps.done("stage")
            changing = True
            await self._step("apply", {"swapId": swap_id}, deadline)
            steps.done("apply")
            await self._step("commit", {"swapId": swap_id}, deadline)
            steps.done("commit")
            await self._finish(deadline, request.revision)
            await self._call(self.engine.reset_prefix_cache(), deadline)
            await self._resume(deadline)
            steps.done("resume")
        except StepFailed as exc:
            await self._failed(exc.outcome, swap_id, request, old, closed, changing)
            return
        except Exception as exc:  # a refused step, or a timeout
            reason = (
                FailureReason.SWAP_TIMEOUT
                if isinstance(exc, Timeout)
                else FailureReason.ENGINE_ERROR
            )
            outcome = RankOutcome(swap_id, "", -1, False, reason, _text(exc))
            await self._failed(outcome, swap_id, request, old, closed, changing)
            return
        if request.hold_until_verified:
            # The verifier's turn: traffic gets the new weights once they pass (swap.py).
            self.gate.verifying(new, request.swap_timeout_s)
        else:
            self.gate.open(new)
        self.mixed = None
        load = max((o.seconds or 0.0 for o in staged), default=None)
        state = self.tracker.swapped(time.monotonic() - closed, load, steps.seconds)
        log.info(
            "swapped %s -> %s (%s) in %.2f s, requests held %.2f s (%s)",
            old.manifest_digest,
            new.manifest_digest,
            new.revision,
            state.seconds or 0.0,
            state.paused_seconds or 0.0,
            steps,
        )

    async def _asleep(self, deadline: float) -> tuple[str, str] | None:
        """Why no swap may start while vLLM's sleep mode holds the engine (its weights
        offloaded or dropped: a weight update then crashes it), or None when it is awake.
        vLLM says an engine sleeps whenever its scheduler is paused too: one a swap left
        paused is this plugin's own (nothing else reaches it: a /sleep waits at the gate
        while a swap runs, and is refused while the weights are mixed); one paused by
        anyone else is refused like a sleeping one."""
        is_sleeping = getattr(self.engine, "is_sleeping", None)
        if is_sleeping is None or self.paused:
            return None  # an engine client without sleep mode, or paused by a swap
        try:
            sleeping = await self._call(is_sleeping(), deadline)
        except Exception as exc:
            return (
                FailureReason.ENGINE_ERROR,
                f"cannot tell whether the engine sleeps: {_text(exc)}",
            )
        if sleeping:
            return FailureReason.ENGINE_SLEEPING, (
                "the engine sleeps (vLLM's sleep mode) or was paused outside a swap: wake "
                "it up (POST /wake_up) or resume it before swapping its weights"
            )
        return None

    def _precheck(self, digest: str) -> tuple[str, str] | None:
        """What the API server can tell before pausing anything (every rank checks it all
        again, against what it loaded)."""
        if self.cache_dir is None:
            return FailureReason.NOT_STAGED, "WEIGHTSHIP_CACHE_DIR is not set"
        files = locate_staged(self.cache_dir, digest)
        if files is None:
            return FailureReason.NOT_STAGED, f"{digest} is not staged in {self.cache_dir}"
        try:
            new = Manifest.parse((files.parent / MANIFEST_FILE).read_bytes())
        except (OSError, ManifestError) as exc:
            return FailureReason.MANIFEST_MISMATCH, f"cannot read the manifest of {digest}: {exc}"[
                :500
            ]
        if new.digest != digest:
            return (
                FailureReason.MANIFEST_MISMATCH,
                f"the manifest staged as {digest} is {new.digest}",
            )
        current = self.gate.weights.manifest_digest
        at = locate_staged(self.cache_dir, current) if current else None
        if at is not None:
            try:
                old = Manifest.parse((at.parent / MANIFEST_FILE).read_bytes())
            except (OSError, ManifestError):
                return None  # the ranks compare with what they loaded
            changes = config_changes(old, new)
            if changes:
                return FailureReason.CONFIG_CHANGED, (
                    f"{digest} cannot be swapped in: {'; '.join(changes[:5])} "
                    "(vLLM read those at startup; roll it out by replacing pods)"
                )
        return None

    async def _drain(self, drain_s: float, deadline: float) -> None:
        end = time.monotonic() + drain_s
        await self.gate.wait_idle(drain_s)
        self.paused = True  # sent from here on, even if its answer times out
        remaining = end - time.monotonic()
        if remaining > 0:
            try:
                await asyncio.wait_for(self.engine.pause_generation(mode="wait"), remaining)
                return
            except TimeoutError:
                pass
        log.info("drain timeout: aborting the requests still running")
        await self._call(self.engine.pause_generation(mode="abort"), deadline)

    async def _step(self, op: str, info: dict[str, Any], deadline: float) -> list[RankOutcome]:
        await self._send({"op": op, **info}, deadline)
        outcomes = read_outcomes(self.run_dir, str(info["swapId"]), op, self.world)
        failure = first_failure(outcomes)
        if failure is not None:
            raise StepFailed(failure)
        return outcomes

    async def _call(self, step: Awaitable[Any], deadline: float) -> Any:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            if asyncio.iscoroutine(step):
                step.close()  # never sent
            raise Timeout("the swap timed out")
        try:
            return await asyncio.wait_for(step, remaining)
        except TimeoutError:
            raise Timeout("the swap timed out") from None

    async def _start(self, deadline: float) -> None:
        if deadline - time.monotonic() <= 0:
            raise Timeout("the swap timed out")
        self.session = True  # sent from here on, even if its answer times out
        await self._call(self.engine.start_weight_update(), deadline)

    async def _finish(self, deadline: float, weight_version: str | None = None) -> None:
        if not self.session:
            return
        self.session = False
        await self._call(self.engine.finish_weight_update(weight_version), deadline)

    async def _send(self, info: dict[str, Any], deadline: float) -> None:
        if not self.session:
            raise RuntimeError(f"{info['op']} outside a weight update session")
        await self._call(self.engine.update_weights(self.make_update(info)), deadline)

    async def _resume(self, deadline: float) -> None:
        if self.gate.in_flight:  # requests admitted before the seal, queued: cut anyway
            await self._call(self.engine.pause_generation(mode="abort"), deadline)
        await self._call(self.engine.resume_generation(), deadline)
        self.paused = False

    async def _failed(
        self,
        outcome: RankOutcome,
        swap_id: str,
        request: SwapRequest,
        old: Weights,
        closed: float,
        changing: bool,
    ) -> None:
        rank = outcome.rank if outcome.rank >= 0 else None
        message = ranked(outcome) if rank is not None else (outcome.message or "")
        reason = outcome.reason or FailureReason.ENGINE_ERROR
        cleanup = time.monotonic() + CLEANUP_GRACE_S
        if changing:
            # Parameters may have changed on some rank: every rank says so, nothing serves.
            message = f"{message} (the weights are mixed: generation stays paused)"
            self.mixed = message
            self.gate.refuse(FailureReason.MIXED_WEIGHTS, message)
            try:
                if not self.session:
                    await self._start(cleanup)
                poison = {"swapId": swap_id, "manifestDigest": request.manifest_digest}
                await self._send({"op": "poison", **poison, "message": message}, cleanup)
                await self._finish(cleanup)
            except Exception as exc:
                log.error("after a failed swap, the ranks could not all be told: %s", exc)
            self.tracker.failed(
                FailureReason.MIXED_WEIGHTS,
                message,
                rank=rank,
                paused_seconds=time.monotonic() - closed,
            )
            log.error("swap to %s left mixed weights: %s", request.manifest_digest, message)
            return
        try:
            if self.session:
                await self._send({"op": "discard", "swapId": swap_id}, cleanup)
                await self._finish(cleanup)
            if self.mixed is None:
                await self._resume(cleanup)
        except Exception as exc:
            # The engine did not come back: nothing can be served that is known good.
            self.gate.refuse(
                FailureReason.ENGINE_ERROR, f"the engine did not resume after a failed swap: {exc}"
            )
            self.tracker.failed(
                reason, f"{message}; then: {_text(exc)}", rank=rank, paused_seconds=None
            )
            return
        if self.mixed is not None:  # what was there before this swap is mixed too
            self.gate.refuse(FailureReason.MIXED_WEIGHTS, self.mixed)
        else:
            self.gate.open(old)
        self.tracker.failed(reason, message, rank=rank, paused_seconds=time.monotonic() - closed)
        log.warning(
            "swap to %s failed, still serving %s: %s",
            request.manifest_digest,
            old.manifest_digest,
            message,
        )


def _text(exc: BaseException) -> str:
    return (str(exc) or type(exc).__name__)[:500]
