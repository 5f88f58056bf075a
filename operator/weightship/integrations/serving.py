"""The server side of the inference-server contract (``weightship.api.inference``) that
every weightship server shares (the vLLM plugin, the SGLang adapter): the weights a
response is stamped with, who may swap, the swap's state machine and its step times, the
check that new weights keep the config and tokenizer the server started with, and the
answers. No inference engine, no HTTP framework, no torch in here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal, TypeVar

from weightship.api.env import MANIFEST_DIGEST_ENV, MODEL_REVISION_ENV
from weightship.api.inference import (
    DIGEST_HEADER,
    REVISION_HEADER,
    SWAP_GROUP_PREFIX,
    UNKNOWN_REVISION,
    FailureReason,
    SwapAnswer,
    SwapPhase,
    SwapRequest,
    SwapRequestError,
    SwapState,
    bearer_token,
)
from weightship.core.seedtoken import TokenRefusal, check_token
from weightship.weightformat.manifest import Manifest
from weightship.weightformat.paths import SAFETENSORS_SUFFIX, is_metadata_path

Parsed = TypeVar("Parsed", SwapRequest, str)  # what a swap route's body says
Answer = tuple[int, SwapAnswer]  # an HTTP status and its document

# -- which weights made a response -----------------------------------------------------

REVISION_HEADER_KEY = REVISION_HEADER.lower().encode("ascii")  # as ASGI spells it
DIGEST_HEADER_KEY = DIGEST_HEADER.lower().encode("ascii")


@dataclass(frozen=True)
class Weights:
    revision: str
    manifest_digest: str | None

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Weights:
        """What the server started with (WEIGHTSHIP_MODEL_REVISION and
        WEIGHTSHIP_MANIFEST_DIGEST, which the operator sets on the pod)."""
        return cls(
            env.get(MODEL_REVISION_ENV) or UNKNOWN_REVISION,
            env.get(MANIFEST_DIGEST_ENV) or None,
        )

    def headers(self) -> list[tuple[bytes, bytes]]:
        """REVISION_HEADER and DIGEST_HEADER with these weights (lowercase names)."""
        return [
            (REVISION_HEADER_KEY, _header_value(self.revision or UNKNOWN_REVISION)),
            (DIGEST_HEADER_KEY, _header_value(self.manifest_digest or "")),
        ]


def _header_value(text: str) -> bytes:
    """Printable ASCII only: an env value with anything else cannot split a header."""
    return "".join(c for c in text if " " <= c <= "~")[:128].encode("ascii")


GateMode = Literal["open", "closed", "verifying", "refusing"]


@dataclass(frozen=True)
class Refused:
    """A gate's answer to a request it does not admit."""

    status: int
    reason: str
    message: str


# -- who may swap ------------------------------------------------------------------------


@dataclass(frozen=True)
class SwapAuth:
    """What the server checks a swap's token with: its pod's seeding key, rollout uid and
    pod name (WEIGHTSHIP_SEED_KEY, WEIGHTSHIP_ROLLOUT_UID, WEIGHTSHIP_POD_NAME)."""

    key: bytes | None = field(repr=False)
    rollout_uid: str
    pod_name: str

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> SwapAuth:
        from weightship.api.env import ROLLOUT_UID_ENV
        from weightship.seeding.config import member_name, seeding_key

        return cls(seeding_key(env), env.get(ROLLOUT_UID_ENV, "").strip(), member_name(env))

    @property
    def group(self) -> str:
        return f"{SWAP_GROUP_PREFIX}{self.pod_name}"

    def missing(self, authorization: str | None) -> TokenRefusal | None:
        """Checked before the body is read: no key here, or no token at all."""
        if self.key is None:
            return TokenRefusal(
                403,
                FailureReason.NO_SWAP_KEY,
                "this server has no WEIGHTSHIP_SEED_KEY: it accepts no swap",
            )
        if bearer_token(authorization) is None:
            return TokenRefusal(401, "TokenMissing", "a swap needs 'Authorization: Bearer <token>'")
        return None

    def check(
        self, authorization: str | None, request: SwapRequest | str, now: float
    ) -> TokenRefusal | None:
        """None when the token opens this pod's swap to ``request.manifest_digest`` (or
        to the digest given)."""
        early = self.missing(authorization)
        if early is not None:
            return early
        digest = request if isinstance(request, str) else request.manifest_digest
        refusal = check_token(
            self.key,
            self.rollout_uid,
            digest,
            self.group,
            bearer_token(authorization),
            now,
        )
        if refusal is not None and refusal.reason != "TokenMissing":
            return replace(refusal, message=refusal.message.replace("seeding token", "swap token"))
        return refusal

    def authorize(
        self,
        authorization: str | None,
        body: bytes | None,
        parse: Callable[[bytes], Parsed],
        now: float,
    ) -> Parsed | Answer:
        """The body, parsed, once the token opens this pod's swap to its digest; else the
        answer (a server may call ``missing`` before it reads the body at all)."""
        refusal = self.missing(authorization)
        if refusal is not None:
            return refused(refusal)
        if body is None:
            return 400, SwapAnswer(False, FailureReason.BAD_REQUEST, "no body")
        try:
            parsed = parse(body)
        except SwapRequestError as exc:
            return bad_request(exc)
        refusal = self.check(authorization, parsed, now)
        if refusal is not None:
            return refused(refusal)
        return parsed

    def opens_verification(self, header: str | None, digest: str | None, now: float) -> bool:
        """Whether an X-Weightship-Verify header carries the swap token of ``digest``, the
        weights the gate verifies (only then may a request reach them before they pass)."""
        return header is not None and digest is not None and self.check(header, digest, now) is None


