"""The process kubelet: registers a node, keeps its lease, runs the pods bound to it."""

from __future__ import annotations

import base64
import contextlib
import logging
import platform
import signal
import subprocess
import threading
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import urllib3
from kubernetes import client, config, watch
from kubernetes.client.rest import ApiException

from weightship_dev import network
from weightship_dev.kubelet.podspec import Pod, PodSpecError
from weightship_dev.kubelet.worker import PodHost, PodWorker, now_iso, wait_all
from weightship_dev.layout import ClusterPaths, process_node_ip, process_node_pod_prefix
from weightship_dev.nodes import NODE_KIND_LABEL, ZONES

log = logging.getLogger("weightship.kubelet")

LEASE_SECONDS = 40
LEASE_RENEW = 10.0
STATUS_EVERY = 30.0
KUBELET_VERSION = "v1.34.4-weightship-process"
# What a call raises while the API server is down: a kubelet keeps its pods running (and
# restarts their containers) through an outage, as a real one does.
API_DOWN = (urllib3.exceptions.HTTPError, OSError)


class ApiObjects:
    """Volume and env sources read through the node's own (Node-authorized) identity."""

    def __init__(self, core: client.CoreV1Api, ca_path: Path) -> None:
        self.core = core
        self.ca_path = ca_path

    def configmap(self, namespace: str, name: str, optional: bool) -> Mapping[str, str]:
        try:
            cm = self.core.read_namespaced_config_map(name, namespace)
        except ApiException as e:
            if e.status == 404 and optional:
                return {}
            raise PodSpecError(f"configmap {namespace}/{name}: {e.reason}") from e
        return dict(cm.data or {})

    def secret(self, namespace: str, name: str, optional: bool) -> Mapping[str, str]:
        try:
            sec = self.core.read_namespaced_secret(name, namespace)
        except ApiException as e:
            if e.status == 404 and optional:
                return {}
            raise PodSpecError(f"secret {namespace}/{name}: {e.reason}") from e
        return {k: base64.b64decode(v).decode() for k, v in (sec.data or {}).items()}

    def service_account_token(self, pod: Pod, audience: str | None, expiration_seconds: int) -> str:
        meta = pod["metadata"]
        sa = pod["spec"].get("serviceAccountName") or "default"
        body = client.AuthenticationV1TokenRequest(
            spec=client.V1TokenRequestSpec(
                # No audience means the API server's own; nodes may only ask for audiences
                # that the pod's volumes name (ServiceAccountNodeAudienceRestriction).
                audiences=[audience] if audience else None,
                expiration_seconds=max(expiration_seconds, 600),
                bound_object_ref=client.V1BoundObjectReference(
                    kind="Pod", api_version="v1", name=meta["name"], uid=meta["uid"]
                ),
            )
        )
        try:
            resp = self.core.create_namespaced_service_account_token(sa, meta["namespace"], body)
        except ApiException as e:
            raise PodSpecError(f"token for serviceaccount {sa}: {e.reason}") from e
        return str(resp.status.token)

    def ca_bundle(self) -> str:
        return self.ca_path.read_text()


