"""The inference-server contract, defined once: what the operator and a weightship
inference server (the vLLM plugin, the SGLang adapter, the test servers) say to each other.

    GET  LOADED_PATH    a LoadReport: what the server loaded, and whether it verified it
    POST SWAP_PATH      a SwapRequest, ``Authorization: Bearer <swap token>``;
                        answered with a SwapAnswer (202 accepted, 200 already loaded, 409
                        a swap runs, 4xx refused, 501 this server cannot swap)
    GET  SWAP_PATH      the SwapState of the latest swap
    POST VERIFIED_PATH  ``{"manifestDigest"}`` (``verified_request``), the same token: the
                        verifier passed the swapped weights; traffic may have them

With ``holdUntilVerified`` the swapped weights serve no request but the verifier's
(``VERIFY_HEADER: Bearer <token>``) until it says they passed. Every response carries
REVISION_HEADER and DIGEST_HEADER: the weights that made it. A server that refuses its
weights and exits says why in its container's termination message
(``termination_message``), where the verifier reads it.

The token is ``core.seedtoken.join_token(key, rollout_uid, manifestDigest,
group=SWAP_GROUP_PREFIX + pod_name, expires)``: the rollout's seeding key opens one
pod's swap to one model, for minutes. Why something failed is a ``FailureReason``.

The operator builds requests and reads answers with these types; the servers parse
requests and build answers with them (the server side they share is
``weightship.integrations.serving``). The stdlib only, like ``api.names``: the vLLM
plugin, installed without the operator's dependencies, imports it. See
docs/integrations.md, "In-place weight swaps".
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, Literal

LOADED_PATH = "/weightship/v1/loaded"
SWAP_PATH = "/weightship/v1/swap"
VERIFIED_PATH = f"{SWAP_PATH}/verified"

# Header names (HTTP's are case-insensitive; ASGI's are lowercase: ``.lower()``).
VERIFY_HEADER = "X-Weightship-Verify"  # the verifier's requests while the gate verifies
REVISION_HEADER = "X-Weightship-Revision"
DIGEST_HEADER = "X-Weightship-Manifest-Digest"
AUTHORIZATION_HEADER = "Authorization"

SWAP_GROUP_PREFIX = "swap/"  # the token's group: one pod's swaps
UNKNOWN_REVISION = "unknown"  # a server that was told no revision
MAX_SWAP_BODY = 64 * 1024
DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
# spec.model.revision's own pattern and length (api.spec.REVISION_PATTERN): a revision is
# also a response header value, so nothing else may pass.
REVISION_RE = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
MAX_REVISION = 63
# Bounds of spec.strategy.canary.inPlace (api.spec.InPlaceUpdate).
DRAIN_BOUNDS = (0, 3600)
SWAP_BOUNDS = (10, 3600)
HOLD_BOUNDS = (1, 3600)
DEFAULT_DRAIN_S = 30
DEFAULT_SWAP_S = 300


class FailureReason(StrEnum):
    """Why a load, a swap or a request failed, as servers report it (LoadReport.reason,
    SwapState.reason, SwapAnswer.reason) and the operator records it (a pod's swap
    record, its gate). A StrEnum: each is its string on the wire."""

    # The weights: found before any weight changed (the pod holds what it had).
    CHECKSUM_MISMATCH = "ChecksumMismatch"  # bytes or tensors do not match the manifest
    NOT_STAGED = "NotStaged"  # the digest is not staged in WEIGHTSHIP_CACHE_DIR
    MANIFEST_MISMATCH = "ManifestMismatch"  # the staged manifest is another digest
    CONFIG_CHANGED = "ConfigChanged"  # config/tokenizer (or the tensor set) differ
    LOAD_ERROR = "LoadError"  # the files could not be read
    NO_TENSOR_CHECKSUMS = "NoTensorChecksums"  # the manifest lists no tensors to check
    # Loading at startup.
    NOT_CONFIGURED = "NotConfigured"  # WEIGHTSHIP_CACHE_DIR or the digest is not set
    MODEL_PATH_MISMATCH = "ModelPathMismatch"  # the server reads another folder
    BROADCAST_CHECKSUM_MISMATCH = "BroadcastChecksumMismatch"  # corrupted by a broadcast
    LOAD_FAILED = "LoadFailed"  # a rank failed and said no more
    RANKS_DISAGREE = "RanksDisagree"  # the ranks loaded different weights
    # Found before any weight changed, the server's own state.
    ENGINE_SLEEPING = "EngineSleeping"  # vLLM's sleep mode: an update now would crash it
    DRAIN_TIMEOUT = "DrainTimeout"  # requests still ran, and the server aborts none
    # A swap that ran.
    SWAP_TIMEOUT = "SwapTimeout"
    ENGINE_ERROR = "EngineError"  # the engine refused a step, or a rank did not answer
    MIXED_WEIGHTS = "MixedWeights"  # a failure after parameters started changing
    READBACK_MISMATCH = "ReadbackMismatch"  # the engine's word is not what was asked
    # The server's answers.
    NOT_SWAPPABLE = "NotSwappable"  # this server cannot swap (no weightship engine, ...)
    NO_SWAP_KEY = "NoSwapKey"  # no WEIGHTSHIP_SEED_KEY here (or the operator has none)
    SWAP_IN_PROGRESS = "SwapInProgress"
    NOT_READY = "NotReady"  # no verified weights serve yet
    BAD_REQUEST = "BadRequest"
    NOT_VERIFYING = "NotVerifying"  # VERIFIED_PATH for weights the gate does not hold
    WEIGHTS_CHANGED = "WeightsChanged"  # a request cut by a swap: send it again
    HOLD_TIMEOUT = "HoldTimeout"  # a request held at a swap's gate for maxHoldSeconds
    # The operator's, for a swap whose server gave no reason of its own.
    UNAUTHORIZED = "Unauthorized"  # the server refused the token
    NOT_SUPPORTED = "NotSupported"  # the server has no in-place swap
    REFUSED = "Refused"  # the server refused the request (400, 413)
    ENGINE_UNREACHABLE = "EngineUnreachable"
    POD_GONE = "PodGone"


# -- the swap request --------------------------------------------------------------------


class SwapRequestError(ValueError):
    """A body the server answers 400 (or 413) to."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


