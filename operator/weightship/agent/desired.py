"""Which manifests this node wants, given the rollouts and the node's labels. Pure.

A rollout targets this node when its prefetch is enabled and its staging selector matches
the node's labels (`staging_selector`: the one the operator resolved and counts; an empty
selector matches every node). It wants three digests: the canary's (to stage before the
canary starts), the stable's and the retiring revision's (pins, so a rollback needs no
download).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal
from typing import Any, Literal

from weightship.data.viewlayout import UID_PATTERN
from weightship.kube.quantity import quantity_value
from weightship.kube.rfc3339 import time_or_none
from weightship.kube.selector import labels_match
from weightship.weightformat.cachedir import MANIFEST_DIGEST

Role = Literal["canary", "stable", "retiring"]
ROLE_ORDER: dict[Role, int] = {"canary": 0, "stable": 1, "retiring": 2}


@dataclass(frozen=True)
class ModelSource:
    """Where a rollout's current weights live (spec.model.source)."""

    namespace: str
    uri: str
    endpoint: str | None = None
    region: str | None = None
    # No credentialsSecretRef: agents read S3 with their install-time credential only.


@dataclass(frozen=True)
class Wanted:
    """One digest this node should stage (and pin), with everything needed to fetch it."""

    digest: str
    role: Role  # the most urgent role any rollout gives it
    pinned_by: tuple[str, ...]  # namespace/name, sorted
    sources: tuple[ModelSource, ...]  # spec sources of the wanting rollouts, canary first
    peer_to_peer: bool  # False when any wanting rollout turned it off
    bandwidth_limit: int | None  # bytes/s, the lowest cap of the wanting rollouts
    # The latest status.stepStartTime of the rollouts whose canary it is: a new one while
    # it is not staged means a prefetch began again (`weightship retry`): back-off restarts.
    attempt: str = ""


@dataclass
class _Acc:
    roles: set[Role] = field(default_factory=set)
    pins: set[str] = field(default_factory=set)
    sources: list[tuple[int, str, ModelSource]] = field(default_factory=list)
    p2p: bool = True
    limit: int | None = None
    attempt: str = ""


def bandwidth_limit(value: object) -> int | None:
    """spec.prefetch.bandwidthLimit (a Kubernetes quantity: "100Mi", 1048576) as whole
    bytes per second; None when unset. ValueError when it is not a quantity or negative."""
    if value is None or value == "":
        return None
    if not isinstance(value, int | str):
        raise ValueError(f"not a quantity: {value!r}")
    amount = quantity_value(value)
    if amount < 0:
        raise ValueError(f"negative quantity: {value!r}")
    return int(min(amount, Decimal(2**63 - 1)))


def staging_selector(rollout: Mapping[str, Any]) -> Mapping[str, str]:
    """The nodes a rollout stages onto: status.prefetchNodeSelector, which the operator
    resolves from spec.prefetch.nodeSelector or the pod template's (a workloadRef's
    Deployment, which agents may not read) and counts for minStagedPercent. Without it (an
    operator from before, or none resolved: every node) spec.prefetch.nodeSelector, which
    is then what the operator counts."""
    resolved = (rollout.get("status") or {}).get("prefetchNodeSelector")
    if isinstance(resolved, Mapping) and resolved:
        return resolved
    prefetch = (rollout.get("spec") or {}).get("prefetch") or {}
    selector = prefetch.get("nodeSelector")
    return selector if isinstance(selector, Mapping) else {}


def namespace_allowed(namespace: str, patterns: Collection[str]) -> bool:
    return not patterns or any(fnmatch.fnmatchcase(namespace, p) for p in patterns)


def rollout_digests(rollout: Mapping[str, Any]) -> list[tuple[Role, str]]:
    """(role, digest) for the canary, stable and retiring revisions that have a digest."""
    status = rollout.get("status") or {}
    out: list[tuple[Role, str]] = []
    for role, key in (
        ("canary", "canaryRevision"),
        ("stable", "stableRevision"),
        ("retiring", "retiring"),
    ):
        digest = (status.get(key) or {}).get("manifestDigest")
        if isinstance(digest, str) and digest.startswith("sha256:"):
            out.append((role, digest))  # type: ignore[arg-type]
    return out


