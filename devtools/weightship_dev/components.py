"""Command lines of the local cluster's daemons: pure builders, no side effects.

The flags follow kwokctl's binary runtime (pkg/kwokctl/components), with the API server
bound to the pod bridge so that pods reach it at its advertised address.
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

from weightship_dev.layout import (
    APISERVER_PORT,
    BRIDGE_IP,
    ETCD_PORT,
    KWOK_POD_CIDR,
    PROMETHEUS_PORT,
    S3_PORT,
    SERVICE_CIDR,
    ClusterPaths,
    bin_dir,
    cache_dir,
)

KWOK_CONFIG = Path(__file__).with_name("kwok.yaml")  # KWOK's worker counts
# Node liveness: KWOK renews each node's lease every quarter of its duration; the controller
# manager marks a node NotReady after its grace period without a renewal (the test of a
# lost process node waits for that). By default a kubelet's: 40 s leases (a renewal every
# 10 s) and 40 s. At 5,000 KWOK nodes that is 500 lease writes a second; measured at
# 1,000 nodes, 100 renewals/s cost the API server 0.3 of a core (etcd 0.1), so 5,000
# nodes' leases alone wanted most of this 2-core machine and KWOK fell behind (its nodes
# NotReady, their pods never Ready). bench_scale switches the cluster to SCALE_LIVENESS
# for its run and back after (scale.set_node_liveness): a renewal per node per 50 s (100/s
# at 5,000 nodes) and a grace period above two renewal intervals.
KWOK_LEASE_SECONDS = 40
NODE_MONITOR_GRACE_SECONDS = 40
SCALE_LIVENESS = (200, 120)  # (KWOK lease seconds, grace period seconds)

# The order matters: each daemon needs the ones before it.
CONTROL_PLANE = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")
ADDONS = ("s3", "prometheus")


def etcd(paths: ClusterPaths) -> list[str]:
    url = f"http://127.0.0.1:{ETCD_PORT}"
    peer = f"http://127.0.0.1:{ETCD_PORT + 1}"
    return [
        str(bin_dir() / "etcd"),
        "--name=node0",
        f"--data-dir={paths.etcd_data}",
        f"--listen-client-urls={url}",
        f"--advertise-client-urls={url}",
        f"--listen-peer-urls={peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=node0={peer}",
        "--quota-backend-bytes=8589934592",
        # A test cluster trades durability for speed on a shared disk.
        "--unsafe-no-fsync=true",
        "--log-level=warn",
    ]


def kube_apiserver(paths: ClusterPaths) -> list[str]:
    pki = paths.pki
    return [
        str(bin_dir() / "kube-apiserver"),
        f"--etcd-servers=http://127.0.0.1:{ETCD_PORT}",
        f"--bind-address={BRIDGE_IP}",
        f"--advertise-address={BRIDGE_IP}",
        f"--secure-port={APISERVER_PORT}",
        f"--tls-cert-file={pki / 'apiserver.crt'}",
        f"--tls-private-key-file={pki / 'apiserver.key'}",
        f"--client-ca-file={pki / 'ca.crt'}",
        f"--service-account-key-file={pki / 'sa.pub'}",
        f"--service-account-signing-key-file={pki / 'sa.key'}",
        "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
        "--api-audiences=https://kubernetes.default.svc.cluster.local",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        "--authorization-mode=Node,RBAC",
        "--enable-admission-plugins=NodeRestriction",
        "--allow-privileged=true",
        "--max-requests-inflight=1000",
        "--max-mutating-requests-inflight=500",
        "--event-ttl=30m",
        "--v=1",
    ]


def kube_controller_manager(
    paths: ClusterPaths, grace_seconds: int = NODE_MONITOR_GRACE_SECONDS
) -> list[str]:
    pki = paths.pki
    return [
        str(bin_dir() / "kube-controller-manager"),
        f"--kubeconfig={paths.kubeconfig_for('kube-controller-manager')}",
        f"--authentication-kubeconfig={paths.kubeconfig_for('kube-controller-manager')}",
        f"--authorization-kubeconfig={paths.kubeconfig_for('kube-controller-manager')}",
        f"--root-ca-file={pki / 'ca.crt'}",
        f"--service-account-private-key-file={pki / 'sa.key'}",
        "--use-service-account-credentials=true",
        "--leader-elect=false",
        "--bind-address=127.0.0.1",
        "--secure-port=10257",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        # Enough client throughput for a DaemonSet over a thousand KWOK nodes.
        "--kube-api-qps=300",
        "--kube-api-burst=600",
        "--concurrent-daemonset-syncs=4",
        # A fleet's revision change scales a hundred ReplicaSets at once; 5 workers (the
        # default) each waiting ~0.1-0.3 s per pod create or delete on a loaded API server
        # made the controller manager the slowest hop (bench_scale's profile: its CPU at
        # 6 % of a core while rollouts waited seconds for pods). Large production control
        # planes raise it the same way.
        "--concurrent-replicaset-syncs=50",
        # It counts from each node's last lease renewal: see KWOK_LEASE_SECONDS.
        f"--node-monitor-grace-period={grace_seconds}s",
        "--v=1",
    ]


def scheduler_config(paths: ClusterPaths) -> str:
    return (
        "apiVersion: kubescheduler.config.k8s.io/v1\n"
        "kind: KubeSchedulerConfiguration\n"
        "clientConnection:\n"
        f"  kubeconfig: {paths.kubeconfig_for('kube-scheduler')}\n"
        "  qps: 300\n"
        "  burst: 600\n"
        "leaderElection:\n"
        "  leaderElect: false\n"
    )


def kube_scheduler(paths: ClusterPaths) -> list[str]:
    return [
        str(bin_dir() / "kube-scheduler"),
        f"--config={paths.root / 'scheduler.yaml'}",
        f"--authentication-kubeconfig={paths.kubeconfig_for('kube-scheduler')}",
        f"--authorization-kubeconfig={paths.kubeconfig_for('kube-scheduler')}",
        "--bind-address=127.0.0.1",
        "--secure-port=10259",
        "--v=1",
    ]


def kwok_stage_files() -> list[Path]:
    stages = cache_dir() / "kwok-stages"
    return [
        stages / "node" / "fast" / "node-initialize.yaml",
        # Node status every 600-610 s; liveness is the lease (as a kubelet with leases).
        stages / "node" / "heartbeat-with-lease" / "node-heartbeat-with-lease.yaml",
        stages / "pod" / "fast" / "pod-ready.yaml",
        stages / "pod" / "fast" / "pod-complete.yaml",
        stages / "pod" / "fast" / "pod-delete.yaml",
        KWOK_CONFIG,
    ]


def kwok(paths: ClusterPaths, lease_seconds: int = KWOK_LEASE_SECONDS) -> list[str]:
    return [
        str(bin_dir() / "kwok"),
        f"--kubeconfig={paths.kubeconfig_for('kwok')}",
        "--manage-all-nodes=false",
        "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake",
        f"--node-lease-duration-seconds={lease_seconds}",
        f"--cidr={KWOK_POD_CIDR}",
        "--node-ip=198.19.127.1",
        "--server-address=127.0.0.1:10247",
        "--config=" + ",".join(str(p) for p in kwok_stage_files()),
        # Not a line per lease renewal (100 a second at 5,000 nodes); errors still show.
        "--v=WARN",
    ]


def s3(paths: ClusterPaths) -> list[str]:
    return [
        str(bin_dir() / "versitygw"),
        "--port",
        f"{BRIDGE_IP}:{S3_PORT}",
        "posix",
        str(paths.s3_data),
    ]


def prometheus_config(paths: ClusterPaths, scrape_interval: str = "2s") -> str:
    """Scrape every pod annotated `prometheus.io/scrape: "true"` on the pod bridge.

    Only pod IPs on the bridge (198.18/16) are kept: KWOK pods have IPs that lead nowhere.
    Also, for tests (weightship_dev.promctl): the rule files in `<prometheus>/rules/`, and
    the host processes (an operator started by a test) listed in `<prometheus>/targets/`
    (file-based discovery, so a test adds one without a reload).
    """
    pki = paths.pki
    relabel = [
        {
            "source_labels": ["__meta_kubernetes_pod_annotation_prometheus_io_scrape"],
            "regex": "true",
            "action": "keep",
        },
        {"source_labels": ["__meta_kubernetes_pod_ip"], "regex": r"198\.18\..*", "action": "keep"},
        {"source_labels": ["__meta_kubernetes_pod_phase"], "regex": "Running", "action": "keep"},
        {
            "source_labels": ["__meta_kubernetes_pod_annotation_prometheus_io_path"],
            "regex": "(.+)",
            "target_label": "__metrics_path__",
        },
        {
            "source_labels": [
                "__meta_kubernetes_pod_ip",
                "__meta_kubernetes_pod_annotation_prometheus_io_port",
            ],
            "regex": r"(.+);(\d+)",
            "replacement": "$1:$2",
            "target_label": "__address__",
        },
        {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
        {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
        {"source_labels": ["__meta_kubernetes_pod_node_name"], "target_label": "node"},
        {"action": "labelmap", "regex": "__meta_kubernetes_pod_label_(.+)"},
    ]
    config = {
        "global": {"scrape_interval": scrape_interval, "evaluation_interval": scrape_interval},
        "rule_files": [str(paths.prometheus / "rules" / "*.yaml")],
        "scrape_configs": [
            {
                "job_name": "processes",
                "file_sd_configs": [
                    {
                        "files": [str(paths.prometheus / "targets" / "*.json")],
                        "refresh_interval": "5s",
                    }
                ],
            },
            {
                "job_name": "pods",
                "kubernetes_sd_configs": [
                    {
                        "role": "pod",
                        "api_server": f"https://{BRIDGE_IP}:{APISERVER_PORT}",
                        "tls_config": {
                            "ca_file": str(pki / "ca.crt"),
                            "cert_file": str(pki / "prometheus.crt"),
                            "key_file": str(pki / "prometheus.key"),
                        },
                    }
                ],
                "relabel_configs": relabel,
            },
        ],
    }
    return yaml.safe_dump(config, sort_keys=False)


def prometheus(paths: ClusterPaths) -> list[str]:
    return [
        str(bin_dir() / "prometheus"),
        f"--config.file={paths.prometheus / 'prometheus.yml'}",
        f"--storage.tsdb.path={paths.prometheus / 'data'}",
        f"--web.listen-address={BRIDGE_IP}:{PROMETHEUS_PORT}",
        "--web.enable-lifecycle",
        "--storage.tsdb.retention.time=6h",
    ]


def kubelet(paths: ClusterPaths, node: str, index: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "weightship_dev",
        "kubelet",
        "--node",
        node,
        "--index",
        str(index),
        "--state",
        str(paths.root),
    ]
