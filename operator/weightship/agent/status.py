"""The WeightCache status this agent reports, and when to write it. Pure.

Write rate. A state change (Staging, Staged, Failed, Evicting, a new pin) is written
after a random delay, uniform in [0, `state_write_window_s(nodes)`): one event (a new
rollout, a model staged by a whole swarm at once, the API server's return) changes the
state of every agent at the same moment, and 5,000 writes in a second would be 25 times
the API server's default of 200 mutating requests in flight. The window is sized so that
all agents together write at most `cluster_budget_per_s` (default 100/s) of them, capped
at `max_spread_s` (default 60 s): about 0.03 s on 3 nodes, 50 s on 5,000. Byte progress
is written at most once per `progress_interval_s(nodes)`: 10 s by default, slower on big
clusters under the same budget (5,000 nodes staging at once write progress every 50 s
each, instead of 2,500 writes/s at a flat 2 s). Without any change the agent still
writes a heartbeat (`updatedAt`, free space) every 60 s.
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
    urgent_at: float = float("-inf")  # when its turn comes (see state_write_delay_s)


def progress_interval_s(
    nodes: int, *, min_interval_s: float = 2.0, cluster_budget_per_s: float = 100.0
) -> float:
    """Seconds between progress writes of one agent so that ``nodes`` agents together
    write at most ``cluster_budget_per_s`` times a second (never faster than the minimum)."""
    return max(min_interval_s, max(1, nodes) / cluster_budget_per_s)


def state_write_window_s(
    nodes: int, *, cluster_budget_per_s: float = 100.0, max_spread_s: float = 60.0
) -> float:
    """Seconds over which ``nodes`` agents spread the state-change writes of one event, so
    that together they write at most ``cluster_budget_per_s`` a second; never longer than
    ``max_spread_s`` (past budget x max_spread_s nodes the rate grows instead)."""
    return min(max_spread_s, max(1, nodes) / cluster_budget_per_s)


def state_write_delay_s(
    nodes: int, draw: float, *, cluster_budget_per_s: float = 100.0, max_spread_s: float = 60.0
) -> float:
    """This agent's delay before writing a state change: ``draw`` (uniform in [0, 1), this
    agent's own) of the window, so the fleet's writes arrive evenly over it."""
    window = state_write_window_s(
        nodes, cluster_budget_per_s=cluster_budget_per_s, max_spread_s=max_spread_s
    )
    return min(max(draw, 0.0), 1.0) * window


def mark_urgent(clock: WriteClock, now: float, delay_s: float) -> None:
    """A state change to write ``delay_s`` from now; one already waiting keeps its turn
    (changes in the meantime go in the same write)."""
    if not clock.urgent:
        clock.urgent, clock.urgent_at = True, now + delay_s


def write_due(clock: WriteClock, now: float, interval_s: float, heartbeat_s: float) -> bool:
    """Write now? A state change at its turn, progress when the interval passed, else
    the heartbeat. Any write carries everything waiting."""
    elapsed = now - clock.last_write
    if clock.urgent and now >= clock.urgent_at:
        return True
    if clock.dirty and elapsed >= interval_s:
        return True
    return elapsed >= heartbeat_s


def mark_written(clock: WriteClock, now: float) -> None:
    clock.last_write, clock.dirty, clock.urgent = now, False, False


def report_wait_s(clock: WriteClock, now: float, poll_s: float) -> float:
    """How long the reporter may sleep: until a waiting state change's turn, at most
    ``poll_s``."""
    if clock.urgent:
        return max(0.0, min(poll_s, clock.urgent_at - now))
    return poll_s


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
