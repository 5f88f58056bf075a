"""The node agent DaemonSet of one e2e test (its own namespace and RBAC), and reads of
the WeightCaches it writes. The `agents` fixture is in conftest.py."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kubernetes import client
from kubernetes.client.rest import ApiException

from e2e import lanes
from weightship.api.names import GROUP, VERSION
from weightship_dev import testkit
from weightship_dev.layout import S3_ACCESS_KEY, S3_SECRET_KEY

CACHE_DIR = "/var/cache/weightship"
# The agents' install-time S3 credential, as the chart gives it (agent.s3.existingSecret): a
# Secret of the agents' namespace mounted as files. The agents have no Secret RBAC.
CREDENTIALS_SECRET = "agent-s3"
CREDENTIALS_DIR = "/etc/weightship/s3"
IMAGE = "ghcr.io/weightship/weightship:test"
# This worker's process nodes (all of them without xdist: e2e/lanes.py).
PROCESS = lanes.process_node_selector()


def cache_root(cluster: Any, node: str) -> Path:
    return Path(cluster.paths.root) / "nodes" / node / "root" / CACHE_DIR.lstrip("/")


def journaled_bytes(cluster: Any, node: str, manifest: Any) -> int:
    """The bytes of the chunks a node's journal lists as verified."""
    journal = cache_root(cluster, node) / "models" / manifest.digest_hex / "journal"
    try:
        lines = journal.read_text().split("\n")[:-1]
    except FileNotFoundError:
        return 0
    indexes = {int(s) for s in lines if s.isdigit()}
    return sum(manifest.chunks[i].size for i in indexes if i < len(manifest.chunks))


def damage_staged_piece(cluster: Any, node: str, manifest: Any, chunk: Any, piece: int) -> None:
    """Flip one byte of one piece of a chunk in a node's staged copy: its agent still lists
    the chunk as verified and serves it from there, as a lying peer would."""
    files = cache_root(cluster, node) / "models" / manifest.digest_hex / "files"
    with open(files / chunk.file, "r+b") as f:
        where = chunk.offset + piece * manifest.piece_size + 17
        f.seek(where)
        byte = f.read(1)
        f.seek(where)
        f.write(bytes([byte[0] ^ 0xFF]))


def agent_objects(namespace: str) -> dict[str, Any]:
    def field(path: str) -> dict[str, Any]:
        return {"valueFrom": {"fieldRef": {"fieldPath": path}}}

    labels = {"app": "weightship-agent"}
    return {
        "service_account": {"metadata": {"name": "agent"}},
        "credentials": {
            "metadata": {"name": CREDENTIALS_SECRET},
            "stringData": {
                "AWS_ACCESS_KEY_ID": S3_ACCESS_KEY,
                "AWS_SECRET_ACCESS_KEY": S3_SECRET_KEY + "\n",  # as --from-file leaves it
            },
        },
        "cluster_role": {
            "metadata": {"name": f"{namespace}-agent"},
            "rules": [
                {
                    "apiGroups": [GROUP],
                    "resources": ["weightcaches"],
                    "verbs": ["get", "list", "watch", "create", "patch", "update"],
                },
                {
                    "apiGroups": [GROUP],
                    "resources": ["weightcaches/status"],
                    "verbs": ["patch", "update"],
                },
                {
                    "apiGroups": [GROUP],
                    "resources": ["modelrollouts"],
                    "verbs": ["get", "list", "watch"],
                },
                {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list"]},
            ],  # no Secrets, as in the chart
        },
        "cluster_role_binding": {
            "metadata": {"name": f"{namespace}-agent"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": f"{namespace}-agent",
            },
            "subjects": [{"kind": "ServiceAccount", "name": "agent", "namespace": namespace}],
        },
        "daemon_set": {
            "metadata": {"name": "agent", "labels": labels},
            "spec": {
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {
                        "labels": labels,
                        "annotations": {
                            "prometheus.io/scrape": "true",
                            "prometheus.io/port": "9101",
                        },
                    },
                    "spec": {
                        "serviceAccountName": "agent",
                        "nodeSelector": PROCESS,
                        "terminationGracePeriodSeconds": 5,
                        "containers": [
                            {
                                "name": "agent",
                                "image": IMAGE,
                                "args": ["agent"],
                                "env": [
                                    {"name": "NODE_NAME", **field("spec.nodeName")},
                                    {"name": "POD_IP", **field("status.podIP")},
                                    {"name": "POD_NAMESPACE", **field("metadata.namespace")},
                                    {"name": "WEIGHTSHIP_CACHE_DIR", "value": CACHE_DIR},
                                    {"name": "WEIGHTSHIP_PEER_PORT", "value": "8479"},
                                    {
                                        "name": "WEIGHTSHIP_S3_CREDENTIALS_DIR",
                                        "value": CREDENTIALS_DIR,
                                    },
                                    # Only this test's rollouts: other modules share the cluster.
                                    {"name": "WEIGHTSHIP_WATCH_NAMESPACES", "value": namespace},
                                    {"name": "WEIGHTSHIP_PEER_GROUP", "value": lanes.peer_group()},
                                ],
                                "ports": [
                                    {"name": "peer", "containerPort": 8479},
                                    {"name": "metrics", "containerPort": 9101},
                                ],
                                "readinessProbe": {
                                    "httpGet": {"path": "/healthz", "port": "peer"},
                                    "periodSeconds": 1,
                                },
                                # hostPath is root-owned on process nodes; / stays read-only.
                                "securityContext": {
                                    "runAsUser": 0,
                                    "readOnlyRootFilesystem": True,
                                    "allowPrivilegeEscalation": False,
                                },
                                "volumeMounts": [
                                    {"name": "cache", "mountPath": CACHE_DIR},
                                    {"name": "tmp", "mountPath": "/tmp"},
                                    {
                                        "name": "s3-credentials",
                                        "mountPath": CREDENTIALS_DIR,
                                        "readOnly": True,
                                    },
                                ],
                            }
                        ],
                        "volumes": [
                            {
                                "name": "cache",
                                "hostPath": {"path": CACHE_DIR, "type": "DirectoryOrCreate"},
                            },
                            {"name": "tmp", "emptyDir": {}},
                            {
                                "name": "s3-credentials",
                                "secret": {
                                    "secretName": CREDENTIALS_SECRET,
                                    "defaultMode": 0o400,
                                },
                            },
                        ],
                    },
                },
            },
        },
    }


