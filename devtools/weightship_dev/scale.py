"""Many small ModelRollouts on KWOK GPU nodes: shared by e2e/test_scale.py and
bench/bench_scale.py. KWOK runs the pods (no containers), so only the control plane works:
no prefetch, nothing to verify (the operator opens the gate), canary 50% then 100%.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kubernetes import client

from weightship.api.names import GROUP, ROLLOUT_PLURAL, VERSION
from weightship_dev import cluster, components, processes, testkit
from weightship_dev.layout import ClusterPaths
from weightship_dev.nodes import GPU_TAINT, NODE_KIND_LABEL, admin_api, delete_kwok_leases

STEPS = [{"setWeight": 50}, {"setWeight": 100}]


def kwok_rollout_body(
    name: str, uri: str, revision: str, endpoint: str, replicas: int = 2
) -> dict[str, Any]:
    labels = {"app": name}
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "ModelRollout",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "nodeSelector": {NODE_KIND_LABEL: "kwok"},
                    "tolerations": [{**GPU_TAINT, "operator": "Equal"}],
                    "terminationGracePeriodSeconds": 0,
                    "containers": [{"name": "server", "image": "pause"}],
                },
            },
            "model": testkit.local_model(uri, endpoint, revision),
            "prefetch": {"enabled": False},
            "validation": {"checksum": False},
            # Old pods drain 1 s before they go (core/drain.py); a KWOK pod may stay Ready
            # whatever its readiness gate says, and then goes after that bounded wait.
            "strategy": {"canary": {"steps": STEPS, "scaleDownDelaySeconds": 1}},
        },
    }


def healthy_on(revision: str) -> Callable[[dict[str, Any]], bool]:
    def check(obj: dict[str, Any]) -> bool:
        status = obj.get("status") or {}
        return bool(
            status.get("phase") == "Healthy"
            and (status.get("stableRevision") or {}).get("revision") == revision
            and status.get("observedGeneration") == obj["metadata"].get("generation")
        )

    return check


class Fleet:
    """Rollouts `<prefix>-000`… in one namespace, created, changed and watched together."""

    def __init__(self, api: client.ApiClient, namespace: str, prefix: str, count: int) -> None:
        self.custom = client.CustomObjectsApi(api)
        self.namespace = namespace
        self.names = [f"{prefix}-{i:03d}" for i in range(count)]
        self.lists = 0  # LISTs this helper made (a benchmark takes them off its counts)
        self.changed_at: dict[str, float] = {}  # monotonic time each rollout's last patch returned

    def _each(self, fn: Callable[[str], Any], workers: int = 8) -> None:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            list(pool.map(fn, self.names))

    def create(self, uri: str, revision: str, endpoint: str, replicas: int = 2) -> None:
        self._each(
            lambda name: self.custom.create_namespaced_custom_object(
                GROUP,
                VERSION,
                self.namespace,
                ROLLOUT_PLURAL,
                kwok_rollout_body(name, uri, revision, endpoint, replicas),
            )
        )

    def set_model(self, uri: str, revision: str) -> None:
        spec = {"model": {"source": {"uri": uri}, "revision": revision}}

        def patch(name: str) -> None:
            self.custom.patch_namespaced_custom_object(
                GROUP, VERSION, self.namespace, ROLLOUT_PLURAL, name, {"spec": spec}
            )
            self.changed_at[name] = time.monotonic()

        self._each(patch)

    def listing(self) -> dict[str, dict[str, Any]]:
        self.lists += 1
        items = self.custom.list_namespaced_custom_object(
            GROUP, VERSION, self.namespace, ROLLOUT_PLURAL
        )["items"]
        mine = set(self.names)
        return {o["metadata"]["name"]: o for o in items if o["metadata"]["name"] in mine}

    def wait(
        self,
        check: Callable[[dict[str, Any]], bool],
        timeout: float,
        interval: float = 1.0,
        stall_s: float | None = None,
    ) -> tuple[dict[str, float], dict[str, dict[str, Any]]]:
        """Seconds until each rollout first passed `check` (those that did), and the last
        listing. One LIST per interval: the watcher must not be the load. Gives up early
        when `stall_s` passes without one more rollout passing."""
        started = time.monotonic()
        done: dict[str, float] = {}
        last: dict[str, dict[str, Any]] = {}
        progress = started
        while True:
            last = self.listing()
            now = time.monotonic() - started
            for name, obj in last.items():
                if name not in done and check(obj):
                    done[name] = now
                    progress = time.monotonic()
            if len(done) == len(self.names) or now >= timeout:
                return done, last
            if stall_s is not None and time.monotonic() - progress >= stall_s:
                return done, last
            time.sleep(interval)


def describe_stragglers(
    done: dict[str, float], listing: dict[str, dict[str, Any]], limit: int = 5
) -> str:
    left = [n for n in sorted(listing) if n not in done]
    lines = []
    for name in left[:limit]:
        status = listing[name].get("status") or {}
        lines.append(f"{name}: phase={status.get('phase')} message={status.get('message')!r}")
    missing = f" ({len(left)} left)" if left else ""
    return "\n".join(lines) + missing


def set_node_liveness(paths: ClusterPaths, lease_seconds: int, grace_seconds: int) -> float:
    """Restart the local cluster's controller manager and KWOK with these node lease and
    grace period seconds (components.SCALE_LIVENESS for 5,000 nodes; the defaults after).
    Returns the seconds it took."""
    started = time.monotonic()
    restart_controller_manager(paths, grace_seconds)
    restart_kwok(paths, lease_seconds)
    return time.monotonic() - started


def restart_kwok(paths: ClusterPaths, lease_seconds: int = components.KWOK_LEASE_SECONDS) -> float:
    """Restart the local cluster's KWOK with components.kwok's flags (after changing them),
    its nodes' leases handed over at once. Returns the seconds it took."""
    started = time.monotonic()
    processes.stop_daemon(paths.pids / "kwok.pid")
    delete_kwok_leases(admin_api(paths))
    argv = components.kwok(paths, lease_seconds)
    processes.start_daemon("kwok", argv, pids=paths.pids, logs=paths.logs)
    _wait_healthy(paths, "kwok")
    return time.monotonic() - started


def restart_controller_manager(
    paths: ClusterPaths, grace_seconds: int = components.NODE_MONITOR_GRACE_SECONDS
) -> float:
    """Restart the local cluster's controller manager with components' flags (its state is
    all in the API server). Returns the seconds it took."""
    started = time.monotonic()
    name = "kube-controller-manager"
    processes.stop_daemon(paths.pids / f"{name}.pid")
    argv = components.kube_controller_manager(paths, grace_seconds)
    processes.start_daemon(name, argv, pids=paths.pids, logs=paths.logs)
    _wait_healthy(paths, name)
    return time.monotonic() - started


def _wait_healthy(paths: ClusterPaths, name: str) -> None:
    cluster.wait_for(
        name,
        functools.partial(cluster.component_healthy, paths, name),
        60,
        paths.logs / f"{name}.log",
    )
