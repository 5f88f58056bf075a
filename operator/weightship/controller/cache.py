"""Watch-fed reads for the reconcile workers: no LIST and no GET in a steady state.

kopf keeps in-memory indexes (`@kopf.index` in handlers.py) filled from its watches: the
ModelRollouts by namespace/name, their ReplicaSets and pods by rollout. The kinds a fleet
has thousands of, node labels by node and WeightCache entries by manifest digest, come
from two `informer.Informer`s (why not kopf there: informer.py). The functions `index_*`
below make the values they hold (trimmed to what the reconcile reads, so 5,000 nodes
cost a few MB).

Workers run in threads; kopf mutates its indexes on the event loop. `ClusterView` reads
them on the loop (one short callback per read), so a read is an atomic snapshot; the
informers have their own lock.

A watch delivers the operator's own writes a little later than the write returns. The
`WriteOverlay` bridges that: each write's answer is kept and used instead of the cached
object while the cache shows a version older than it: the one the write was made against,
or one of this operator's own earlier writes of it (two writes in a row, and the watch
brings the first: the second still stands), or for a create, until the cache has the
object at all. So the reconcile after a write never acts on the state before it: it does
not create a ReplicaSet twice, nor re-decide a step from the status it has just replaced,
nor patch status against a resourceVersion it has already moved past (a 409 each time:
at 100 rollouts they were a third of the status patches).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import sys
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from weightship.api.names import ROLLOUT_LABEL
from weightship.kube.informer import Informer
from weightship.kube.selector import labels_match

T = TypeVar("T")
RolloutKey = tuple[str, str]  # (namespace, name)
ObjectKey = tuple[str, str]  # (kind, name) within one rollout's namespace

OVERLAY_MAX_AGE_S = 120.0  # a write the watch never confirmed stops masking the cache
LOOP_READ_TIMEOUT_S = 30.0


# ---- what the indexes hold (pure) -----------------------------------------------------
def _meta(body: Mapping[str, Any], *keys: str) -> dict[str, Any]:
    meta = body.get("metadata") or {}
    return {k: copy.deepcopy(meta[k]) for k in keys if meta.get(k) is not None}


def index_rollout(body: Mapping[str, Any]) -> dict[str, Any]:
    return copy.deepcopy(dict(body))


def index_replicaset(body: Mapping[str, Any]) -> dict[str, Any]:
    spec = body.get("spec") or {}
    return {
        "metadata": _meta(body, "name", "namespace", "uid", "labels", "resourceVersion"),
        "spec": {"replicas": spec.get("replicas")},
        "status": copy.deepcopy(dict(body.get("status") or {})),
    }


def index_pod(body: Mapping[str, Any]) -> dict[str, Any]:
    """What observe, the seeding rendezvous, the gate opener and the verifier read."""
    spec = body.get("spec") or {}
    status = body.get("status") or {}
    return {
        "metadata": _meta(
            body,
            "name",
            "namespace",
            "uid",
            "labels",
            "annotations",
            "creationTimestamp",
            "deletionTimestamp",
            "resourceVersion",
        ),
        "spec": {
            "nodeName": spec.get("nodeName"),
            # command/args and the node-cache mount: the verifier's checksumMode staged.
            "containers": [
                {
                    "name": c.get("name"),
                    "command": list(c.get("command") or []),
                    "args": list(c.get("args") or []),
                    "volumeMounts": [
                        {"name": m.get("name"), "readOnly": bool(m.get("readOnly"))}
                        for m in c.get("volumeMounts") or []
                    ],
                }
                for c in spec.get("containers") or []
            ],
        },
        "status": {
            "phase": status.get("phase"),
            "podIP": status.get("podIP"),
            "conditions": copy.deepcopy(status.get("conditions") or []),
            "containerStatuses": [
                {
                    "name": c.get("name"),
                    "restartCount": c.get("restartCount", 0),
                    # A server that exited refusing its weights says why here (vLLM).
                    "state": _terminated_message(c.get("state")),
                    "lastState": _terminated_message(c.get("lastState")),
                }
                for c in status.get("containerStatuses") or []
            ],
        },
    }


def _terminated_message(state: Mapping[str, Any] | None) -> dict[str, Any]:
    message = ((state or {}).get("terminated") or {}).get("message")
    return {"terminated": {"message": str(message)[:4096]}} if message else {}


def index_node_labels(body: Mapping[str, Any]) -> dict[Hashable, Any]:
    """A node's labels, the strings interned: 5,000 nodes share a handful of label keys
    and mostly the same values, so each node costs its dict and little else."""
    meta = body.get("metadata") or {}
    labels = meta.get("labels") or {}
    return {meta["name"]: {sys.intern(str(k)): sys.intern(str(v)) for k, v in labels.items()}}


def index_cache_entries(body: Mapping[str, Any]) -> dict[Hashable, Any]:
    """One WeightCache's manifest entries by digest, each with its node: the one it is
    named after (the admission policy lets an agent write only that one). One whose
    spec.nodeName names another node is a claim about a node it is not, and is left out,
    as snapshot.prefetch_observation and the agents' readers leave it out."""
    node = (body.get("metadata") or {})["name"]
    if (body.get("spec") or {}).get("nodeName") not in (None, node):
        return {}
    out: dict[Hashable, Any] = {}
    for entry in (body.get("status") or {}).get("manifests") or []:
        digest = entry.get("digest")
        if digest:
            out[digest] = {"node": node, **copy.deepcopy(dict(entry))}
    return out