class Agents:
    """The agent DaemonSet of one test, and reads of the WeightCaches it writes."""

    def __init__(self, cluster: Any, namespace: str) -> None:
        self.cluster = cluster
        self.namespace = namespace
        self.custom = client.CustomObjectsApi(cluster.api)

    def pods(self) -> list[Any]:
        return list(
            self.cluster.core.list_namespaced_pod(
                self.namespace, label_selector="app=weightship-agent"
            ).items
        )

    def pod_on(self, node: str) -> Any:
        return next(p for p in self.pods() if p.spec.node_name == node)

    def cache(self, node: str) -> dict[str, Any]:
        try:
            return dict(self.custom.get_cluster_custom_object(GROUP, VERSION, "weightcaches", node))
        except ApiException as e:
            if e.status == 404:
                return {}
            raise

    def entry(self, node: str, digest: str) -> dict[str, Any]:
        manifests = (self.cache(node).get("status") or {}).get("manifests") or []
        return next((m for m in manifests if m["digest"] == digest), {})

    def wait_staged(
        self, digest: str, timeout: float = 90, nodes: list[str] | None = None
    ) -> dict[str, dict[str, Any]]:
        nodes = nodes or self.cluster.process_nodes

        def all_staged() -> dict[str, dict[str, Any]] | None:
            entries = {n: self.entry(n, digest) for n in nodes}
            failed = {
                n: e.get("lastError") for n, e in entries.items() if e.get("state") == "Failed"
            }
            assert not failed, f"staging failed: {failed}"
            return entries if all(e.get("state") == "Staged" for e in entries.values()) else None

        return testkit.wait_until(
            all_staged,
            timeout=timeout,
            what=f"{digest} Staged on {nodes}",
            detail=lambda: str({n: self.entry(n, digest) for n in nodes}),
        )

    def logs(self, node: str) -> str:
        folder = Path(self.cluster.paths.root) / "nodes" / node / "logs"
        texts = [p.read_text(errors="replace") for p in folder.glob(f"{self.namespace}*agent*")]
        return "\n".join(texts)[-3000:]


def run_agents(cluster: Any, namespace: str) -> Iterator[Agents]:
    """The agent DaemonSet in ``namespace`` (its RBAC, credentials), from empty node
    caches, until every process node has a Ready agent with a WeightCache; removed, with
    what it staged, when the generator closes (the ``agents`` fixture, benchmarks)."""
    objs = agent_objects(namespace)
    rbac = client.RbacAuthorizationV1Api(cluster.api)
    for node in cluster.process_nodes:  # every test measures from an empty cache
        shutil.rmtree(cache_root(cluster, node), ignore_errors=True)
    cluster.core.create_namespaced_service_account(namespace, objs["service_account"])
    cluster.core.create_namespaced_secret(namespace, objs["credentials"])
    rbac.create_cluster_role(objs["cluster_role"])
    rbac.create_cluster_role_binding(objs["cluster_role_binding"])
    cluster.apps.create_namespaced_daemon_set(namespace, objs["daemon_set"])
    handle = Agents(cluster, namespace)
    try:

        def ready() -> bool:
            pods = handle.pods()
            up = {
                p.spec.node_name
                for p in pods
                if any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])
            }
            peers = {
                n
                for n in cluster.process_nodes
                if (handle.cache(n).get("status") or {}).get("peerEndpoint")
            }
            return up == peers == set(cluster.process_nodes)

        testkit.wait_until(
            ready,
            timeout=60,
            what="an agent Ready with a WeightCache on every process node",
            detail=lambda: handle.logs(cluster.process_nodes[0]),
        )
        yield handle
    finally:
        delete_if_present(cluster.apps.delete_namespaced_daemon_set, "agent", namespace)
        testkit.wait_until(lambda: not handle.pods(), timeout=60, what="agent pods gone")
        forget_staging(cluster)
        delete_if_present(rbac.delete_cluster_role_binding, f"{namespace}-agent")
        delete_if_present(rbac.delete_cluster_role, f"{namespace}-agent")


def forget_staging(cluster: Any) -> None:
    """What agents leave on the process nodes: WeightCaches, staged labels, cache files."""
    custom = client.CustomObjectsApi(cluster.api)
    for node in cluster.process_nodes:
        delete_if_present(custom.delete_cluster_custom_object, GROUP, VERSION, "weightcaches", node)
        labels = cluster.core.read_node(node).metadata.labels or {}
        staged = {k: None for k in labels if k.startswith(f"staged.{GROUP}/")}
        if staged:
            cluster.core.patch_node(node, {"metadata": {"labels": staged}})
        shutil.rmtree(cache_root(cluster, node), ignore_errors=True)


def delete_if_present(fn: Any, *args: Any) -> None:
    try:
        fn(*args)
    except ApiException as e:
        if e.status != 404:
            raise