# -- the answers -------------------------------------------------------------------------


def refused(refusal: TokenRefusal) -> Answer:
    return refusal.status, SwapAnswer(False, refusal.reason, refusal.message)


def bad_request(exc: SwapRequestError) -> Answer:
    return exc.status, SwapAnswer(False, FailureReason.BAD_REQUEST, str(exc))


def busy(current: SwapState) -> Answer:
    message = "a swap is already running: GET this path for its state"
    return 409, SwapAnswer(False, FailureReason.SWAP_IN_PROGRESS, message, current)


def already_loaded(digest: str, current: SwapState) -> Answer:
    return 200, SwapAnswer(True, message=f"{digest} is already loaded and verified", swap=current)


def accepted(state: SwapState) -> Answer:
    return 202, SwapAnswer(True, swap=state)


def verified_answer(
    opened: bool, mode: str, digest: str | None, held_seconds: float | None = None
) -> Answer:
    """The answer to POST VERIFIED_PATH: whether the gate (``mode``, holding ``digest``)
    now serves everyone with the weights named, and how long it last held requests."""
    if opened:
        return 200, SwapAnswer(True, gate=mode, held_seconds=held_seconds)
    message = f"the gate is {mode} with {digest}"
    return 409, SwapAnswer(False, FailureReason.NOT_VERIFYING, message, gate=mode)


# -- the swap ------------------------------------------------------------------------------


class StepTimes:
    """How long each step of a swap took, in the order the steps ended
    (``SwapState.steps``): a step begins when the one before it ends."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._last = clock()
        self.seconds: dict[str, float] = {}

    def done(self, step: str) -> None:
        now = self._clock()
        self.seconds[step] = now - self._last
        self._last = now

    def __str__(self) -> str:
        return ", ".join(f"{k} {v:.3f} s" for k, v in self.seconds.items())


class SwapTracker:
    """The one swap of this server: Idle, then Draining -> Loading -> Swapped | Failed (a
    swap may fail from Draining too). A new swap starts only when none runs."""

    _NEXT: Mapping[str, frozenset[str]] = {
        "Idle": frozenset({"Draining"}),
        "Swapped": frozenset({"Draining"}),
        "Failed": frozenset({"Draining"}),
        "Draining": frozenset({"Loading", "Failed"}),
        "Loading": frozenset({"Swapped", "Failed"}),
    }

    def __init__(self, clock: Any = time.time) -> None:
        self._clock = clock
        self.current = SwapState()

    def begin(self, request: SwapRequest, from_digest: str | None) -> SwapState:
        self._move("Draining")
        self.current = SwapState(
            state="Draining",
            manifest_digest=request.manifest_digest,
            revision=request.revision,
            from_manifest_digest=from_digest,
            started_at=self._clock(),
        )
        return self.current

    def loading(self, drain_seconds: float) -> SwapState:
        self._move("Loading")
        self.current = replace(self.current, state="Loading", drain_seconds=drain_seconds)
        return self.current

    def swapped(
        self,
        paused_seconds: float,
        load_seconds: float | None,
        steps: Mapping[str, float] | None = None,
    ) -> SwapState:
        self._move("Swapped")
        return self._finish(
            "Swapped",
            paused_seconds=paused_seconds,
            load_seconds=load_seconds,
            steps=dict(steps) if steps else None,
            message=None,
        )

    def failed(
        self,
        reason: str,
        message: str,
        *,
        rank: int | None = None,
        paused_seconds: float | None = None,
    ) -> SwapState:
        self._move("Failed")
        return self._finish(
            "Failed", reason=reason, message=message, rank=rank, paused_seconds=paused_seconds
        )

    def _finish(self, state: SwapPhase, **changes: Any) -> SwapState:
        now = self._clock()
        started = self.current.started_at
        self.current = replace(
            self.current,
            state=state,
            finished_at=now,
            seconds=now - started if started is not None else None,
            **changes,
        )
        return self.current

    def _move(self, to: str) -> None:
        if to not in self._NEXT[self.current.state]:
            raise RuntimeError(f"a swap cannot go from {self.current.state} to {to}")


def config_changes(old: Manifest, new: Manifest) -> list[str]:
    """What a server read once at startup and a swap cannot change, as it differs between
    the manifest it started with and the new one: every file that is no ``.safetensors``
    (config.json, tokenizer files, ...; by their sha256) and the set of tensors (name,
    dtype, shape). Empty when the new weights fit the running server."""

    def others(m: Manifest) -> dict[str, str]:
        return {
            f.path: f.sha256
            for f in m.files
            if not f.path.endswith(SAFETENSORS_SUFFIX) and not is_metadata_path(f.path)
        }

    def tensors(m: Manifest) -> dict[str, tuple[str, tuple[int, ...]]]:
        return {t.name: (t.dtype, tuple(t.shape)) for t in m.tensors}

    changes: list[str] = []
    before, after = others(old), others(new)
    for path in sorted(set(before) | set(after)):
        if path not in after:
            changes.append(f"{path} is gone")
        elif path not in before:
            changes.append(f"{path} is new")
        elif before[path] != after[path]:
            changes.append(f"{path} differs")
    t_before, t_after = tensors(old), tensors(new)
    if t_before and t_after and t_before != t_after:
        names = sorted(set(t_before) ^ set(t_after)) or sorted(
            n for n in t_before if t_before[n] != t_after.get(n)
        )
        changes.append(f"the tensors differ ({', '.join(names[:3])})")
    return changes