class Kubelet(PodHost):
    def __init__(self, node: str, index: int, paths: ClusterPaths) -> None:
        self.node_name = node
        self.index = index
        self.paths = paths
        self.host_ip = process_node_ip(index)
        self.node_dir = paths.node_dir(node)
        self.api = config.new_client_from_config(config_file=str(paths.kubeconfig_for(node)))
        self.core = client.CoreV1Api(self.api)
        self.objects = ApiObjects(self.core, paths.pki / "ca.crt")
        self.workers: dict[str, PodWorker] = {}
        self.ips: set[str] = set()
        self.last_ip_host = 1  # the first pod gets .2
        self.ip_lock = threading.Lock()
        self.stopping = threading.Event()

    # ---- PodHost ---------------------------------------------------------------------
    def patch_pod_status(self, pod: dict[str, Any], status: dict[str, Any]) -> bool:
        meta = pod["metadata"]
        try:
            self.core.patch_namespaced_pod_status(
                meta["name"], meta["namespace"], {"status": status}
            )
        except ApiException as e:
            if e.status == 404:
                return True
            log.warning("pod %s/%s status: %s", meta["namespace"], meta["name"], e.reason)
            return False
        except API_DOWN as e:  # written again at the next change once it answers
            log.warning("pod %s/%s status: %s", meta["namespace"], meta["name"], e)
            return False
        return True

    def finalize_deletion(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        body = client.V1DeleteOptions(
            grace_period_seconds=0, preconditions=client.V1Preconditions(uid=meta["uid"])
        )
        try:
            self.core.delete_namespaced_pod(meta["name"], meta["namespace"], body=body)
        except ApiException as e:
            if e.status not in (404, 409):
                log.warning("delete pod %s/%s: %s", meta["namespace"], meta["name"], e.reason)

    def release_ip(self, ip: str) -> None:
        with self.ip_lock:
            self.ips.discard(ip)

    def event(self, pod: dict[str, Any], reason: str, message: str, kind: str = "Normal") -> None:
        meta = pod["metadata"]
        body = client.CoreV1Event(
            metadata=client.V1ObjectMeta(
                generate_name=f"{meta['name']}.", namespace=meta["namespace"]
            ),
            involved_object=client.V1ObjectReference(
                kind="Pod",
                name=meta["name"],
                namespace=meta["namespace"],
                uid=meta["uid"],
                api_version="v1",
            ),
            reason=reason,
            message=message,
            type=kind,
            source=client.V1EventSource(component="kubelet", host=self.node_name),
            first_timestamp=now_iso(),
            last_timestamp=now_iso(),
            count=1,
        )
        with contextlib.suppress(ApiException, *API_DOWN):  # events are best effort
            self.core.create_namespaced_event(meta["namespace"], body)

    # ---- node ------------------------------------------------------------------------
    def node_body(self) -> dict[str, Any]:
        resources = {"cpu": "8", "memory": "32Gi", "pods": "110", "ephemeral-storage": "100Gi"}
        return {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": self.node_name,
                "labels": {
                    "kubernetes.io/hostname": self.node_name,
                    "kubernetes.io/os": "linux",
                    "kubernetes.io/arch": "amd64",
                    "node.kubernetes.io/instance-type": "process",
                    "topology.kubernetes.io/region": "local",
                    "topology.kubernetes.io/zone": ZONES[self.index % len(ZONES)],
                    NODE_KIND_LABEL: "process",
                },
            },
            "spec": {},
            "status": {"capacity": resources, "allocatable": resources},
        }

    def node_status(self) -> dict[str, Any]:
        now = now_iso()

        def cond(ctype: str, status: str, reason: str, message: str) -> dict[str, str]:
            return {
                "type": ctype,
                "status": status,
                "reason": reason,
                "message": message,
                "lastHeartbeatTime": now,
                "lastTransitionTime": self.started_at,
            }

        return {
            "conditions": [
                cond("MemoryPressure", "False", "KubeletHasSufficientMemory", "ok"),
                cond("DiskPressure", "False", "KubeletHasNoDiskPressure", "ok"),
                cond("PIDPressure", "False", "KubeletHasSufficientPID", "ok"),
                cond("Ready", "True", "KubeletReady", "process kubelet is posting ready status"),
            ],
            "addresses": [
                {"type": "InternalIP", "address": self.host_ip},
                {"type": "Hostname", "address": self.node_name},
            ],
            "nodeInfo": {
                "machineID": self.node_name,
                "systemUUID": self.node_name,
                "bootID": self.boot_id,
                "kernelVersion": platform.release(),
                "osImage": "weightship process node",
                "containerRuntimeVersion": "process://0.1",
                "kubeletVersion": KUBELET_VERSION,
                "kubeProxyVersion": "",
                "operatingSystem": "linux",
                "architecture": "amd64",
            },
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 0}},
            **self.node_body()["status"],
        }

    def register(self) -> None:
        self.started_at = now_iso()
        self.boot_id = f"{self.node_name}-{int(time.time())}"
        try:
            self.core.create_node(self.node_body())
        except ApiException as e:
            if e.status != 409:
                raise
        self.core.patch_node_status(self.node_name, {"status": self.node_status()})
        self.renew_lease()

    def renew_lease(self) -> None:
        coord = client.CoordinationV1Api(self.api)
        now = datetime.now(UTC)
        try:
            lease = coord.read_namespaced_lease(self.node_name, "kube-node-lease")
            lease.spec.renew_time = now
            lease.spec.holder_identity = self.node_name
            lease.spec.lease_duration_seconds = LEASE_SECONDS
            coord.replace_namespaced_lease(self.node_name, "kube-node-lease", lease)
        except ApiException as e:
            if e.status != 404:
                raise
            node = self.core.read_node(self.node_name)
            body = client.V1Lease(
                metadata=client.V1ObjectMeta(
                    name=self.node_name,
                    namespace="kube-node-lease",
                    owner_references=[
                        client.V1OwnerReference(
                            api_version="v1",
                            kind="Node",
                            name=self.node_name,
                            uid=node.metadata.uid,
                        )
                    ],
                ),
                spec=client.V1LeaseSpec(
                    holder_identity=self.node_name,
                    lease_duration_seconds=LEASE_SECONDS,
                    renew_time=now,
                ),
            )
            coord.create_namespaced_lease("kube-node-lease", body)

    def heartbeat(self) -> None:
        last_status = time.monotonic()
        while not self.stopping.wait(LEASE_RENEW):
            try:
                self.renew_lease()
                if time.monotonic() - last_status >= STATUS_EVERY:
                    self.core.patch_node_status(self.node_name, {"status": self.node_status()})
                    last_status = time.monotonic()
            except Exception as e:  # keep beating through API hiccups
                log.warning("heartbeat: %s", e)

    # ---- pods ------------------------------------------------------------------------
    def allocate_ip(self, pod: dict[str, Any]) -> str:
        prefix = process_node_pod_prefix(self.index)
        with self.ip_lock:
            wanted = (pod.get("status") or {}).get("podIP")
            if wanted and wanted.startswith(prefix + ".") and wanted not in self.ips:
                self.ips.add(wanted)
                return str(wanted)
            # Round robin from the last address given, as CNI's host-local IPAM does: a
            # freed address is not handed out again at once, so a client still holding a
            # connection to a deleted pod never reaches a new pod at the same address.
            for step in range(1, 254):
                host = 2 + (self.last_ip_host - 2 + step) % 253
                ip = f"{prefix}.{host}"
                if ip not in self.ips:
                    self.ips.add(ip)
                    self.last_ip_host = host
                    return ip
        raise RuntimeError(f"node {self.node_name} has no free pod IPs")

    def handle(self, event_type: str, pod: dict[str, Any]) -> None:
        uid = pod["metadata"]["uid"]
        worker = self.workers.get(uid)
        if event_type == "DELETED":
            if worker:
                worker.mark_deleted()
            return
        if worker is not None:
            worker.update(pod)
            return
        phase = (pod.get("status") or {}).get("phase")
        if pod["metadata"].get("deletionTimestamp"):
            self.finalize_deletion(pod)
            return
        if phase in ("Succeeded", "Failed"):
            return  # finished before this kubelet started; nothing to run
        worker = PodWorker(self, pod, self.allocate_ip(pod))
        self.workers[uid] = worker
        worker.start()

    def reap_workers(self) -> None:
        for uid, w in list(self.workers.items()):
            if w.done.is_set():
                del self.workers[uid]

    def watch_pods(self) -> None:
        selector = f"spec.nodeName={self.node_name}"
        while not self.stopping.is_set():
            try:
                listing = self.core.list_pod_for_all_namespaces(field_selector=selector)
                seen = set()
                for item in listing.items:
                    pod = self.api.sanitize_for_serialization(item)
                    seen.add(pod["metadata"]["uid"])
                    self.handle("MODIFIED", pod)
                for uid, w in list(self.workers.items()):
                    if uid not in seen:
                        w.mark_deleted()
                rv = listing.metadata.resource_version
                stream = watch.Watch().stream(
                    self.core.list_pod_for_all_namespaces,
                    field_selector=selector,
                    resource_version=rv,
                    timeout_seconds=60,
                    allow_watch_bookmarks=True,
                )
                for event in stream:
                    if self.stopping.is_set():
                        break
                    if event["type"] in ("ADDED", "MODIFIED", "DELETED"):
                        self.handle(
                            event["type"], self.api.sanitize_for_serialization(event["object"])
                        )
                    self.reap_workers()
            except ApiException as e:
                if e.status != 410:
                    log.warning("watch pods: %s", e.reason)
                    self.stopping.wait(1.0)
            except Exception as e:
                log.warning("watch pods: %s", e)
                self.stopping.wait(1.0)

    def cleanup_stale(self) -> None:
        """A restarted kubelet finds its old pods' processes gone or orphaned: clear them,
        then run every pod afresh (like a node reboot; restart counts start over)."""
        pods_dir = self.node_dir / "pods"
        if not pods_dir.exists():
            return
        for pod_dir in pods_dir.iterdir():
            ns = network.namespace_name(pod_dir.name)
            if network.netns_exists(ns):
                proc = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
                for pid in proc.stdout.split():
                    subprocess.run(["kill", "-9", pid], capture_output=True)
                network.delete_pod_network(ns)
                network.delete_netns_etc(ns)
            subprocess.run(["rm", "-rf", str(pod_dir)], capture_output=True)

    def run(self) -> None:
        self.node_dir.mkdir(parents=True, exist_ok=True)
        (self.node_dir / "root").mkdir(exist_ok=True)
        self.cleanup_stale()
        self.register()
        threading.Thread(target=self.heartbeat, name="heartbeat", daemon=True).start()
        signal.signal(signal.SIGTERM, lambda *_: self.stopping.set())
        signal.signal(signal.SIGINT, lambda *_: self.stopping.set())
        watcher = threading.Thread(target=self.watch_pods, name="watch", daemon=True)
        watcher.start()
        log.info("node %s ready at %s", self.node_name, self.host_ip)
        while not self.stopping.wait(1.0):
            self.reap_workers()
        workers = list(self.workers.values())
        for w in workers:
            w.stop()
        wait_all(workers, timeout=15)


def main(node: str, index: int, state: Path) -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(threadName)s %(message)s"
    )
    for noisy in ("kubernetes", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    Kubelet(node, index, ClusterPaths(state)).run()