def caches_for(entries: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Index entries back into the WeightCache shape snapshot.prefetch_observation reads."""
    return [
        {
            "metadata": {"name": e["node"]},
            "spec": {"nodeName": e["node"]},
            "status": {"manifests": [{k: v for k, v in e.items() if k != "node"}]},
        }
        for e in entries
    ]


def rollout_key_of(body: Mapping[str, Any]) -> RolloutKey | None:
    meta = body.get("metadata") or {}
    rollout = (meta.get("labels") or {}).get(ROLLOUT_LABEL)
    namespace = meta.get("namespace")
    return (namespace, rollout) if namespace and rollout else None


# ---- read-your-writes -----------------------------------------------------------------
@dataclass
class _Written:
    body: dict[str, Any]
    at: float
    passed: frozenset[str]  # versions older than body: made against, or our own earlier
    created: bool  # the cache has not had the object yet


@dataclass
class WriteOverlay:
    """The operator's own writes, until the watch has delivered them (see the module doc)."""

    max_age_s: float = OVERLAY_MAX_AGE_S
    clock: Callable[[], float] = time.monotonic
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _seen: dict[RolloutKey, dict[ObjectKey, str]] = field(default_factory=dict)
    _written: dict[RolloutKey, dict[ObjectKey, _Written]] = field(default_factory=dict)

    def merge(
        self, owner: RolloutKey, kind: str, cached: list[dict[str, Any]]
    ) -> list[dict[str, Any]]:
        """`cached` objects of one kind of `owner`, with this operator's newer writes."""
        now = self.clock()
        with self._lock:
            written = self._written.get(owner, {})
            seen = self._seen.setdefault(owner, {})
            for key in [k for k in seen if k[0] == kind]:
                del seen[key]
            out = []
            present = set()
            for body in cached:
                key = (kind, body["metadata"]["name"])
                present.add(key)
                version = body["metadata"].get("resourceVersion")
                if version is not None:
                    seen[key] = version
                mine = written.get(key)
                if mine is not None:
                    if version in mine.passed and now - mine.at < self.max_age_s:
                        out.append(mine.body)
                        continue
                    del written[key]
                out.append(body)
            for key, mine in list(written.items()):
                if key[0] != kind or key in present:
                    continue
                if mine.created and now - mine.at < self.max_age_s:
                    out.append(mine.body)  # created; the watch has not brought it yet
                else:
                    del written[key]  # deleted since
            return out

    def record(self, owner: RolloutKey, kind: str, body: dict[str, Any]) -> None:
        key = (kind, body["metadata"]["name"])
        now = self.clock()
        with self._lock:
            seen_version = self._seen.get(owner, {}).get(key)
            passed = {seen_version} if seen_version is not None else set()
            created = seen_version is None
            previous = self._written.get(owner, {}).get(key)
            if previous is not None and now - previous.at < self.max_age_s:
                passed |= previous.passed
                if (version := previous.body["metadata"].get("resourceVersion")) is not None:
                    passed.add(version)
                created = created and previous.created
            self._written.setdefault(owner, {})[key] = _Written(
                body, now, frozenset(passed), created
            )

    def forget(self, owner: RolloutKey) -> None:
        with self._lock:
            self._seen.pop(owner, None)
            self._written.pop(owner, None)


# ---- snapshots for one reconcile ------------------------------------------------------
@dataclass(frozen=True)
class RolloutObjects:
    """The rollout and what it owns, as one reconcile sees them."""

    rollout: dict[str, Any]
    replica_sets: list[dict[str, Any]]
    pods: list[dict[str, Any]]


@dataclass(frozen=True)
class Staging:
    """Prefetch inputs: the nodes a rollout targets and their WeightCache entries. Empty
    and not `synced` until both informers have their first listing."""

    target_nodes: list[str]
    caches: list[dict[str, Any]]
    node_labels: dict[str, dict[str, str]]
    synced: bool = True


Index = Mapping[Any, Iterable[Any]]


class ClusterView:
    """Reads for worker threads: of kopf's indexes (`indexes` maps index names, the handler
    ids in handlers.py, to kopf.Index objects, or plain mappings of lists in tests) and of
    the node and WeightCache informers."""

    def __init__(
        self,
        indexes: Mapping[str, Index],
        nodes: Informer,
        caches: Informer,
        loop: asyncio.AbstractEventLoop | None = None,
        overlay: WriteOverlay | None = None,
    ) -> None:
        self.indexes = indexes
        self.nodes = nodes
        self.caches = caches
        self.loop = loop
        self.overlay = overlay or WriteOverlay()
        self._labels_lock = threading.Lock()
        self._labels: dict[str, dict[str, str]] = {}  # nodes the last Staging read

    def _on_loop(self, fn: Callable[[], T]) -> T:
        loop = self.loop
        if loop is None:
            return fn()
        future: concurrent.futures.Future[T] = concurrent.futures.Future()

        def run() -> None:
            try:
                future.set_result(fn())
            except BaseException as e:
                future.set_exception(e)

        loop.call_soon_threadsafe(run)
        return future.result(LOOP_READ_TIMEOUT_S)

    def _values(self, index: str, key: Any) -> list[Any]:
        store = self.indexes[index].get(key)
        return list(store) if store is not None else []

    def rollout_objects(self, namespace: str, name: str) -> RolloutObjects | None:
        key = (namespace, name)

        def read() -> tuple[list[Any], list[Any], list[Any]]:
            return (
                self._values("rollouts", key),
                self._values("rollout_replicasets", key),
                self._values("rollout_pods", key),
            )

        rollouts, replica_sets, pods = self._on_loop(read)
        if not rollouts:
            self.overlay.forget(key)
            return None
        rollout = self.overlay.merge(key, "ModelRollout", rollouts[:1])[0]
        return RolloutObjects(
            rollout=rollout,
            replica_sets=self.overlay.merge(key, "ReplicaSet", replica_sets),
            pods=self.overlay.merge(key, "Pod", pods),
        )

    def staging(self, selector: Mapping[str, str], digest: str) -> Staging:
        if not (self.nodes.synced.is_set() and self.caches.synced.is_set()):
            return Staging([], [], {}, synced=False)
        labels = {
            str(name): dict(values[0])
            for name, values in self.nodes.items()
            if values and labels_match(selector, values[0])
        }
        staging = Staging(
            target_nodes=sorted(labels),
            caches=caches_for(self.caches.values(digest)),
            node_labels=labels,
        )
        with self._labels_lock:
            self._labels.update(staging.node_labels)
        return staging

    def node_has_label(self, node: str, label: str, value: str) -> bool:
        """From the labels the last Staging read (the nodes apply may label)."""
        with self._labels_lock:
            return self._labels.get(node, {}).get(label) == value

    def noted_node_label(self, node: str, label: str, value: str | None) -> None:
        with self._labels_lock:
            labels = self._labels.setdefault(node, {})
            if value is None:
                labels.pop(label, None)
            else:
                labels[label] = value

    def record_write(self, kind: str, body: dict[str, Any]) -> None:
        """Called by Kube with the API server's answer to a write."""
        meta = body.get("metadata") or {}
        owner = rollout_key_of(body)
        if kind == "ModelRollout":
            namespace, name = meta.get("namespace"), meta.get("name")
            owner = (namespace, name) if namespace and name else None
        if owner is None:
            return
        trimmed = {"ReplicaSet": index_replicaset, "Pod": index_pod}.get(kind, index_rollout)(body)
        self.overlay.record(owner, kind, trimmed)
