"""What the readiness-gate verifier concludes about one pod (pure; no HTTP, no kube).

The verifier (weightship.controller.verifier) asks the inference server what it loaded and
sends the golden prompts; the functions here turn those answers into the value of the pod
condition ``weightship.io/weights-verified``: True only when the loaded digest is the
manifest's and every golden prompt passed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from weightship.api.inference import FailureReason, LoadReport
from weightship.api.spec import GoldenPrompt, GoldenPromptExpectation

# How a pod's weights were checked (spec.validation.checksum, "auto" resolved per pod).
VerifyMode = Literal["loaded", "staged", "none"]

# Reasons of a gate still being worked on (the rollout waits); every other False reason is
# a verdict that counts against spec.validation.failureThreshold.
PENDING = "Pending"
LOADING = "Loading"
VERIFYING = "Verifying"
IN_PROGRESS_REASONS = frozenset({PENDING, LOADING, VERIFYING})
# Not a verdict either: the pod is about to be deleted and left traffic first (core.drain).
DRAINING = "Draining"
# Nor these: an in-place swap's, whose outcome is the pod's swap record (core.inplace).
SWAPPING = "Swapping"
SWAP_FAILED = "SwapFailed"
SWAP_REASONS = frozenset({SWAPPING, SWAP_FAILED})
# The reasons of a gate whose weights passed. A gate True with any other reason keeps a pod
# in traffic while it swaps (core.inplace): its server holds the requests, and the reason
# says where the swap and its checks are (Swapping, Pending, a failed check's reason).
VERIFIED = "Verified"
NOTHING_TO_VERIFY = "NothingToVerify"
PASSED_REASONS = frozenset({VERIFIED, NOTHING_TO_VERIFY})


def gate_passed(status: object, reason: object) -> bool:
    """Whether a weights-verified gate says the pod's weights passed (not merely open)."""
    return status == "True" and (reason is None or reason in PASSED_REASONS)


def verdict_reason(status: object, reason: object) -> bool:
    """Whether a gate's reason is a verdict against the weights (a failed check), whatever
    its status: not passed, nor in progress, nor a swap's, nor a drain's."""
    return (
        not gate_passed(status, reason)
        and reason not in IN_PROGRESS_REASONS
        and reason not in SWAP_REASONS
        and reason != DRAINING
    )


MAX_SHOWN = 200  # characters of a completion shown in a diff


@dataclass(frozen=True)
class PromptOutcome:
    """One golden prompt's result: what was expected and what the replica answered."""

    name: str
    passed: bool
    expected: str
    got: str

    def diff(self) -> str:
        got = self.got if len(self.got) <= MAX_SHOWN else self.got[:MAX_SHOWN] + "…"
        return f"golden prompt {self.name!r}: expected {self.expected}, got {json.dumps(got)}"


def describe_expectation(expect: GoldenPromptExpectation) -> str:
    for kind in ("equals", "prefix", "contains", "regex"):
        value = getattr(expect, kind)
        if value is not None:
            return f"{kind} {json.dumps(value)}"
    raise AssertionError("the API guarantees exactly one expectation")


def matches(expect: GoldenPromptExpectation, text: str) -> bool:
    if expect.equals is not None:
        return text == expect.equals
    if expect.prefix is not None:
        return text.startswith(expect.prefix)
    if expect.contains is not None:
        return expect.contains in text
    assert expect.regex is not None
    return re.search(expect.regex, text) is not None


def judge_prompt(prompt: GoldenPrompt, completion: str) -> PromptOutcome:
    return PromptOutcome(
        name=prompt.name,
        passed=matches(prompt.expect, completion),
        expected=describe_expectation(prompt.expect),
        got=completion,
    )


@dataclass(frozen=True)
class GateVerdict:
    """The value of the pod's weights-verified condition."""

    status: Literal["True", "False"]
    reason: str
    message: str
    failed_prompt: PromptOutcome | None = None
    mode: VerifyMode | None = None

    @property
    def final(self) -> bool:
        """A verdict is final (never re-checked) unless it is still in progress."""
        return self.status == "True" or self.reason not in IN_PROGRESS_REASONS


