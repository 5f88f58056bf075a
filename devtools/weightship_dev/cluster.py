"""`weightship-dev cluster up|down|status`: a real local control plane, no Docker.

It runs etcd, kube-apiserver, kube-controller-manager, kube-scheduler and the KWOK
controller from binaries built by `hack/deps.sh`, plus a real S3 server (versitygw) and
Prometheus. KWOK fakes GPU nodes for scale; process nodes run pods as real processes
(see `weightship_dev.kubelet`).
"""

from __future__ import annotations

import functools
import shutil
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from weightship_dev import components, install, network, nodes, pki, processes
from weightship_dev.layout import (
    APISERVER_PORT,
    BRIDGE_IP,
    ETCD_PORT,
    PROMETHEUS_PORT,
    S3_ACCESS_KEY,
    S3_PORT,
    S3_SECRET_KEY,
    ClusterPaths,
    bin_dir,
    cache_dir,
    process_node_ip,
)

Log = Callable[[str], None]

REQUIRED_BINARIES = (
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kwok",
    "versitygw",
    "prometheus",
)


class ClusterError(RuntimeError):
    pass


@dataclass(frozen=True)
class ClusterConfig:
    paths: ClusterPaths = field(default_factory=ClusterPaths.default)
    kwok_nodes: int = 4
    process_nodes: int = 3
    with_addons: bool = True


def api_url(path: str = "") -> str:
    return f"https://{BRIDGE_IP}:{APISERVER_PORT}{path}"


def s3_endpoint() -> str:
    return f"http://{BRIDGE_IP}:{S3_PORT}"


def prometheus_url() -> str:
    return f"http://{BRIDGE_IP}:{PROMETHEUS_PORT}"


def _admin_ssl(paths: ClusterPaths) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(paths.pki / "ca.crt"))
    ctx.load_cert_chain(str(paths.pki / "admin.crt"), str(paths.pki / "admin.key"))
    return ctx


def _http_ok(url: str, ctx: ssl.SSLContext | None = None, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout, context=ctx) as resp:  # noqa: S310
            return bool(200 <= resp.status < 300)
    except (urllib.error.URLError, OSError, ssl.SSLError):
        return False


def component_healthy(paths: ClusterPaths, name: str) -> bool:
    match name:
        case "etcd":
            return _http_ok(f"http://127.0.0.1:{ETCD_PORT}/health")
        case "kube-apiserver":
            return (paths.pki / "admin.crt").exists() and _http_ok(
                api_url("/readyz"), _admin_ssl(paths)
            )
        case "kube-controller-manager":
            return _http_ok("https://127.0.0.1:10257/healthz", ssl._create_unverified_context())  # noqa: S323
        case "kube-scheduler":
            return _http_ok("https://127.0.0.1:10259/healthz", ssl._create_unverified_context())  # noqa: S323
        case "kwok":
            return _http_ok("http://127.0.0.1:10247/healthz")
        case "s3":
            return _http_ok(f"{s3_endpoint()}/") or _s3_answers()
        case "prometheus":
            return _http_ok(f"{prometheus_url()}/-/ready")
        case _:
            return processes.running(paths.pids / f"{name}.pid") is not None


def _s3_answers() -> bool:
    # versitygw answers an anonymous GET / with 403: it is up.
    try:
        urllib.request.urlopen(f"{s3_endpoint()}/", timeout=2)  # noqa: S310
    except urllib.error.HTTPError:
        return True
    except (urllib.error.URLError, OSError):
        return False
    return True


def wait_for(
    what: str,
    check: Callable[[], bool],
    timeout: float,
    log_file: Path | None = None,
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.25)
    detail = f"\n--- last lines of {log_file} ---\n{processes.tail(log_file)}" if log_file else ""
    raise ClusterError(f"{what} did not become healthy within {timeout:.0f}s{detail}")


def _check_prerequisites() -> None:
    missing = [b for b in REQUIRED_BINARIES if not (bin_dir() / b).exists()]
    if missing:
        raise ClusterError(
            f"missing binaries in {bin_dir()}: {', '.join(missing)}; run `make deps` "
            "(hack/deps.sh builds them from Go modules and caches them)"
        )
    for tool in ("ip", "openssl", "unshare", "mount"):
        if shutil.which(tool) is None:
            raise ClusterError(f"`{tool}` not found on PATH; run `make deps`")