def wanted(
    rollouts: Iterable[Mapping[str, Any]],
    node_labels: Mapping[str, str],
    namespaces: Collection[str] = (),
) -> list[Wanted]:
    """Every digest this node wants, most urgent first (canary, then stable, retiring).

    Rollouts being deleted, or with prefetch disabled, or not selecting this node, want
    nothing. A malformed bandwidth limit is ignored (the apiserver validates it).
    """
    acc: dict[str, _Acc] = {}
    for r in rollouts:
        meta = r.get("metadata") or {}
        namespace, name = meta.get("namespace") or "default", meta.get("name") or ""
        if meta.get("deletionTimestamp") or not namespace_allowed(namespace, namespaces):
            continue
        spec = r.get("spec") or {}
        prefetch = spec.get("prefetch") or {}
        if not prefetch.get("enabled", True):
            continue
        if not labels_match(staging_selector(r), node_labels):
            continue
        source = _source(namespace, spec)
        try:
            limit = bandwidth_limit(prefetch.get("bandwidthLimit"))
        except ValueError:
            limit = None
        for role, digest in rollout_digests(r):
            a = acc.setdefault(digest, _Acc())
            a.roles.add(role)
            a.pins.add(f"{namespace}/{name}")
            if source is not None:
                a.sources.append((ROLE_ORDER[role], f"{namespace}/{name}", source))
            a.p2p = a.p2p and bool(prefetch.get("peerToPeer", True))
            started = (r.get("status") or {}).get("stepStartTime")
            if role == "canary" and isinstance(started, str):
                a.attempt = max(a.attempt, started[:64])  # RFC 3339 UTC sorts as time
            if limit:
                a.limit = limit if a.limit is None else min(a.limit, limit)
    out = []
    for digest, a in acc.items():
        sources: list[ModelSource] = []
        for _, _, s in sorted(a.sources, key=lambda t: (t[0], t[1])):
            if s not in sources:
                sources.append(s)
        out.append(
            Wanted(
                digest=digest,
                role=min(a.roles, key=ROLE_ORDER.__getitem__),
                pinned_by=tuple(sorted(a.pins)),
                sources=tuple(sources),
                peer_to_peer=a.p2p,
                bandwidth_limit=a.limit,
                attempt=a.attempt,
            )
        )
    return sorted(out, key=lambda w: (ROLE_ORDER[w.role], w.pinned_by, w.digest))


@dataclass(frozen=True)
class ViewPins:
    """The per-rollout views this node should hold (weightship.data.views)."""

    pins: dict[str, frozenset[str]]  # rollout uid -> digests it pins on this node
    refused: tuple[str, ...] = ()  # namespace/name of rollouts whose uid is not a UUID


def in_place(rollout: Mapping[str, Any]) -> bool:
    """spec.strategy.canary.updatePolicy is InPlaceIfPossible."""
    canary = ((rollout.get("spec") or {}).get("strategy") or {}).get("canary") or {}
    return canary.get("updatePolicy") == "InPlaceIfPossible"


def view_pins(
    rollouts: Iterable[Mapping[str, Any]],
    node_labels: Mapping[str, str],
    namespaces: Collection[str] = (),
    existing: Collection[str] = (),
) -> ViewPins:
    """Which rollouts get a view on this node, and the digests each one shows once staged:
    exactly what the rollout pins here (canary, stable, retiring), the pins `wanted` counts.

    A rollout with updatePolicy InPlaceIfPossible gets one; so does one that already has
    a view (``existing``: uids with a view on disk), so that switching the policy back
    to Recreate does not pull the view from under pods created with it (the policy is
    not part of the revision hash: they keep running). A rollout that wants nothing
    here (deleted, prefetch off, not selecting this node, namespace not watched) gets
    none, and its view goes. Its uid must be a UUID: it becomes a path element.
    """
    pins: dict[str, frozenset[str]] = {}
    refused: list[str] = []
    for r in rollouts:
        meta = r.get("metadata") or {}
        namespace, name = meta.get("namespace") or "default", meta.get("name") or ""
        uid = meta.get("uid")
        if not in_place(r) and uid not in existing:
            continue
        if meta.get("deletionTimestamp") or not namespace_allowed(namespace, namespaces):
            continue
        prefetch = (r.get("spec") or {}).get("prefetch") or {}
        if not prefetch.get("enabled", True):
            continue
        if not labels_match(staging_selector(r), node_labels):
            continue
        if not isinstance(uid, str) or not UID_PATTERN.fullmatch(uid):
            refused.append(f"{namespace}/{name}")
            continue
        pins[uid] = frozenset(d for _, d in rollout_digests(r) if MANIFEST_DIGEST.fullmatch(d))
    return ViewPins(pins, tuple(sorted(refused)))