def load_verdict(report: LoadReport, want_digest: str, checksum: bool) -> GateVerdict | None:
    """The verdict from the load report alone; None when the golden prompts decide."""
    if report.state == "Loading":
        return GateVerdict("False", LOADING, report.message or "the server is loading weights")
    if report.state == "Failed":
        reason = report.reason or FailureReason.LOAD_FAILED
        return GateVerdict("False", reason, report.message or "the server failed to load weights")
    if checksum and report.manifest_digest != want_digest:
        return GateVerdict(
            "False",
            "DigestMismatch",
            f"loaded weights are {report.manifest_digest or 'unknown'}, the revision's "
            f"manifest is {want_digest}",
        )
    if checksum and not report.verified:
        return GateVerdict(
            "False", "NotVerified", "the server loaded the weights without verifying them"
        )
    return None


@dataclass(frozen=True)
class StagedEvidence:
    """What the pod object and its node say about the files the pod reads (mode staged)."""

    node: str | None
    cache_read_only: bool  # every container mounts the node cache read-only
    node_staged: bool  # the node is labelled staged (its agent verified every chunk)
    serves_model_dir: bool  # the container serves the pinned model's folder


def staged_verdict(evidence: StagedEvidence, want_digest: str) -> GateVerdict | None:
    """A final verdict when the staged evidence falls short; None when it holds."""
    problem = None
    if not want_digest:
        problem = ("NoDigest", "the pod carries no manifest digest")
    elif not evidence.cache_read_only:
        problem = ("CacheNotReadOnly", "the pod does not mount the node cache read-only")
    elif not evidence.node_staged:
        problem = (
            FailureReason.NOT_STAGED,
            f"node {evidence.node or '?'} does not report {want_digest} staged and verified",
        )
    elif not evidence.serves_model_dir:
        problem = (
            "ModelDirNotUsed",
            "no container serves $(WEIGHTSHIP_MODEL_DIR), the pinned model's staged folder",
        )
    if problem is None:
        return None
    return GateVerdict("False", problem[0], f"checksum staged: {problem[1]}", mode="staged")


def prompts_verdict(
    report: LoadReport | None,
    outcomes: Sequence[PromptOutcome],
    mode: VerifyMode | bool,
    evidence: StagedEvidence | None = None,
    want_digest: str | None = None,
) -> GateVerdict:
    """Every prompt was answered: fail on the first wrong answer, else verified. The
    message says which mode verified the pod."""
    if isinstance(mode, bool):  # the older call: checksum on or off
        mode = "loaded" if mode else "none"
    failed = next((o for o in outcomes if not o.passed), None)
    if failed is not None:
        return GateVerdict(
            "False", "GoldenPromptFailed", failed.diff(), failed_prompt=failed, mode=mode
        )
    parts = [f"checksum {mode}"]
    if mode == "loaded" and report is not None:
        parts.append(f"digest {report.manifest_digest} verified")
    if mode == "staged":
        node = evidence.node if evidence else None
        parts.append(
            f"digest {want_digest} staged and verified on node {node or '?'}, mounted read-only"
        )
    if report is not None:
        parts.append(describe_load(report))
    if outcomes:
        parts.append(f"{len(outcomes)}/{len(outcomes)} golden prompts passed")
    return GateVerdict("True", VERIFIED, "; ".join(p for p in parts if p), mode=mode)


def describe_load(report: LoadReport) -> str:
    if report.source is None:
        return ""
    how = {
        "cache": "the node cache",
        "origin": "S3",
        "broadcast": "broadcast",
        "swap": "the node cache by an in-place swap",
    }[report.source]
    text = f"loaded from {how}"
    if report.seeded_from:
        text += f" (seeded by {report.seeded_from})"
    if report.load_seconds is not None:
        text += f" in {report.load_seconds:.2f} s"
    return text


def gate_changed(current: Mapping[str, Any] | None, verdict: GateVerdict) -> bool:
    """Patch the pod only when the condition would change (no write per poll). An open gate
    with the verdict's reason and message is unchanged: a pod swapping in traffic keeps its
    gate open whatever the verdict (core.pod_gates.held_in_traffic)."""
    if current is None:
        return True
    if (current.get("reason"), current.get("message")) != (verdict.reason, verdict.message):
        return True
    return current.get("status") not in (verdict.status, "True")