def _make_pki(cfg: ClusterConfig) -> None:
    p = cfg.paths.pki
    pki.ensure_ca(p)
    pki.issue_cert(
        p,
        "apiserver",
        "/CN=kube-apiserver",
        server_sans=pki.apiserver_sans(nodes.KUBERNETES_SERVICE_IP),
    )
    clients = {
        "admin": "/O=system:masters/CN=weightship-admin",
        "kube-controller-manager": "/CN=system:kube-controller-manager",
        "kube-scheduler": "/CN=system:kube-scheduler",
        "kwok": "/O=system:masters/CN=kwok-controller",
        "prometheus": "/CN=weightship:prometheus",
    }
    for name in nodes.process_node_names(cfg.process_nodes):
        clients[name] = f"/O=system:nodes/CN=system:node:{name}"
    for name, subject in clients.items():
        pki.issue_cert(p, name, subject)
        if name != "admin":
            pki.write_kubeconfig(cfg.paths.kubeconfig_for(name), p, name)
    pki.write_kubeconfig(cfg.paths.admin_kubeconfig, p, "admin")


def _let_containers_run_python() -> None:
    """Non-root containers run the host's interpreter and this package (process nodes pull
    no images). Give "other" search permission on their parent directories (e.g. a 0700
    /root holding pyenv): search only, no listing, and nothing else changes."""
    import stat
    import sys

    import weightship

    for target in (Path(sys.executable).resolve(), Path(weightship.__file__).resolve()):
        for parent in target.parents:
            mode = parent.stat().st_mode
            if not mode & stat.S_IXOTH:
                parent.chmod(mode | stat.S_IXOTH)


def up(cfg: ClusterConfig, log: Log = print) -> None:
    """Start (or finish starting) the cluster. Idempotent: running parts are kept."""
    _check_prerequisites()
    paths = cfg.paths
    for d in (paths.root, paths.logs, paths.pids, paths.nodes, paths.s3_data, paths.prometheus):
        d.mkdir(parents=True, exist_ok=True)
    network.ensure_bridge([process_node_ip(i) for i in range(cfg.process_nodes)])
    _let_containers_run_python()
    _make_pki(cfg)
    (paths.root / "scheduler.yaml").write_text(components.scheduler_config(paths))

    builders = {
        "etcd": components.etcd,
        "kube-apiserver": components.kube_apiserver,
        "kube-controller-manager": components.kube_controller_manager,
        "kube-scheduler": components.kube_scheduler,
        "kwok": components.kwok,
    }
    for name in components.CONTROL_PLANE:
        processes.start_daemon(name, builders[name](paths), pids=paths.pids, logs=paths.logs)
        wait_for(
            name,
            functools.partial(component_healthy, paths, name),
            120,
            paths.logs / f"{name}.log",
        )
        log(f"  {name:<24} up")

    api = nodes.admin_api(paths)
    nodes.bootstrap_rbac(api)
    gateway_crds = cache_dir() / "gateway-api"
    if gateway_crds.is_dir():
        install.apply_crds(api, gateway_crds)
        log(f"  {'gateway API CRDs':<24} installed")
    nodes.ensure_kwok_nodes(api, cfg.kwok_nodes)
    log(f"  {'kwok nodes':<24} {cfg.kwok_nodes}")
    for index, name in enumerate(nodes.process_node_names(cfg.process_nodes)):
        processes.start_daemon(
            f"kubelet-{name}",
            components.kubelet(paths, name, index),
            pids=paths.pids,
            logs=paths.logs,
        )
    nodes.wait_nodes_ready(api, nodes.process_node_names(cfg.process_nodes), timeout=60)
    log(f"  {'process nodes':<24} {cfg.process_nodes}")

    if cfg.with_addons:
        (paths.prometheus / "prometheus.yml").write_text(components.prometheus_config(paths))
        processes.start_daemon(
            "s3",
            components.s3(paths),
            pids=paths.pids,
            logs=paths.logs,
            env={"ROOT_ACCESS_KEY": S3_ACCESS_KEY, "ROOT_SECRET_KEY": S3_SECRET_KEY},
        )
        processes.start_daemon(
            "prometheus",
            components.prometheus(paths),
            pids=paths.pids,
            logs=paths.logs,
            cwd=paths.prometheus,
        )
        for name in components.ADDONS:
            wait_for(
                name,
                functools.partial(component_healthy, paths, name),
                60,
                paths.logs / f"{name}.log",
            )
            log(f"  {name:<24} up")
    log(f"kubeconfig: {paths.admin_kubeconfig}")