_SWAP_FIELDS = {
    "manifest_digest": "manifestDigest",
    "revision": "revision",
    "drain_timeout_s": "drainTimeoutSeconds",
    "swap_timeout_s": "swapTimeoutSeconds",
    "hold_until_verified": "holdUntilVerified",
    "max_hold_s": "maxHoldSeconds",
}


@dataclass(frozen=True)
class SwapRequest:
    """POST SWAP_PATH: swap to ``manifest_digest`` (staged in the node cache), serving
    it as ``revision``."""

    manifest_digest: str
    revision: str
    drain_timeout_s: int = DEFAULT_DRAIN_S
    swap_timeout_s: int = DEFAULT_SWAP_S
    hold_until_verified: bool = False
    # The longest one request waits at the server's gate while this swap (and the checks
    # after it) runs; None: the swap's own bounds only (a server of an older contract).
    max_hold_s: int | None = None

    def to_json(self) -> dict[str, Any]:
        doc = {wire: getattr(self, name) for name, wire in _SWAP_FIELDS.items()}
        if self.max_hold_s is None:
            del doc["maxHoldSeconds"]
        return doc

    @classmethod
    def parse(cls, body: bytes) -> SwapRequest:
        doc = _json_object(body)
        unknown = set(doc) - set(_SWAP_FIELDS.values())
        if unknown:
            raise SwapRequestError(f"unknown fields {sorted(unknown)[:5]}")
        digest = _manifest_digest(doc)
        revision = doc.get("revision")
        if (
            not isinstance(revision, str)
            or len(revision) > MAX_REVISION
            or not REVISION_RE.fullmatch(revision)
        ):
            raise SwapRequestError(
                f"revision must be 1-{MAX_REVISION} letters, digits, '-', '_' or '.', "
                "starting and ending with a letter or digit"
            )
        hold = doc.get("holdUntilVerified", False)
        if not isinstance(hold, bool):
            raise SwapRequestError("holdUntilVerified must be true or false")
        return cls(
            digest,
            revision,
            _seconds(doc, "drainTimeoutSeconds", DEFAULT_DRAIN_S, DRAIN_BOUNDS),
            _seconds(doc, "swapTimeoutSeconds", DEFAULT_SWAP_S, SWAP_BOUNDS),
            hold,
            None
            if doc.get("maxHoldSeconds") is None
            else _seconds(doc, "maxHoldSeconds", 0, HOLD_BOUNDS),
        )


def verified_request(manifest_digest: str) -> dict[str, Any]:
    """The body of POST VERIFIED_PATH."""
    return {"manifestDigest": manifest_digest}


