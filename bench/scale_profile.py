"""Where a fleet's revision change spends its time, for bench_scale.py.

- `Timeline` watches one namespace's ModelRollouts, ReplicaSets and pods and stamps each
  event with the bench's own clock, so each rollout's path from the spec change to Healthy
  can be cut into hops, each the work of one component:
  spec patched -> canary ReplicaSet created (the operator) -> its first pod created (the
  controller manager) -> bound (the scheduler) -> Ready (KWOK, which also sets the
  readiness gate's condition on KWOK pods) -> canary scaled to full (the operator) ->
  all canary pods Ready (controller manager, scheduler, KWOK) -> Healthy (the operator).
- `CpuMeter` reads the CPU seconds each cluster daemon and the operator used over a phase
  (/proc/<pid>/stat), so a saturated component shows as about 100 % of a core.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes import client, watch

from weightship.api.names import GROUP, REVISION_LABEL, ROLLOUT_LABEL, ROLLOUT_PLURAL, VERSION

DAEMONS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")
HOPS = (
    ("rs", "canary ReplicaSet created", "operator"),
    ("pod", "its first pod created", "controller manager"),
    ("bound", "first pod bound", "scheduler"),
    ("ready", "first pod Ready", "KWOK"),
    ("full", "canary scaled to full", "operator"),
    ("all_ready", "all canary pods Ready", "cm + scheduler + KWOK"),
    ("healthy", "Healthy on the new revision", "operator"),
)


@dataclass
class Event:
    at: float
    kind: str  # Pod, ReplicaSet, ModelRollout
    type: str  # ADDED, MODIFIED, DELETED
    rollout: str
    name: str
    revision: str | None = None
    replicas: int | None = None  # ReplicaSet spec
    ready_replicas: int | None = None  # ReplicaSet status
    node: str | None = None  # Pod
    ready: bool = False  # Pod Ready / rollout Healthy
    stable: str | None = None  # ModelRollout stableRevision.revision


def _is_true(conditions: list[dict[str, Any]] | None, ctype: str) -> bool:
    return any(c.get("type") == ctype and c.get("status") == "True" for c in conditions or [])


def _event(kind: str, etype: str, obj: dict[str, Any]) -> Event | None:
    meta = obj.get("metadata") or {}
    labels = meta.get("labels") or {}
    at = time.monotonic()
    if kind == "ModelRollout":
        status = obj.get("status") or {}
        return Event(
            at,
            kind,
            etype,
            meta.get("name", ""),
            meta.get("name", ""),
            ready=status.get("phase") == "Healthy"
            and status.get("observedGeneration") == meta.get("generation"),
            stable=(status.get("stableRevision") or {}).get("revision"),
        )
    rollout = labels.get(ROLLOUT_LABEL)
    if not rollout:
        return None
    spec, status = obj.get("spec") or {}, obj.get("status") or {}
    if kind == "ReplicaSet":
        return Event(
            at,
            kind,
            etype,
            rollout,
            meta.get("name", ""),
            revision=labels.get(REVISION_LABEL),
            replicas=spec.get("replicas"),
            ready_replicas=status.get("readyReplicas") or 0,
        )
    return Event(
        at,
        kind,
        etype,
        rollout,
        meta.get("name", ""),
        revision=labels.get(REVISION_LABEL),
        node=spec.get("nodeName"),
        ready=_is_true(status.get("conditions"), "Ready") and not meta.get("deletionTimestamp"),
    )


@dataclass
class Timeline:
    api: client.ApiClient
    namespace: str
    events: list[Event] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _watches: list[watch.Watch] = field(default_factory=list)

    def __enter__(self) -> Timeline:
        core, apps = client.CoreV1Api(self.api), client.AppsV1Api(self.api)
        custom = client.CustomObjectsApi(self.api)
        sources: list[tuple[str, Callable[..., Any], tuple[Any, ...]]] = [
            ("Pod", core.list_namespaced_pod, (self.namespace,)),
            ("ReplicaSet", apps.list_namespaced_replica_set, (self.namespace,)),
            (
                "ModelRollout",
                custom.list_namespaced_custom_object,
                (GROUP, VERSION, self.namespace, ROLLOUT_PLURAL),
            ),
        ]
        for kind, fn, args in sources:
            w = watch.Watch()
            self._watches.append(w)
            thread = threading.Thread(target=self._run, args=(w, kind, fn, args), daemon=True)
            self._threads.append(thread)
            thread.start()
        return self

    def _run(
        self, w: watch.Watch, kind: str, fn: Callable[..., Any], args: tuple[Any, ...]
    ) -> None:
        while not self._stop.is_set():
            with suppress(Exception):
                for raw in w.stream(fn, *args, timeout_seconds=60, _preload_content=False):
                    if self._stop.is_set():
                        return
                    obj = raw["raw_object"]
                    event = _event(kind, raw["type"], obj)
                    if event is not None:
                        with self._lock:
                            self.events.append(event)

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        for w in self._watches:
            w.stop()

    def since(self, t0: float) -> list[Event]:
        with self._lock:
            return [e for e in self.events if e.at >= t0]

    def milestones(
        self, changed_at: dict[str, float], revision: str, replicas: int
    ) -> dict[str, dict[str, float]]:
        """Seconds from each rollout's spec change to each hop's end (the hops it reached)."""
        t0 = min(changed_at.values(), default=time.monotonic())
        by_rollout: dict[str, list[Event]] = {}
        for e in self.since(t0):
            by_rollout.setdefault(e.rollout, []).append(e)
        return {
            name: rollout_marks(
                [e for e in by_rollout.get(name, []) if e.at >= start], start, revision, replicas
            )
            for name, start in changed_at.items()
        }


def rollout_marks(
    events: list[Event], start: float, revision: str, replicas: int
) -> dict[str, float]:
    """One rollout's hops (see HOPS) from its events after its spec change at `start`."""
    canary = next(
        (e.revision for e in events if e.kind == "ReplicaSet" and e.type == "ADDED"), None
    )
    tests: dict[str, Callable[[Event], bool]] = {
        "rs": lambda e: e.kind == "ReplicaSet" and e.revision == canary,
        "pod": lambda e: e.kind == "Pod" and e.revision == canary,
        "bound": lambda e: e.kind == "Pod" and e.revision == canary and bool(e.node),
        "ready": lambda e: e.kind == "Pod" and e.revision == canary and e.ready,
        "full": lambda e: (
            e.kind == "ReplicaSet" and e.revision == canary and (e.replicas or 0) >= replicas
        ),
        "all_ready": lambda e: (
            e.kind == "ReplicaSet" and e.revision == canary and (e.ready_replicas or 0) >= replicas
        ),
        "healthy": lambda e: e.kind == "ModelRollout" and e.ready and e.stable == revision,
    }
    marks = {}
    for key, test in tests.items():
        hit = next((e for e in events if test(e)), None)
        if hit is not None:
            marks[key] = hit.at - start
    return marks


