"""Node objects for the local cluster: KWOK GPU nodes and process nodes."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kubernetes import client, config
from kubernetes.client.rest import ApiException

from weightship_dev.layout import ClusterPaths

KUBERNETES_SERVICE_IP = "198.19.0.1"
KWOK_ANNOTATION = "kwok.x-k8s.io/node"
NODE_KIND_LABEL = "weightship.io/node-kind"
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
ZONES = ("local-a", "local-b", "local-c")
NODE_LEASE_NAMESPACE = "kube-node-lease"


def process_node_names(count: int) -> list[str]:
    return [f"proc-{i}" for i in range(count)]


def process_node_index(name: str) -> int:
    """proc-N -> N: which addresses (layout.process_node_ip) and kubelet the node has."""
    prefix, _, index = name.rpartition("-")
    if prefix != "proc" or not index.isdigit():
        raise ValueError(f"{name!r} is not a process node name")
    return int(index)


def kwok_node_name(index: int) -> str:
    return f"kwok-gpu-{index:04d}"


def admin_api(paths: ClusterPaths) -> client.ApiClient:
    return config.new_client_from_config(config_file=str(paths.admin_kubeconfig))


def kwok_node_body(index: int) -> dict[str, Any]:
    """A fake node shaped like an 8-GPU cloud instance, with the usual GPU taint."""
    name = kwok_node_name(index)
    resources = {
        "cpu": "192",
        "memory": "2048Gi",
        "pods": "110",
        "nvidia.com/gpu": "8",
        "ephemeral-storage": "7000Gi",
    }
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {KWOK_ANNOTATION: "fake", "node.alpha.kubernetes.io/ttl": "0"},
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "type": "kwok",
                NODE_KIND_LABEL: "kwok",
                "node.kubernetes.io/instance-type": "p5.48xlarge",
                "topology.kubernetes.io/region": "local",
                "topology.kubernetes.io/zone": ZONES[index % len(ZONES)],
                "nvidia.com/gpu.present": "true",
                "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
                "nvidia.com/gpu.count": "8",
            },
        },
        "spec": {"taints": [GPU_TAINT]},
        "status": {"capacity": resources, "allocatable": resources},
    }


def ensure_kwok_nodes(
    api: client.ApiClient, count: int, *, start: int = 0, workers: int = 16
) -> list[str]:
    """Create KWOK nodes start..start+count-1 (existing ones are kept)."""
    core = client.CoreV1Api(api)

    def create(index: int) -> str:
        body = kwok_node_body(index)
        try:
            core.create_node(body)
        except ApiException as e:
            if e.status != 409:
                raise
        return str(body["metadata"]["name"])

    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(create, range(start, start + count)))


def delete_kwok_nodes(api: client.ApiClient, names: list[str], workers: int = 16) -> None:
    core = client.CoreV1Api(api)

    def delete(name: str) -> None:
        try:
            core.delete_node(name)
        except ApiException as e:
            if e.status != 404:
                raise

    with ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(delete, names))


def delete_kwok_leases(api: client.ApiClient) -> int:
    """Delete every KWOK node's lease (with KWOK stopped), so that the next KWOK creates
    them at once. Each KWOK process holds leases under a new identity: it waits out another
    holder's lease duration before it takes one over, and one whose holder is cleared it
    only takes at its next renewal, after a failed create (its lease cache is empty at
    first); meanwhile its nodes' pods are not managed and the nodes may go NotReady. The
    controller manager reads a missing lease as no news (it keeps the last renewal).
    Returns how many it deleted."""
    core, coord = client.CoreV1Api(api), client.CoordinationV1Api(api)
    kwok_nodes = {
        n.metadata.name
        for n in core.list_node().items
        if (n.metadata.annotations or {}).get(KWOK_ANNOTATION) == "fake"
    }
    names = [
        lease.metadata.name
        for lease in coord.list_namespaced_lease(NODE_LEASE_NAMESPACE).items
        if lease.metadata.name in kwok_nodes
    ]

    def delete(name: str) -> None:
        try:
            coord.delete_namespaced_lease(name, NODE_LEASE_NAMESPACE)
        except ApiException as e:
            if e.status != 404:
                raise

    with ThreadPoolExecutor(max_workers=16) as pool:
        list(pool.map(delete, names))
    return len(names)


def node_ready(node: Any) -> bool:
    for cond in (node.status.conditions or []) if node.status else []:
        if cond.type == "Ready":
            return bool(cond.status == "True")
    return False


def wait_nodes_ready(api: client.ApiClient, names: list[str], timeout: float) -> None:
    core = client.CoreV1Api(api)
    deadline = time.monotonic() + timeout
    pending = set(names)
    while pending and time.monotonic() < deadline:
        for name in list(pending):
            try:
                if node_ready(core.read_node(name)):
                    pending.discard(name)
            except ApiException as e:
                if e.status != 404:
                    raise
        if pending:
            time.sleep(0.5)
    if pending:
        raise TimeoutError(f"nodes not Ready after {timeout:.0f}s: {', '.join(sorted(pending))}")


PROMETHEUS_RBAC: list[dict[str, Any]] = [
    {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": "weightship:prometheus"},
        "rules": [
            {
                "apiGroups": [""],
                "resources": ["pods", "nodes", "endpoints", "services"],
                "verbs": ["get", "list", "watch"],
            }
        ],
    },
    {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": "weightship:prometheus"},
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "ClusterRole",
            "name": "weightship:prometheus",
        },
        "subjects": [
            {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "User",
                "name": "weightship:prometheus",
            }
        ],
    },
]


def bootstrap_rbac(api: client.ApiClient) -> None:
    """Least privilege for Prometheus' service discovery: read pods, nothing else."""
    rbac = client.RbacAuthorizationV1Api(api)
    role, binding = PROMETHEUS_RBAC
    for create, body in (
        (rbac.create_cluster_role, role),
        (rbac.create_cluster_role_binding, binding),
    ):
        try:
            create(body)
        except ApiException as e:
            if e.status != 409:
                raise