def down(paths: ClusterPaths, *, keep_state: bool = False, log: Log = print) -> None:
    """Stop every daemon and pod, remove pod namespaces and the bridge, wipe state."""
    if paths.pids.exists():
        # Kubelets first, so they stop their pods while the API is still there.
        pid_files = sorted(paths.pids.glob("kubelet-*.pid"))
        order = [*components.ADDONS, *reversed(components.CONTROL_PLANE)]
        pid_files += [paths.pids / f"{n}.pid" for n in order]
        pid_files += [p for p in paths.pids.glob("*.pid") if p not in pid_files]
        for pid_file in pid_files:
            processes.stop_daemon(pid_file)
    _kill_pod_leftovers()
    for ns in network.list_pod_namespaces():
        network.delete_pod_network(ns)
        network.delete_netns_etc(ns)
    network.delete_bridge()
    if not keep_state and paths.root.exists():
        shutil.rmtree(paths.root, ignore_errors=True)
    log("cluster down")


# ---- faults: what the e2e tests take away and give back ----------------------------------

API_SERVER = ("etcd", "kube-apiserver")  # in the order they start


def kill_api_server(paths: ClusterPaths) -> None:
    """SIGKILL kube-apiserver and etcd at once: every client's connection refused until
    `start_api_server`. The rest of the cluster keeps running without them."""
    for name in reversed(API_SERVER):
        processes.stop_daemon(paths.pids / f"{name}.pid", grace=0)


def start_api_server(paths: ClusterPaths, timeout: float = 60) -> None:
    """etcd, then kube-apiserver, on the data they left; back once /readyz answers."""
    builders = {"etcd": components.etcd, "kube-apiserver": components.kube_apiserver}
    for name in API_SERVER:
        processes.start_daemon(name, builders[name](paths), pids=paths.pids, logs=paths.logs)
        wait_for(
            name,
            functools.partial(component_healthy, paths, name),
            timeout,
            paths.logs / f"{name}.log",
        )


def kill_pod_processes(paths: ClusterPaths, node: str, pod_uid: str) -> None:
    """SIGKILL every process of one pod on a process node: its containers crash, and its
    kubelet starts them again (with or without the API server)."""
    if (paths.node_dir(node) / "pods" / pod_uid).is_dir():
        _kill_namespace(network.namespace_name(pod_uid))


def kill_process_node(paths: ClusterPaths, node: str) -> None:
    """A process node lost at once: its kubelet and every process of its pods SIGKILLed.
    Its pods' addresses stay on the bridge, refusing connections (nothing listens), until
    `start_process_node`, whose kubelet clears them and runs the pods afresh."""
    processes.stop_daemon(paths.pids / f"kubelet-{node}.pid", grace=0)
    pods = paths.node_dir(node) / "pods"
    for pod_dir in pods.iterdir() if pods.is_dir() else ():
        _kill_namespace(network.namespace_name(pod_dir.name))


def start_process_node(paths: ClusterPaths, node: str) -> None:
    processes.start_daemon(
        f"kubelet-{node}",
        components.kubelet(paths, node, nodes.process_node_index(node)),
        pids=paths.pids,
        logs=paths.logs,
    )


def _kill_namespace(ns: str) -> None:
    proc = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
    for pid in proc.stdout.split():
        subprocess.run(["kill", "-9", pid], capture_output=True)


def _kill_pod_leftovers() -> None:
    """Kill processes still running inside pod namespaces (e.g. after a kubelet SIGKILL)."""
    for ns in network.list_pod_namespaces():
        _kill_namespace(ns)


@dataclass(frozen=True)
class ComponentStatus:
    name: str
    pid: int | None
    healthy: bool


def status(paths: ClusterPaths) -> list[ComponentStatus]:
    names = [*components.CONTROL_PLANE, *components.ADDONS]
    if paths.pids.exists():
        names += sorted(p.stem for p in paths.pids.glob("kubelet-*.pid"))
    return [
        ComponentStatus(n, processes.running(paths.pids / f"{n}.pid"), component_healthy(paths, n))
        for n in names
    ]


def is_up(paths: ClusterPaths) -> bool:
    return component_healthy(paths, "kube-apiserver")
