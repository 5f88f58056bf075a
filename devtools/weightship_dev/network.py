"""Host networking for process nodes: one Linux bridge, a network namespace per pod.

Every pod gets its own namespace, a veth pair whose host end joins the bridge, and its
own IP. The host, and through it every component, reaches pods over the bridge; pods
reach each other on the same L2 segment. IP forwarding is left as the host has it, so
pods cannot reach beyond this machine.
"""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

from weightship_dev.layout import BLACKHOLE_CIDR, BRIDGE, BRIDGE_IP, BRIDGE_PREFIX


class NetworkError(RuntimeError):
    pass


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise NetworkError(f"ip {' '.join(args)}: {proc.stderr.strip()}")
    return proc


def bridge_exists() -> bool:
    return _ip("link", "show", BRIDGE, check=False).returncode == 0


def ensure_bridge(node_ips: list[str]) -> None:
    """Create the bridge with the host address and one extra address per process node."""
    if not bridge_exists():
        _ip("link", "add", BRIDGE, "type", "bridge")
    existing = _ip("-o", "addr", "show", "dev", BRIDGE).stdout
    for address in [BRIDGE_IP, *node_ips]:
        if f" {address}/" not in existing:
            _ip("addr", "add", f"{address}/{BRIDGE_PREFIX}", "dev", BRIDGE)
    _ip("link", "set", BRIDGE, "up")
    routes = _ip("route", "show", "type", "blackhole").stdout
    if BLACKHOLE_CIDR not in routes:
        _ip("route", "add", "blackhole", BLACKHOLE_CIDR)
    # With br_netfilter loaded, bridged frames traverse iptables; keep them off it.
    nf = Path("/proc/sys/net/bridge/bridge-nf-call-iptables")
    if nf.exists():
        nf.write_text("0\n")


def delete_bridge() -> None:
    _ip("route", "del", "blackhole", BLACKHOLE_CIDR, check=False)
    if bridge_exists():
        _ip("link", "del", BRIDGE)


def namespace_name(pod_uid: str) -> str:
    return "wsp-" + pod_uid.replace("-", "")[:12]


def _host_veth(netns: str) -> str:
    # Interface names are limited to 15 bytes.
    return "wsv" + hashlib.sha256(netns.encode()).hexdigest()[:11]


def netns_exists(netns: str) -> bool:
    return Path("/run/netns", netns).exists()


def create_pod_network(netns: str, pod_ip: str) -> None:
    """Idempotently create the namespace, its veth and address, and a default route."""
    if not netns_exists(netns):
        _ip("netns", "add", netns)
    veth = _host_veth(netns)
    if _ip("link", "show", veth, check=False).returncode != 0:
        _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", netns)
    _ip("link", "set", veth, "master", BRIDGE, "up")
    have = _ip("-n", netns, "-o", "addr", "show", "dev", "eth0").stdout
    if f" {pod_ip}/" not in have:
        _ip("-n", netns, "addr", "add", f"{pod_ip}/{BRIDGE_PREFIX}", "dev", "eth0")
    _ip("-n", netns, "link", "set", "lo", "up")
    _ip("-n", netns, "link", "set", "eth0", "up")
    if "default" not in _ip("-n", netns, "route", "show").stdout:
        _ip("-n", netns, "route", "add", "default", "via", BRIDGE_IP)


def delete_pod_network(netns: str) -> None:
    _ip("link", "del", _host_veth(netns), check=False)
    if netns_exists(netns):
        _ip("netns", "del", netns, check=False)


def list_pod_namespaces() -> list[str]:
    root = Path("/run/netns")
    if not root.exists():
        return []
    return sorted(p.name for p in root.iterdir() if p.name.startswith("wsp-"))


def write_netns_etc(netns: str, hosts: str, resolv: str) -> Path:
    """`ip netns exec` bind-mounts /etc/netns/<ns>/* over /etc/*: a per-pod hosts file and
    resolver config, so nothing in the pod waits ~20 s on the unreachable host resolver."""
    etc = Path("/etc/netns", netns)
    etc.mkdir(parents=True, exist_ok=True)
    (etc / "hosts").write_text(hosts)
    (etc / "resolv.conf").write_text(resolv)
    return etc


def delete_netns_etc(netns: str) -> None:
    etc = Path("/etc/netns", netns)
    if etc.exists():
        for child in etc.iterdir():
            child.unlink()
        etc.rmdir()
