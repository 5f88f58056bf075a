"""Staging failures the node agents report, and what they mean for a rollout. Pure.

A deterministic failure (the origin's bytes of a chunk do not match the manifest, the
manifest at the source is invalid or was republished) fails the same way on every node,
so waiting for progressDeadlineSeconds only wastes it: the rollout aborts as soon as
``MIN_AGREEING_NODES`` target nodes report the same one (every target node, when there
are fewer). One node alone never aborts a rollout: its disk, its network or its agent may
be what is wrong. Transient failures (S3 errors, timeouts, short reads) and a node's own
problems (DiskFull) never abort: the gate waits, naming the nodes and why, within the
progress deadline; a node that cannot stage is not counted as staged, so
``minStagedPercent`` decides whether the others are enough.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime

from weightship.api.weightcache import StagingFailure
from weightship.core.observed import NodeStaging, PrefetchObservation

DETERMINISTIC = frozenset({"OriginMismatch", "ManifestInvalid", "ManifestChanged"})
MIN_AGREEING_NODES = 2
MAX_NAMED_NODES = 5  # nodes named in a message; the rest are counted
MAX_DETAIL = 300  # characters of a node's lastError quoted in a message
# The operator keeps a manifest's digest until the spec's source or model.revision changes.
REMEDY = (
    "restore the published bytes and `weightship retry`, or publish again "
    "(`weightship manifest`) under a new spec.model.revision"
)


@dataclass(frozen=True)
class StagingVerdict:
    """A deterministic staging failure enough nodes agree on: abort with it."""

    reason: str
    message: str
    nodes: tuple[str, ...]
    failure: StagingFailure

    @property
    def details(self) -> tuple[tuple[str, str], ...]:
        """Fields for the Slack message."""
        f = self.failure
        out = [("staging failure", f.reason), ("nodes", _names(self.nodes))]
        if f.file is not None:
            out.append(("file", f.file))
        if f.chunk is not None:
            out.append(("chunk", f"{f.chunk} (offset {f.offset})"))
        return tuple(out)


def _failing(node: NodeStaging) -> StagingFailure | None:
    """The failure of a node that has not staged (Failed, or Staging a retry)."""
    return node.failure if node.state != "Staged" else None


def deterministic_failure(
    prefetch: PrefetchObservation | None, since: datetime | None = None
) -> StagingVerdict | None:
    """The deterministic failure that at least ``MIN_AGREEING_NODES`` target nodes (all of
    them, if fewer) report alike: same reason, and for OriginMismatch the same file and
    chunk. None when there is none: the rollout keeps waiting. ``since``: only attempts
    started then or later count (after a `retry`, the failures from before it are what
    the user meant to fix, and the agents' next attempts say whether they did)."""
    if prefetch is None or prefetch.target_nodes == 0:
        return None
    groups: dict[tuple[str, str | None, int | None], list[NodeStaging]] = defaultdict(list)
    for node in prefetch.nodes:
        f = _failing(node)
        if f is not None and f.reason in DETERMINISTIC and not _stale(node, f, since):
            groups[(f.reason, f.file, f.chunk)].append(node)
    need = min(MIN_AGREEING_NODES, prefetch.target_nodes)
    agreeing = [(k, g) for k, g in groups.items() if len(g) >= need]
    if not agreeing:
        return None
    # The largest group; ties by reason, file and chunk, so every reconcile says the same.
    _, nodes = min(agreeing, key=lambda kg: (-len(kg[1]), kg[0][0], kg[0][1] or "", kg[0][2] or 0))
    failure = nodes[0].failure
    assert failure is not None
    names = tuple(sorted(n.name for n in nodes))
    return StagingVerdict(
        failure.reason,
        _describe(failure, names, prefetch.target_nodes, nodes[0].message),
        names,
        failure,
    )


def _stale(node: NodeStaging, failure: StagingFailure, since: datetime | None) -> bool:
    """The failure is from before ``since``: its attempt began earlier, or the node is
    Staging again and keeps the failure of a row of attempts that began earlier (the
    attempt that failed is unknown, the one running began after: not its word)."""
    if since is None:
        return False
    if node.started_at is not None and node.started_at < since:
        return True
    return node.state == "Staging" and failure.since is not None and failure.since < since


def _describe(
    failure: StagingFailure, nodes: tuple[str, ...], targets: int, detail: str | None
) -> str:
    where = f"on {len(nodes)} of {targets} nodes ({_names(nodes)})"
    if failure.reason == "OriginMismatch":
        return (
            f"origin bytes of {failure.file} chunk {failure.chunk} (offset {failure.offset}) "
            f"do not match the manifest {where}: the weights changed after the manifest was "
            f"written; {REMEDY}"
        )
    what = {
        "ManifestInvalid": "the manifest at the source is invalid",
        "ManifestChanged": "the manifest at the source is not the one the rollout recorded",
    }.get(failure.reason, failure.reason)
    said = f": {_clip(detail)}" if detail else ""
    return f"{what} {where}{said}; {REMEDY}"


def parse_failure(raw: object) -> StagingFailure | None:
    """A WeightCache entry's raw failure; None when absent or not the CRD's shape (an
    agent of another version)."""
    if not isinstance(raw, dict):
        return None
    try:
        return StagingFailure.model_validate(raw)
    except ValueError:
        return None


def failed_nodes(prefetch: PrefetchObservation | None) -> str:
    """A short account of the target nodes whose last stage failed, for the Prefetched
    condition's message ("" when none):
    ``failed on 1: node-3: DiskFull (needs 6291456 B, 0 B available)``."""
    if prefetch is None:
        return ""
    failing = [(n, f) for n in prefetch.nodes if (f := _failing(n)) is not None]
    if not failing:
        return ""
    shown = [f"{n.name}: {failure_summary(f)}" for n, f in failing[:MAX_NAMED_NODES]]
    more = len(failing) - len(shown)
    return f"failed on {len(failing)}: " + "; ".join(shown) + (f"; +{more} more" if more else "")


def failure_summary(f: StagingFailure) -> str:
    """One node's failure in a few words (the condition's message, `weightship status`)."""
    if f.reason == "DiskFull" and f.bytes_needed is not None:
        return f"DiskFull (needs {f.bytes_needed} B, {f.bytes_available or 0} B available)"
    if f.reason == "OriginMismatch":
        return f"OriginMismatch ({f.file} chunk {f.chunk})"
    return f.reason


def _names(nodes: tuple[str, ...]) -> str:
    shown = ", ".join(nodes[:MAX_NAMED_NODES])
    more = len(nodes) - MAX_NAMED_NODES
    return shown + (f" and {more} more" if more > 0 else "")


def _clip(text: str) -> str:
    return text if len(text) <= MAX_DETAIL else text[: MAX_DETAIL - 1] + "…"
