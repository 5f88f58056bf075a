"""The WeightCache status this agent reports, and when to write it. Pure.

Write rate. A state change (Staging, Staged, Failed, Evicting, a new pin) is written at
once: the operator waits on it, and each node makes a handful per model. Byte progress
is written at most once per `progress_interval_s(nodes)`: 2 s on small clusters, and
slower on big ones so that all agents together stay under a write budget (default
100 writes/s: 5,000 nodes staging at once write progress every 50 s each, instead of
2,500 writes/s at a flat 2 s, which would swamp the API server and etcd). Without any
change the agent still writes a heartbeat (`updatedAt`, free space) every 60 s.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any, Literal

from weightship.api.weightcache import (
    MAX_CACHED_MANIFESTS,
    MAX_PINS,
    CachedManifest,
    StagingFailure,
    WeightCacheStatus,
)

State = Literal["Staging", "Staged", "Failed", "Evicting"]
MAX_ERROR = 1024
# Which entries survive when there are more than the CRD allows: live work first.
_KEEP_ORDER: dict[str, int] = {"Staging": 0, "Evicting": 1, "Failed": 2, "Staged": 3}


@dataclass(frozen=True)
class Entry:
    """One manifest in this node's cache, as reported in status.manifests[]."""

    digest: str
    state: State
    bytes_done: int = 0
    bytes_total: int = 0
    bytes_from_peers: int = 0
    bytes_from_origin: int = 0
    started_at: datetime | None = None
    completed_at: datetime | None = None
    last_error: str | None = None
    pinned_by: tuple[str, ...] = ()
    failure: StagingFailure | None = None  # why the last stage failed (kept while a retry runs)


@dataclass(frozen=True)
class DiskModel:
    """A model folder found in the cache: staged (marker present) or partial."""

    digest: str
    staged: bool
    bytes_total: int


@dataclass
class WriteClock:
    """When the status was last written and what is waiting to be written."""

    last_write: float = float("-inf")
    dirty: bool = False  # byte progress not yet written
    urgent: bool = False  # a state change not yet written


def progress_interval_s(
    nodes: int, *, min_interval_s: float = 2.0, cluster_budget_per_s: float = 100.0
) -> float:
    """Seconds between progress writes of one agent so that ``nodes`` agents together
    write at most ``cluster_budget_per_s`` times a second (never faster than the minimum)."""
    return max(min_interval_s, max(1, nodes) / cluster_budget_per_s)


def write_due(clock: WriteClock, now: float, interval_s: float, heartbeat_s: float) -> bool:
    """Write now? State changes at once, progress when the interval passed, else heartbeat."""
    elapsed = now - clock.last_write
    if clock.urgent:
        return True
    if clock.dirty and elapsed >= interval_s:
        return True
    return elapsed >= heartbeat_s


def mark_written(clock: WriteClock, now: float) -> None:
    clock.last_write, clock.dirty, clock.urgent = now, False, False


def reconcile(
    entries: Mapping[str, Entry],
    disk: Iterable[DiskModel],
    pins: Mapping[str, tuple[str, ...]],
    active: str | None,
    now: datetime,
) -> dict[str, Entry]:
    """Bring the entries in line with the disk and the current pins.

    - A staged model on disk is Staged (its counters and timestamps are kept).
    - A partial model on disk that is wanted is Staging (waiting for its turn or being
      staged); one that nobody wants any more is not reported (LRU eviction frees it).
    - A model gone from disk is dropped (evicted), unless it is being staged now, or it
      failed and is still wanted: the operator must see why.
    - pinnedBy is the set of rollouts wanting it now.
    """
    on_disk = {m.digest: m for m in disk}
    out: dict[str, Entry] = {}
    for digest in {*entries, *on_disk, *(pins if active is None else {*pins, active})}:
        e = entries.get(digest)
        m = on_disk.get(digest)
        pinned = tuple(sorted(pins.get(digest, ())))
        if m is not None and m.staged:
            base = e or Entry(digest, "Staged", m.bytes_total, m.bytes_total)
            if base.state != "Staged" and digest != active:
                base = replace(
                    base,
                    state="Staged",
                    bytes_done=m.bytes_total,
                    bytes_total=m.bytes_total,
                    completed_at=base.completed_at or now,
                    last_error=None,
                    failure=None,
                )
            out[digest] = replace(base, pinned_by=pinned)
        elif digest == active:
            out[digest] = replace(e or Entry(digest, "Staging", started_at=now), pinned_by=pinned)
        elif e is not None and e.state == "Failed" and pinned:
            out[digest] = replace(e, pinned_by=pinned)
        elif m is not None and pinned:
            waiting = e if e is not None and e.state == "Staging" else None
            out[digest] = replace(
                waiting or Entry(digest, "Staging", bytes_total=m.bytes_total), pinned_by=pinned
            )
        elif e is not None and e.state == "Evicting" and m is not None:
            out[digest] = replace(e, pinned_by=pinned)
    return out


