"""In-place weight swaps, the parts with no vLLM, no HTTP framework and no torch in them:
the request and its authentication, the state document, the check that a new revision
keeps the config and tokenizer vLLM started with, and the per-rank outcome files through
which the workers answer the API server.

    POST /weightship/v1/swap   {"manifestDigest", "revision", "drainTimeoutSeconds",
                                "swapTimeoutSeconds", "holdUntilVerified"},
                               Authorization: Bearer <token>
    GET  /weightship/v1/swap   the state document (``SwapState.to_json``)
    POST /weightship/v1/swap/verified   {"manifestDigest"}, the same token: the verifier
                               checked the new weights; traffic may have them

With ``holdUntilVerified`` the swapped weights serve no request but the verifier's own
(``X-Weightship-Verify: Bearer <token>``) until it says they passed: a request a stale
router sends the pod meanwhile waits at the gate (``stamp``), and is served once they
pass, or by whatever the operator swaps back in when they fail.

The token is ``core.seedtoken.join_token(key, rollout_uid, manifestDigest,
group=f"swap/{pod_name}", expires)``: the rollout's seeding key opens one pod's swap to
one model, for minutes. See docs/integrations.md, "In-place weight swaps".
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from weightship.core.seedtoken import TokenRefusal, check_token
from weightship.weightformat.manifest import Manifest
from weightship.weightformat.paths import SAFETENSORS_SUFFIX, is_metadata_path

SWAP_PATH = "/weightship/v1/swap"
VERIFIED_PATH = SWAP_PATH + "/verified"
VERIFY_HEADER = "x-weightship-verify"  # the verifier's requests while the gate verifies
MAX_SWAP_BODY = 64 * 1024
SWAP_GROUP_PREFIX = "swap/"
DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
# spec.model.revision's own pattern and length (api.spec.REVISION_PATTERN): a revision is
# also a response header value, so nothing else may pass.
REVISION_RE = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
MAX_REVISION = 63
# Bounds of spec.strategy.canary.inPlace (api.spec.InPlaceUpdate).
DRAIN_BOUNDS = (0, 3600)
SWAP_BOUNDS = (10, 3600)
DEFAULT_DRAIN_S = 30
DEFAULT_SWAP_S = 300
UNKNOWN_REVISION = "unknown"

SwapPhase = Literal["Idle", "Draining", "Loading", "Swapped", "Failed"]
# Why a swap failed (SwapState.reason):
CHECKSUM_MISMATCH = "ChecksumMismatch"  # bytes or tensors do not match the manifest
NOT_STAGED = "NotStaged"  # the digest is not staged in WEIGHTSHIP_CACHE_DIR
MANIFEST_MISMATCH = "ManifestMismatch"  # the staged manifest is another digest
CONFIG_CHANGED = "ConfigChanged"  # config/tokenizer (or the tensor set) differ
SWAP_TIMEOUT = "SwapTimeout"
ENGINE_ERROR = "EngineError"  # vLLM refused a step, or a rank did not answer
MIXED_WEIGHTS = "MixedWeights"  # a rank failed after parameters started changing
NOT_SWAPPABLE = "NotSwappable"  # this server cannot swap (no weightship engine, ...)


class SwapRequestError(ValueError):
    """A body the endpoint answers 400 (or 413) to."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class SwapRequest:
    manifest_digest: str
    revision: str
    drain_timeout_s: int = DEFAULT_DRAIN_S
    swap_timeout_s: int = DEFAULT_SWAP_S
    hold_until_verified: bool = False

    @classmethod
    def parse(cls, body: bytes) -> SwapRequest:
        doc = _json_object(body)
        unknown = set(doc) - {
            "manifestDigest",
            "revision",
            "drainTimeoutSeconds",
            "swapTimeoutSeconds",
            "holdUntilVerified",
        }
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
        )


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


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, else None."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


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
                403, "NoSwapKey", "this server has no WEIGHTSHIP_SEED_KEY: it accepts no swap"
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

    def opens_verification(self, header: str | None, digest: str | None, now: float) -> bool:
        """Whether an X-Weightship-Verify header carries the swap token of ``digest``, the
        weights the gate verifies (only then may a request reach them before they pass)."""
        return header is not None and digest is not None and self.check(header, digest, now) is None


def verified_answer(opened: bool, mode: str, digest: str | None) -> tuple[int, dict[str, Any]]:
    """The answer to POST VERIFIED_PATH: whether the gate (``mode``, holding ``digest``)
    now serves everyone with the weights named."""
    if opened:
        return 200, {"accepted": True, "gate": mode}
    message = f"the gate is {mode} with {digest}"
    return 409, {"accepted": False, "reason": "NotVerifying", "message": message, "gate": mode}


