"""A list-then-watch cache of one resource kind, for the controller (nodes, WeightCaches:
kinds a fleet has thousands of) and the agent (ModelRollouts: it never polls them).

Why not `@kopf.index` in the controller: kopf gives every object its own worker task and,
until all indexes are filled, its own readiness toggle, and every toggle change wakes
every waiting worker. At 5,000 nodes and 5,000 WeightCaches that start-up is quadratic
(an operator under this bench spent over 5 minutes in `ToggleSet.make_toggle` without a
single reconcile) and each object costs a task. Here one thread lists, then watches,
parsing raw JSON and keeping only what `project` returns; it relists on 410 Gone or any
error. `synced` is set once the first listing is in, so the readers know the cache is
complete. `on_list` is called after every listing, `on_event` after every watch event
(the agent's hint to re-evaluate, the controller's to enqueue).

The listing is paged (`page_size` objects a request): a whole list of 5,000 nodes is
13 MB of JSON and ~50 MB parsed, and CPython keeps most of that heap after it is freed
(the projections kept are interleaved with it), so one unpaged list left the operator
~50 MB larger for good; pages of 500 leave it ~6 MB larger. `page_size=None` lists in one
request from the API server's watch cache (resourceVersion 0, which ignores `limit`):
what thousands of agents use, so that their relists do not reach etcd.

Objects are told apart by namespace and name, so one cache holds a namespaced kind too.

After a failure it relists after `relist_delay_s`: a random time in a window that doubles
with each failure in a row, from `retry_s` up to `max_retry_s`. Every watch of a fleet
breaks at the same moment when the API server goes, so fixed retries would stay in step
and 5,000 agents would relist within the same second of its return; with the window at
its 30 s cap they arrive spread over it (about 170 a second).
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import threading
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import Any

from kubernetes.watch.watch import iter_resp_lines

log = logging.getLogger(__name__)

Project = Callable[[dict[str, Any]], dict[Hashable, Any]]
ListFn = Callable[..., Any]  # a kubernetes-client list call, e.g. CoreV1Api.list_node


class Informer:
    def __init__(
        self,
        name: str,
        list_fn: ListFn,
        project: Project,
        *,
        on_event: Callable[[dict[str, Any]], object] | None = None,
        on_list: Callable[[], object] | None = None,
        watch_timeout_s: int = 300,
        retry_s: float = 1.0,
        max_retry_s: float = 30.0,
        page_size: int | None = 500,
        stop: threading.Event | None = None,
    ) -> None:
        self.name = name
        self.list_fn = list_fn
        self.project = project
        self.on_event = on_event
        self.on_list = on_list
        self.watch_timeout_s = watch_timeout_s
        self.retry_s = retry_s
        self.max_retry_s = max_retry_s
        self.page_size = page_size
        self.synced = threading.Event()
        self._lock = threading.Lock()
        self._by_object: dict[str, dict[Hashable, Any]] = {}  # object -> {key: value}
        self._index: dict[Hashable, dict[str, Any]] = {}  # key -> {object: value}
        self._stop = stop if stop is not None else threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"informer-{name}", daemon=True)
        self._response: Any = None

    # ---- reads ------------------------------------------------------------------------
    def values(self, key: Hashable) -> list[Any]:
        with self._lock:
            return list((self._index.get(key) or {}).values())

    def items(self) -> list[tuple[Hashable, list[Any]]]:
        with self._lock:
            return [(key, list(values.values())) for key, values in self._index.items()]

    def get(self, key: Hashable) -> Any | None:
        with self._lock:
            values = self._index.get(key)
            return next(iter(values.values()), None) if values else None

    def snapshot(self) -> list[Any]:
        """Every value kept, of every key."""
        with self._lock:
            return [value for values in self._index.values() for value in values.values()]

    # ---- upkeep -----------------------------------------------------------------------
    def put(self, obj: dict[str, Any]) -> None:
        name = _identity(obj)
        projected = self.project(obj)
        with self._lock:
            self._drop_locked(name)
            self._by_object[name] = projected
            for key, value in projected.items():
                self._index.setdefault(key, {})[name] = value

    def delete(self, obj: dict[str, Any]) -> None:
        with self._lock:
            self._drop_locked(_identity(obj))

    def replace_all(self, objects: Iterable[dict[str, Any]]) -> None:
        projected = {_identity(o): self.project(o) for o in objects}
        index: dict[Hashable, dict[str, Any]] = {}
        for name, values in projected.items():
            for key, value in values.items():
                index.setdefault(key, {})[name] = value
        with self._lock:
            self._by_object, self._index = projected, index

    def _drop_locked(self, name: str) -> None:
        for key in self._by_object.pop(name, {}):
            values = self._index.get(key)
            if values is not None:
                values.pop(name, None)
                if not values:
                    del self._index[key]

    # ---- the thread -------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        response = self._response
        if response is not None:
            # Shut the socket down: that ends the watch thread's blocked read at once.
            # close() would wait for it (the read holds the buffer's lock) until the
            # next event, tens of seconds on a quiet cluster. The watch may have closed
            # it meanwhile (its read ended): then there is nothing left to shut.
            with contextlib.suppress(OSError):
                response.shutdown()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                listed: list[Any] = []
                pages = self._pages(listed)
                self.replace_all(obj for page in pages for obj in page)
                self.synced.set()
                log.info("%s: %d objects listed", self.name, listed[0])
                failures = 0
                if self.on_list is not None:
                    self.on_list()
                self._watch(str(listed[1]))
            except Exception as e:  # the API server restarting, RBAC, network: relist
                if not self._stop.is_set():
                    failures += 1
                    delay = relist_delay_s(
                        failures,
                        random.random(),  # noqa: S311 (jitter, not a secret)
                        base_s=self.retry_s,
                        max_s=self.max_retry_s,
                    )
                    log.warning("watching %s failed, relisting in %.1fs: %s", self.name, delay, e)
                    self._stop.wait(delay)

    def _pages(self, listed: list[Any]) -> Iterator[list[dict[str, Any]]]:
        """The objects, a page at a time (each parsed and dropped in turn); then `listed`
        holds the count and the listing's resourceVersion."""
        token: str | None = None
        count = 0
        while True:
            if self.page_size is None:
                raw = self.list_fn(resource_version="0", _preload_content=False)
            else:
                raw = self.list_fn(limit=self.page_size, _continue=token, _preload_content=False)
            page = json.loads(raw.data)
            raw.release_conn()
            del raw
            items = page.get("items") or []
            count += len(items)
            yield items
            meta = page.get("metadata") or {}
            token = meta.get("continue")
            if not token:
                listed[:] = [count, meta["resourceVersion"]]
                return

    def _watch(self, resource_version: str) -> None:
        while not self._stop.is_set():
            response = self.list_fn(
                watch=True,
                resource_version=resource_version,
                timeout_seconds=self.watch_timeout_s,
                allow_watch_bookmarks=True,
                _preload_content=False,
            )
            self._response = response
            try:
                for line in iter_resp_lines(response):
                    if self._stop.is_set():
                        return
                    event = json.loads(line)
                    kind, obj = event.get("type"), event.get("object") or {}
                    if kind == "ERROR":
                        return  # 410 Gone and friends: the caller relists
                    resource_version = obj["metadata"]["resourceVersion"]
                    if kind == "BOOKMARK":
                        continue
                    if kind == "DELETED":
                        self.delete(obj)
                    else:
                        self.put(obj)
                    if self.on_event is not None:
                        self.on_event(obj)
            finally:
                self._response = None
                response.release_conn()


def relist_delay_s(failures: int, draw: float, *, base_s: float, max_s: float) -> float:
    """Seconds before the next listing after ``failures`` failed ones in a row: ``draw``
    (uniform in [0, 1), this process's own) of a window of ``base_s`` doubling with each
    failure, ``max_s`` at most."""
    window = min(max_s, base_s * 2.0 ** min(max(0, failures - 1), 32))
    return min(max(draw, 0.0), 1.0) * window


def _identity(obj: dict[str, Any]) -> str:
    """`namespace/name`, or the name alone for a cluster-scoped object."""
    meta = obj["metadata"]
    namespace = meta.get("namespace")
    return f"{namespace}/{meta['name']}" if namespace else str(meta["name"])
