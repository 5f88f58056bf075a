"""One stand-in process answering for many KWOK pods (issue 39: in-place updates at 1,000
replicas on a 2-core machine, where a process per pod cannot run).

KWOK runs no containers. For each pod of ``--namespace`` matching ``--selector`` on a KWOK
node whose container runs the stand-in (``python3 -m weightship_dev.standin ...``), this
process keeps a ``standin.PodServer`` with that pod's env (resolved as a kubelet does:
values, fieldRefs, the seeding key's secretKeyRef) and that container's flags, and answers
the requests that come to the pod's IP on ``--port`` (one listening socket; the pod is told
apart by the address a connection came to). ``kwok_pod_addresses_local`` makes KWOK's pod
range (198.19.128.0/17, blackholed otherwise) local to this host while it runs, so the
operator, the verifier and a load client reach those addresses as they reach a process
node's pods.

It also plays the kubelet's part that KWOK does not: a pod is Ready only while its
server has started (``--start-seconds``, as a readiness probe would see it) and every
readiness gate is True (kubelet's rule, ``kubelet.podstatus.gate_problems``); KWOK marks
a pod Ready once and never looks at its gates again. And KWOK, starting a pod, writes
every readiness gate True itself, which no kubelet does: such a condition (True, no
reason: the operator always gives one) is removed, so the verifier checks the pod as it
would a real one.

    python3 -m weightship_dev.standinfleet --namespace NS --selector app=NAME [--port 8000]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import logging
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any

from kubernetes import client, watch
from kubernetes.client.rest import ApiException

from weightship_dev import standin
from weightship_dev.kubelet.podspec import PodSpecError, container_env
from weightship_dev.kubelet.podstatus import gate_problems
from weightship_dev.layout import KWOK_POD_CIDR, ClusterPaths
from weightship_dev.nodes import admin_api, kwok_node_name

log = logging.getLogger("weightship.standinfleet")

KWOK_NODE_PREFIX = kwok_node_name(0).rstrip("0")  # kwok-gpu-
TICK_S = 0.1  # how often pods are looked at again (starts that finished, gate changes)
PATCH_WORKERS = 8
READY, CONTAINERS_READY = "Ready", "ContainersReady"


@contextlib.contextmanager
def kwok_pod_addresses_local(cidr: str = KWOK_POD_CIDR) -> Iterator[None]:
    """Deliver KWOK's pod range to this host's sockets (a `local` route, which the kernel
    looks up before the cluster's blackhole of 198.19/16) while the context runs."""
    subprocess.run(["ip", "route", "replace", "local", cidr, "dev", "lo"], check=True)
    try:
        yield
    finally:
        subprocess.run(["ip", "route", "del", "local", cidr, "dev", "lo"], check=False)


def standin_args(pod: Mapping[str, Any]) -> list[str] | None:
    """The stand-in's flags if the pod's first container runs it, else None."""
    containers = (pod.get("spec") or {}).get("containers") or []
    if not containers:
        return None
    argv = [*(containers[0].get("command") or []), *(containers[0].get("args") or [])]
    marker = ["-m", standin.MODULE]
    for i in range(len(argv) - 1):
        if argv[i : i + 2] == marker:
            return argv[i + 2 :]
    return None


def forged_gates(pod: Mapping[str, Any]) -> list[str]:
    """Readiness gates KWOK set True when it started the pod (no reason: no controller's)."""
    gates = {g.get("conditionType") for g in (pod.get("spec") or {}).get("readinessGates") or []}
    return [
        c["type"]
        for c in (pod.get("status") or {}).get("conditions") or []
        if c.get("type") in gates and c.get("status") == "True" and not c.get("reason")
    ]


def condition_status(pod: Mapping[str, Any], ctype: str) -> str | None:
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == ctype:
            return str(c.get("status"))
    return None


def readiness_patch(pod: Mapping[str, Any], started: bool, now: str) -> dict[str, Any] | None:
    """The status patch that makes the pod's Ready and ContainersReady what a kubelet
    would say (and drops forged gates), or None when they say it already."""
    forged = forged_gates(pod)
    gates = gate_problems(dict(pod)) if not forged else ["forged"]
    ready = started and not gates
    conditions: list[dict[str, Any]] = [{"type": t, "$patch": "delete"} for t in forged]
    for ctype, ok in ((CONTAINERS_READY, started), (READY, ready)):
        want = "True" if ok else "False"
        if condition_status(pod, ctype) != want:
            conditions.append({"type": ctype, "status": want, "lastTransitionTime": now})
    return {"status": {"conditions": conditions}} if conditions else None


class Fleet:
    def __init__(self, api: client.ApiClient, namespace: str, selector: str, port: int) -> None:
        self.core = client.CoreV1Api(api)
        self.namespace, self.selector, self.port = namespace, selector, port
        self.lock = threading.Lock()
        self.pods: dict[str, dict[str, Any]] = {}  # by uid, as last seen
        self.servers: dict[str, standin.PodServer] = {}  # by uid
        self.by_address: dict[str, standin.PodServer] = {}
        self.dirty: set[str] = set()
        self.unstarted: set[str] = set()  # served, not started yet
        self.stop = threading.Event()
        self.patches = ThreadPoolExecutor(PATCH_WORKERS, thread_name_prefix="patch")
        self.patching: set[str] = set()

    def resolve(self, address: str) -> standin.PodServer | None:
        return self.by_address.get(address)

    # -- the pods ------------------------------------------------------------------------

    def watch(self) -> None:
        """List, then watch, the pods; again from a fresh list when the watch ends."""
        while not self.stop.is_set():
            try:
                listed = self.core.list_namespaced_pod(self.namespace, label_selector=self.selector)
                seen = set()
                for item in listed.items:
                    pod = self.core.api_client.sanitize_for_serialization(item)
                    seen.add(pod["metadata"]["uid"])
                    self.update(pod)
                for uid in set(self.pods) - seen:
                    self.forget(uid)
                stream = watch.Watch().stream(
                    self.core.list_namespaced_pod,
                    self.namespace,
                    label_selector=self.selector,
                    resource_version=listed.metadata.resource_version,
                    timeout_seconds=300,
                )
                for event in stream:
                    pod = self.core.api_client.sanitize_for_serialization(event["object"])
                    if event["type"] == "DELETED":
                        self.forget(pod["metadata"]["uid"])
                    elif event["type"] in ("ADDED", "MODIFIED"):
                        self.update(pod)
                    if self.stop.is_set():
                        return
            except Exception as e:  # the API server is busy: list again
                log.warning("pods of %s: %s", self.namespace, e)
                self.stop.wait(1.0)

    def update(self, pod: dict[str, Any]) -> None:
        uid = pod["metadata"]["uid"]
        with self.lock:
            self.pods[uid] = pod
            self.dirty.add(uid)
        address = (pod.get("status") or {}).get("podIP")
        if uid in self.servers or not address or pod["metadata"].get("deletionTimestamp"):
            return
        if not str((pod.get("spec") or {}).get("nodeName") or "").startswith(KWOK_NODE_PREFIX):
            return  # a process node's kubelet runs it
        argv = standin_args(pod)
        if argv is None:
            return
        try:
            how = standin.behaviour_from_argv(argv)
            env = self.env(pod, address)
        except (PodSpecError, ApiException, SystemExit) as e:
            log.warning("pod %s: not served: %s", pod["metadata"]["name"], e)
            return
        server = standin.PodServer(env, how)
        with self.lock:
            self.servers[uid] = server
            self.by_address[address] = server
            self.unstarted.add(uid)

    def forget(self, uid: str) -> None:
        with self.lock:
            pod = self.pods.pop(uid, None)
            server = self.servers.pop(uid, None)
            self.dirty.discard(uid)
            self.unstarted.discard(uid)
            address = ((pod or {}).get("status") or {}).get("podIP")
            if server is not None and address and self.by_address.get(address) is server:
                del self.by_address[address]

    def env(self, pod: dict[str, Any], address: str) -> dict[str, str]:
        def secret_key(namespace: str, name: str, key: str, optional: bool) -> str | None:
            try:
                data = self.core.read_namespaced_secret(name, namespace).data or {}
            except ApiException as e:
                if e.status == 404 and optional:
                    return None
                raise
            return base64.b64decode(data[key]).decode() if key in data else None

        def nothing(*_: Any) -> Any:
            raise PodSpecError("configMaps and envFrom are not served by the stand-in fleet")

        return container_env(
            pod,
            pod["spec"]["containers"][0],
            pod_ip=address,
            host_ip=(pod.get("status") or {}).get("hostIP") or "",
            configmap_key=nothing,
            secret_key=secret_key,
            configmap_data=nothing,
            secret_data=nothing,
        )

    # -- the kubelet's readiness ---------------------------------------------------------

    def tick(self) -> None:
        """Pods whose readiness may have changed: a watch event, or a start that ended."""
        while not self.stop.wait(TICK_S):
            with self.lock:
                started = {u for u in self.unstarted if self.servers[u].started}
                self.unstarted -= started
                self.dirty |= started
                now_due = self.dirty - self.patching  # the others: after their write
                self.dirty -= now_due
                todo = [(u, self.pods[u], self.servers.get(u)) for u in now_due if u in self.pods]
            now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            for uid, pod, server in todo:
                if server is None or pod["metadata"].get("deletionTimestamp"):
                    continue
                patch = readiness_patch(pod, server.started, now)
                if patch is not None:
                    with self.lock:
                        self.patching.add(uid)
                    self.patches.submit(self._patch, uid, pod["metadata"]["name"], patch)

    def _patch(self, uid: str, name: str, patch: dict[str, Any]) -> None:
        try:
            self.core.patch_namespaced_pod_status(name, self.namespace, patch)
        except ApiException as e:
            if e.status != 404:
                log.warning("pod %s: status not written: %s", name, e.reason)
                with self.lock:
                    self.dirty.add(uid)
        finally:
            with self.lock:
                self.patching.discard(uid)

    def run(self) -> None:
        threading.Thread(target=self.watch, name="watch", daemon=True).start()
        threading.Thread(target=self.tick, name="tick", daemon=True).start()

        async def serve() -> None:
            await standin.serve("0.0.0.0", self.port, self.resolve)  # noqa: S104
            log.info(
                "stand-in fleet for %s/%s on port %d", self.namespace, self.selector, self.port
            )
            while not self.stop.is_set():
                await asyncio.sleep(1.0)
                with self.lock:
                    served = len(self.servers)
                log.debug("%d pods served", served)

        asyncio.run(serve())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--namespace", required=True)
    p.add_argument("--selector", required=True, help="the pods' label selector")
    p.add_argument("--port", type=int, default=standin.DEFAULT_PORT)
    p.add_argument("--kubeconfig", default=None, help="default: the local cluster's admin")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    if args.kubeconfig:
        from kubernetes import config

        api = config.new_client_from_config(config_file=args.kubeconfig)
    else:
        api = admin_api(ClusterPaths.default())
    started = time.monotonic()
    Fleet(api, args.namespace, args.selector, args.port).run()
    log.info("stopped after %.0f s", time.monotonic() - started)


if __name__ == "__main__":
    main()