def not_swappable(engine_client: Any, args: Any) -> str | None:
    """Why this vLLM server cannot swap in place, or None (``engine_client`` is vLLM's,
    ``args`` its parsed command line)."""
    config = getattr(engine_client, "vllm_config", None)
    if config is None:
        return "this server has no engine"
    transfer = getattr(config, "weight_transfer_config", None)
    if transfer is None or getattr(transfer, "backend", None) != "weightship":
        return 'vLLM runs without --weight-transfer-config \'{"backend": "weightship"}\''
    if getattr(config.load_config, "load_format", None) != "weightship":
        return "vLLM did not load its weights with --load-format weightship"
    if config.parallel_config.data_parallel_size > 1:
        return "in-place swaps support one engine (data parallel size 1)"
    if (getattr(args, "api_server_count", None) or 1) > 1:
        return "in-place swaps support one API server process (--api-server-count 1)"
    return None


def refusal_doc(refusal: TokenRefusal) -> dict[str, Any]:
    return {"accepted": False, "reason": refusal.reason, "message": refusal.message}


def rfc3339(epoch: float | None) -> str | None:
    if epoch is None:
        return None
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")[:-4] + "Z"


@dataclass(frozen=True)
class SwapState:
    """The state document of GET /weightship/v1/swap (the latest swap, or Idle)."""

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
    reason: str | None = None
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


def _round(value: float | None) -> float | None:
    return round(value, 4) if value is not None else None


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


# -- what must not change across a swap -------------------------------------------------


def config_changes(old: Manifest, new: Manifest) -> list[str]:
    """What vLLM read once at startup and a swap cannot change, as it differs between the
    manifest it started with and the new one: every file that is no ``.safetensors``
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


# -- the workers' answers ------------------------------------------------------------------

OUTCOME_GLOB = "swap-rank-*.json"
MAX_OUTCOME_BYTES = 64 * 1024
OutcomeOp = Literal["stage", "apply", "commit", "discard", "poison"]


@dataclass(frozen=True)
class RankOutcome:
    """What one worker did with one step of one swap (``swap-rank-<rank>.json``)."""

    swap_id: str
    op: str
    rank: int
    ok: bool
    reason: str | None = None
    message: str | None = None
    seconds: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "swapId": self.swap_id,
            "op": self.op,
            "rank": self.rank,
            "ok": self.ok,
            "reason": self.reason,
            "message": self.message,
            "seconds": self.seconds,
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> RankOutcome:
        rank, seconds = doc.get("rank"), doc.get("seconds")
        if not isinstance(rank, int) or not isinstance(doc.get("ok"), bool):
            raise ValueError("an outcome needs an int rank and a bool ok")
        return cls(
            swap_id=str(doc.get("swapId")),
            op=str(doc.get("op")),
            rank=rank,
            ok=bool(doc["ok"]),
            reason=_opt(doc.get("reason")),
            message=_opt(doc.get("message")),
            seconds=float(seconds) if isinstance(seconds, int | float) else None,
        )


def _opt(value: object) -> str | None:
    return str(value) if value not in (None, "") else None


def outcome_path(run_dir: Path, rank: int) -> Path:
    return run_dir / f"swap-rank-{rank}.json"


def write_outcome(run_dir: Path, outcome: RankOutcome) -> None:
    """Atomically (write, then rename), as the rank reports are."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = outcome_path(run_dir, outcome.rank)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(outcome.to_json(), sort_keys=True))
    tmp.replace(path)


def read_outcomes(run_dir: Path, swap_id: str, op: str, world: int) -> list[RankOutcome]:
    """Every rank's answer to ``op`` of swap ``swap_id``; a rank that wrote none (or an
    older one) answers as failed, so silence is never taken for success."""
    out = []
    for rank in range(world):
        try:
            with open(outcome_path(run_dir, rank), "rb") as f:
                got = RankOutcome.from_json(json.loads(f.read(MAX_OUTCOME_BYTES)))
        except (OSError, ValueError, TypeError) as exc:
            got = RankOutcome(swap_id, op, rank, False, ENGINE_ERROR, f"no answer: {exc}")
        if got.swap_id != swap_id or got.op != op or got.rank != rank:
            got = RankOutcome(swap_id, op, rank, False, ENGINE_ERROR, f"no answer to {op}")
        out.append(got)
    return out


def first_failure(outcomes: list[RankOutcome]) -> RankOutcome | None:
    """The lowest rank that failed, preferring a rank's own failure over one that only
    says it did not answer."""
    failed = [o for o in outcomes if not o.ok]
    own = [o for o in failed if o.reason != ENGINE_ERROR]
    candidates = own or failed
    return candidates[0] if candidates else None


def ranked(outcome: RankOutcome) -> str:
    """``rank <r>: <message>``, as /weightship/v1/loaded names a failed rank."""
    return f"rank {outcome.rank}: {outcome.message or outcome.reason or 'failed'}"