def next_to_stage(
    wants: Iterable[Wanted],
    staged: Collection[str],
    retry_at: Mapping[str, float],
    now: float,
) -> Wanted | None:
    """The most urgent wanted digest not staged yet and not waiting out a failure."""
    for w in wants:
        if w.digest not in staged and retry_at.get(w.digest, 0.0) <= now:
            return w
    return None


def restarted(wants: Iterable[Wanted], seen: dict[str, str]) -> set[str]:
    """Digests whose canary prefetch began again since the last call (a rollout's retry
    after a failed stage): their back-off restarts, so the retry is tried at once rather
    than after up to 5 minutes. ``seen`` (digest -> attempt) is updated, and keeps only
    the wanted digests."""
    now = {w.digest: w.attempt for w in wants}
    out = {d for d, a in now.items() if a and seen.get(d, a) != a}
    seen.clear()
    seen.update(now)
    return out


def retry_delay_s(failures: int, base_s: float = 5.0, cap_s: float = 300.0) -> float:
    """Back-off after ``failures`` consecutive failed attempts: 5 s doubling to 5 min."""
    return float(min(cap_s, base_s * 2.0 ** max(0, failures - 1)))


def _source(namespace: str, spec: Mapping[str, Any]) -> ModelSource | None:
    src = (spec.get("model") or {}).get("source") or {}
    uri = src.get("uri")
    if not isinstance(uri, str) or not uri:
        return None
    return ModelSource(
        namespace=namespace,
        uri=uri,
        endpoint=src.get("endpoint"),
        region=src.get("region"),
    )


def cache_node(cache: Mapping[str, Any]) -> str | None:
    """The node a WeightCache speaks for: the one it is named after (the admission policy
    lets an agent write only that one). One whose spec.nodeName names another node is
    someone's claim about a node it is not, and speaks for none."""
    name = (cache.get("metadata") or {}).get("name")
    claimed = (cache.get("spec") or {}).get("nodeName")
    if not name or claimed not in (None, name):
        return None
    return str(name)


def live_peers(
    caches: Iterable[Mapping[str, Any]], self_node: str, now: datetime, max_age_s: float
) -> list[tuple[str, str]]:
    """(node, host:port) of the other agents that reported a peer endpoint recently.

    A cache whose agent has not written for ``max_age_s`` (several heartbeats) belongs to
    a dead or partitioned agent: asking it would only cost a timeout per chunk.
    """
    out = []
    for c in caches:
        node = cache_node(c)
        status = c.get("status") or {}
        endpoint = status.get("peerEndpoint")
        if not node or node == self_node or not endpoint:
            continue
        updated = time_or_none(status.get("updatedAt"))
        if updated is None or (now - updated).total_seconds() > max_age_s:
            continue
        out.append((str(node), str(endpoint)))
    return sorted(out)


def staged_on(caches: Iterable[Mapping[str, Any]], digest: str) -> set[str]:
    """The nodes whose cache reports ``digest`` as Staged: whole, verified copies."""
    out = set()
    for c in caches:
        node = cache_node(c)
        manifests = (c.get("status") or {}).get("manifests") or []
        if node and any(
            m.get("digest") == digest and m.get("state") == "Staged" for m in manifests
        ):
            out.add(str(node))
    return out