def parse_verified(body: bytes) -> str:
    """The manifest digest of a POST to VERIFIED_PATH (SwapRequestError when bad)."""
    doc = _json_object(body)
    if set(doc) != {"manifestDigest"}:
        raise SwapRequestError('the body must be {"manifestDigest": "sha256:<hex>"}')
    return _manifest_digest(doc)


def _json_object(body: bytes) -> dict[str, Any]:
    if len(body) > MAX_SWAP_BODY:
        raise SwapRequestError(f"the body is over {MAX_SWAP_BODY} bytes", 413)
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise SwapRequestError(f"the body is not JSON: {exc}"[:200]) from None
    if not isinstance(doc, dict):
        raise SwapRequestError("the body must be a JSON object")
    return doc


def _manifest_digest(doc: Mapping[str, Any]) -> str:
    digest = doc.get("manifestDigest")
    if not isinstance(digest, str) or not DIGEST_RE.fullmatch(digest):
        raise SwapRequestError("manifestDigest must be sha256:<64 lowercase hex digits>")
    return digest


def _seconds(doc: Mapping[str, Any], key: str, default: int, bounds: tuple[int, int]) -> int:
    value = doc.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise SwapRequestError(f"{key} must be an integer")
    low, high = bounds
    if not low <= value <= high:
        raise SwapRequestError(f"{key} must be in [{low}, {high}]")
    return value


def bearer(token: str) -> str:
    """The value of an ``Authorization`` (or VERIFY_HEADER) header carrying ``token``."""
    return f"Bearer {token}"


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, else None."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


# -- the swap's state and the answers ------------------------------------------------------

SwapPhase = Literal["Idle", "Draining", "Loading", "Swapped", "Failed"]
SWAP_PHASES = ("Idle", "Draining", "Loading", "Swapped", "Failed")


def rfc3339(epoch: float | None) -> str | None:
    if epoch is None:
        return None
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")[:-4] + "Z"


def _epoch(text: object) -> float | None:
    if not isinstance(text, str):
        return None
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


@dataclass(frozen=True)
class SwapState:
    """The state document of GET SWAP_PATH (the latest swap, or Idle)."""

    state: SwapPhase = "Idle"
    manifest_digest: str | None = None
    revision: str | None = None
    from_manifest_digest: str | None = None
    started_at: float | None = None  # epoch seconds
    finished_at: float | None = None
    seconds: float | None = None  # started to finished
    paused_seconds: float | None = None  # requests held: the gate closed to its reopening
    drain_seconds: float | None = None
    load_seconds: float | None = None  # the slowest rank's read and verification
    reason: str | None = None  # a FailureReason
    message: str | None = None
    rank: int | None = None  # the rank a failure came from, when one did
    steps: Mapping[str, float] | None = None  # seconds of each step of a swap that ran

    @property
    def running(self) -> bool:
        return self.state in ("Draining", "Loading")

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "state": self.state,
            "manifestDigest": self.manifest_digest,
            "revision": self.revision,
            "fromManifestDigest": self.from_manifest_digest,
            "startedAt": rfc3339(self.started_at),
            "finishedAt": rfc3339(self.finished_at),
            "seconds": _round(self.seconds),
            "pausedSeconds": _round(self.paused_seconds),
            "drainSeconds": _round(self.drain_seconds),
            "loadSeconds": _round(self.load_seconds),
            "reason": self.reason,
            "message": self.message,
        }
        if self.rank is not None:
            doc["rank"] = self.rank
        if self.steps:
            doc["steps"] = {k: round(v, 4) for k, v in self.steps.items()}
        return doc

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> SwapState:
        """Lenient: what a server said, with anything malformed left out (an unknown state
        reads as Idle: nothing the operator follows)."""
        state = doc.get("state")
        steps = doc.get("steps")
        return cls(
            state=state if state in SWAP_PHASES else "Idle",
            manifest_digest=_opt_str(doc.get("manifestDigest")),
            revision=_opt_str(doc.get("revision")),
            from_manifest_digest=_opt_str(doc.get("fromManifestDigest")),
            started_at=_epoch(doc.get("startedAt")),
            finished_at=_epoch(doc.get("finishedAt")),
            seconds=_number(doc.get("seconds")),
            paused_seconds=_number(doc.get("pausedSeconds")),
            drain_seconds=_number(doc.get("drainSeconds")),
            load_seconds=_number(doc.get("loadSeconds")),
            reason=_opt_str(doc.get("reason")),
            message=_opt_str(doc.get("message")),
            rank=rank if isinstance(rank := doc.get("rank"), int) else None,
            steps={str(k): float(v) for k, v in steps.items() if _number(v) is not None}
            if isinstance(steps, dict)
            else None,
        )