def recover(previous: Mapping[str, Any] | None) -> dict[str, Entry]:
    """Entries from the WeightCache status a previous run of this agent wrote.

    Byte counters of an interrupted stage restart at zero: they count what the new
    attempt fetches, so a resumed stage shows only the bytes it still had to get.
    """
    out: dict[str, Entry] = {}
    for raw in (previous or {}).get("manifests") or []:
        try:
            m = CachedManifest.model_validate(raw)
        except ValueError:
            continue
        entry = Entry(
            digest=m.digest,
            state=m.state,
            bytes_done=m.bytes_done,
            bytes_total=m.bytes_total,
            bytes_from_peers=m.bytes_from_peers,
            bytes_from_origin=m.bytes_from_origin,
            started_at=m.started_at,
            completed_at=m.completed_at,
            last_error=m.last_error,
            pinned_by=tuple(m.pinned_by),
            failure=m.failure,
        )
        if entry.state in ("Staging", "Evicting"):
            entry = replace(entry, bytes_done=0, bytes_from_peers=0, bytes_from_origin=0)
        out[entry.digest] = entry
    return out


def build_status(
    *,
    peer_endpoint: str,
    capacity_bytes: int,
    free_bytes: int,
    entries: Iterable[Entry],
    now: datetime,
) -> dict[str, Any]:
    """The status body (camelCase, validated against the CRD's pydantic model).

    Within the CRD's bounds, so that the API server never refuses a write: at most
    MAX_CACHED_MANIFESTS entries, live work first (Staging, Evicting, Failed, then Staged;
    pinned before unpinned), and at most MAX_PINS rollouts per entry, the first by name;
    what is left out is counted (manifestsOmitted, pinnedByOmitted). Only the report is
    cut: pins and eviction follow the agent's own wants.
    """
    ranked = sorted(entries, key=lambda e: (_KEEP_ORDER[e.state], not e.pinned_by, e.digest))
    kept = ranked[:MAX_CACHED_MANIFESTS]
    status = WeightCacheStatus(
        peer_endpoint=peer_endpoint,
        capacity_bytes=max(0, capacity_bytes),
        free_bytes=max(0, free_bytes),
        staged_manifests=sum(e.state == "Staged" for e in kept),
        updated_at=now,
        manifests=[
            CachedManifest(
                digest=e.digest,
                state=e.state,
                bytes_done=e.bytes_done,
                bytes_total=e.bytes_total,
                bytes_from_peers=e.bytes_from_peers,
                bytes_from_origin=e.bytes_from_origin,
                started_at=e.started_at,
                completed_at=e.completed_at,
                last_error=clip(e.last_error),
                failure=e.failure,
                pinned_by=sorted(e.pinned_by)[:MAX_PINS],
                pinned_by_omitted=max(0, len(e.pinned_by) - MAX_PINS) or None,
            )
            for e in sorted(kept, key=lambda e: e.digest)
        ],
        manifests_omitted=len(ranked) - len(kept) or None,
    )
    # Written with a merge patch: the manifests list is replaced as a whole, so fields
    # left out of an entry (a cleared lastError) are gone from it.
    return status.to_k8s()


def clip(text: str | None, limit: int = MAX_ERROR) -> str | None:
    if text is None or len(text) <= limit:
        return text
    return text[: limit - 1] + "…"