def hop_table(marks: dict[str, dict[str, float]]) -> list[list[str]]:
    """Per hop: median and slowest time spent in it (from the previous hop's end), and the
    median time at which it ended, over the rollouts that reached it."""
    rows = []
    previous: str | None = None
    for key, what, who in HOPS:
        spans, ends = [], []
        for m in marks.values():
            if key not in m:
                continue
            ends.append(m[key])
            before = m.get(previous, 0.0) if previous else 0.0
            # 0 when it came first (the operator saw the pods Ready before the
            # ReplicaSet's status said so).
            spans.append(max(0.0, m[key] - before))
        previous = key
        if not spans:
            rows.append([what, who, "0", "-", "-", "-"])
            continue
        spans.sort()
        ends.sort()
        rows.append(
            [
                what,
                who,
                str(len(spans)),
                f"{spans[len(spans) // 2]:.2f} s",
                f"{spans[-1]:.2f} s",
                f"{ends[len(ends) // 2]:.2f} s",
            ]
        )
    return rows


HOP_HEADER = ["hop ends when", "whose work", "rollouts", "median hop", "slowest hop", "median at"]


# ---- CPU by component -----------------------------------------------------------------
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime + stime


class CpuMeter:
    """CPU seconds of named processes between two reads."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids

    @classmethod
    def for_cluster(cls, pid_dir: Path, extra: dict[str, int]) -> CpuMeter:
        pids = dict(extra)
        for name in DAEMONS:
            with suppress(OSError, ValueError):
                pids[name] = int((pid_dir / f"{name}.pid").read_text().strip())
        return cls(pids)

    def read(self) -> dict[str, float]:
        return {n: s for n, pid in self.pids.items() if (s := cpu_seconds(pid)) is not None}

    @staticmethod
    def shares(
        before: dict[str, float], after: dict[str, float], wall_s: float
    ) -> dict[str, float]:
        """Share of one core each used (1.0: a whole core)."""
        if wall_s <= 0:
            return {}
        return {n: (after[n] - before.get(n, after[n])) / wall_s for n in after}


def machine_busy() -> Iterator[float]:
    """Whole-machine CPU busy share since the previous next() (from /proc/stat)."""

    def read() -> tuple[int, int]:
        parts = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        idle = parts[3] + parts[4]
        return sum(parts) - idle, sum(parts)

    busy, total = read()
    while True:
        b, t = read()
        yield (b - busy) / (t - total) if t > total else 0.0
        busy, total = b, t
