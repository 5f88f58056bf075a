"""Where the local cluster keeps its binaries, state and addresses."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

# 198.18.0.0/15 is set aside for benchmarks (RFC 2544), so it never collides with a real
# network. 198.18/16 is the pod bridge; 198.19/16 holds virtual ranges (services, KWOK
# pod IPs) and is blackholed on the host so nothing aimed at it can leave the machine.
BRIDGE = "ws0"
BRIDGE_IP = "198.18.0.1"
BRIDGE_PREFIX = 16
SERVICE_CIDR = "198.19.0.0/17"
KWOK_POD_CIDR = "198.19.128.0/17"
BLACKHOLE_CIDR = "198.19.0.0/16"
APISERVER_PORT = 6443
ETCD_PORT = 2379
S3_PORT = 9000
PROMETHEUS_PORT = 9090

S3_ACCESS_KEY = "weightship"
S3_SECRET_KEY = "weightship-local-secret"  # noqa: S105 - a throwaway local test credential


def cache_dir() -> Path:
    return Path(os.environ.get("WEIGHTSHIP_CACHE", Path.home() / ".cache" / "weightship"))


def bin_dir() -> Path:
    return cache_dir() / "bin"


def state_dir() -> Path:
    return Path(os.environ.get("WEIGHTSHIP_STATE", "/var/tmp/weightship-cluster"))


def process_node_ip(index: int) -> str:
    """The node's own InternalIP: an extra address on the bridge, one per process node."""
    return f"198.18.{10 + index}.1"


def process_node_pod_prefix(index: int) -> str:
    """Pods of process node `index` get 198.18.(10+index).2-254."""
    return f"198.18.{10 + index}"


@dataclass(frozen=True)
class ClusterPaths:
    root: Path

    @property
    def pki(self) -> Path:
        return self.root / "pki"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def pids(self) -> Path:
        return self.root / "pids"

    @property
    def etcd_data(self) -> Path:
        return self.root / "etcd"

    @property
    def nodes(self) -> Path:
        return self.root / "nodes"

    @property
    def s3_data(self) -> Path:
        return self.root / "s3"

    @property
    def prometheus(self) -> Path:
        return self.root / "prometheus"

    @property
    def admin_kubeconfig(self) -> Path:
        return self.root / "kubeconfig"

    def kubeconfig_for(self, user: str) -> Path:
        return self.pki / f"{user}.kubeconfig"

    def node_dir(self, node: str) -> Path:
        return self.nodes / node

    @classmethod
    def default(cls) -> ClusterPaths:
        return cls(state_dir())