@dataclass(frozen=True)
class SwapAnswer:
    """The answer to POST SWAP_PATH and POST VERIFIED_PATH (its HTTP status aside)."""

    accepted: bool
    reason: str | None = None  # a FailureReason (or a token refusal's) when refused
    message: str | None = None
    swap: SwapState | None = None  # the swap started, running or done
    gate: str | None = None  # VERIFIED_PATH: the gate's mode now
    # VERIFIED_PATH: how long the gate last held requests, from its closing for a swap to
    # its opening to every request (through the checks, and a swap back if they failed).
    held_seconds: float | None = None

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"accepted": self.accepted}
        if self.held_seconds is not None:
            doc["heldSeconds"] = round(self.held_seconds, 4)
        if self.reason is not None:
            doc["reason"] = self.reason
        if self.message is not None:
            doc["message"] = self.message
        if self.swap is not None:
            doc["swap"] = self.swap.to_json()
        if self.gate is not None:
            doc["gate"] = self.gate
        return doc

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> SwapAnswer:
        swap = doc.get("swap")
        return cls(
            accepted=doc.get("accepted") is True,
            reason=_opt_str(doc.get("reason")),
            message=_opt_str(doc.get("message")),
            swap=SwapState.from_json(swap) if isinstance(swap, dict) else None,
            gate=_opt_str(doc.get("gate")),
            held_seconds=_number(doc.get("heldSeconds")),
        )


def _round(value: float | None) -> float | None:
    return round(value, 4) if value is not None else None


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _opt_str(value: object) -> str | None:
    return str(value) if value not in (None, "") else None


# -- the loaded-weights report -------------------------------------------------------------

LoadState = Literal["Loading", "Loaded", "Failed"]
# "swap": swapped in place into a running server, from the node cache (every byte checked).
LoadSource = Literal["cache", "origin", "broadcast", "swap"]
LOAD_SOURCES = ("cache", "origin", "broadcast", "swap")


@dataclass(frozen=True)
class LoadReport:
    """The inference server's answer on GET LOADED_PATH: what it loaded. Servers build
    their answer with ``to_json``, the verifier reads it with ``from_json``."""

    state: LoadState
    manifest_digest: str | None = None
    verified: bool = False
    reason: str | None = None  # a FailureReason
    message: str | None = None
    source: LoadSource | None = None
    seeded_from: str | None = None
    load_seconds: float | None = None

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> LoadReport:
        state = doc.get("state")
        if state not in ("Loading", "Loaded", "Failed"):
            raise ValueError(f"state must be Loading, Loaded or Failed, got {state!r}")
        source = doc.get("source")
        seconds = doc.get("loadSeconds")
        return cls(
            state=state,
            manifest_digest=_opt_str(doc.get("manifestDigest")),
            verified=doc.get("verified") is True,
            reason=_opt_str(doc.get("reason")),
            message=_opt_str(doc.get("message")),
            source=source if source in LOAD_SOURCES else None,
            seeded_from=_opt_str(doc.get("seededFrom")),
            load_seconds=float(seconds) if isinstance(seconds, int | float) else None,
        )

    def to_json(self) -> dict[str, Any]:
        """The document the inference server answers (the inverse of ``from_json``)."""
        return {
            "manifestDigest": self.manifest_digest,
            "verified": self.verified,
            "state": self.state,
            "reason": self.reason,
            "message": self.message,
            "source": self.source,
            "seededFrom": self.seeded_from,
            "loadSeconds": self.load_seconds,
        }


# A server that refuses its weights may exit (vLLM does) rather than stay up to say why:
# it writes this document as its container's termination message (to
# WEIGHTSHIP_TERMINATION_LOG, else DEFAULT_TERMINATION_LOG), which the kubelet puts in
# the pod's status, where the verifier reads it.
TERMINATION_KEY = "weightshipLoadReport"
DEFAULT_TERMINATION_LOG = "/dev/termination-log"


def termination_message(report: LoadReport) -> str:
    return json.dumps({TERMINATION_KEY: report.to_json()}, sort_keys=True)


def report_from_termination(message: str | None) -> LoadReport | None:
    """The failed load a container reported on its way out, if it reported one."""
    if not message or TERMINATION_KEY not in message:
        return None
    for line in reversed(message.splitlines()):
        try:
            report = LoadReport.from_json(json.loads(line)[TERMINATION_KEY])
        except (ValueError, KeyError, TypeError):
            continue
        return report if report.state == "Failed" else None
    return None
