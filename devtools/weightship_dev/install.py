"""Install weightship into the local cluster: CRDs, and the Helm chart."""

from __future__ import annotations

import subprocess
from collections.abc import Iterable, Mapping
from pathlib import Path

import yaml
from kubernetes import client

from weightship_dev import testkit
from weightship_dev.layout import ClusterPaths, bin_dir
from weightship_dev.nodes import NODE_KIND_LABEL

REPO = Path(__file__).resolve().parents[2]
CRDS = REPO / "crds"
CHART = REPO / "charts" / "weightship"


def apply_crds(api: client.ApiClient, crds: Path = CRDS) -> None:
    """Create or replace each CRD (as `kubectl apply -f crds/`), then wait until served."""
    ext = client.ApiextensionsV1Api(api)
    for path in sorted(crds.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        name = crd["metadata"]["name"]
        try:
            ext.create_custom_resource_definition(crd)
        except client.ApiException as e:
            if e.status != 409:
                raise
            crd["metadata"]["resourceVersion"] = ext.read_custom_resource_definition(
                name
            ).metadata.resource_version
            ext.replace_custom_resource_definition(name, crd)

        def established(name: str = name) -> bool:
            got = ext.read_custom_resource_definition(name)
            return any(
                c.type == "Established" and c.status == "True" for c in got.status.conditions or []
            )

        testkit.wait_until(established, timeout=30, what=f"CRD {name} established")


def helm(paths: ClusterPaths, *args: str, timeout: float = 240) -> str:
    proc = subprocess.run(
        [str(bin_dir() / "helm"), "--kubeconfig", str(paths.admin_kubeconfig), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"helm {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout


def install_chart(
    paths: ClusterPaths,
    release: str,
    namespace: str,
    watch_namespaces: list[str],
    *extra_sets: str,
    agent: bool = False,
    chart: Path = CHART,
    node_selector: Mapping[str, str] | None = None,
    peer_group: str = "",
    set_strings: Iterable[str] = (),
) -> None:
    """`helm upgrade --install` the chart (the working tree's, or `chart`: an earlier
    release's, weightship_dev.release), with the operator (and the agents) on process
    nodes (those `node_selector` picks, when given), the agents in `peer_group`.
    `set_strings`: values given as strings (`--set-string`, e.g. an annotation "true")."""
    selector = node_selector or {NODE_KIND_LABEL: "process"}
    sets = [
        f"operator.watchNamespaces={{{','.join(watch_namespaces)}}}",
        *(f"operator.nodeSelector.{_helm_key(k)}={v}" for k, v in selector.items()),
        *(f"agent.nodeSelector.{_helm_key(k)}={v}" for k, v in selector.items()),
        f"agent.enabled={'true' if agent else 'false'}",
        *([f"agent.peerGroup={peer_group}"] if peer_group else []),
        "image.tag=local",
        *extra_sets,
    ]
    args = [
        "upgrade",
        "--install",
        release,
        str(chart),
        "--namespace",
        namespace,
        "--create-namespace",
        "--wait",
        "--timeout",
        "180s",
    ]
    for s in sets:
        args += ["--set", s]
    for s in set_strings:
        args += ["--set-string", s]
    helm(paths, *args)


def _helm_key(label: str) -> str:
    """A label key as one `--set` path segment: its dots escaped."""
    return label.replace(".", "\\.")


def prepare_cache_dirs(
    paths: ClusterPaths,
    cache_dir: str = "/var/cache/weightship",
    uid: int = 65532,
    nodes: Iterable[str] | None = None,
) -> None:
    """What docs/helm.md asks of each node once (of `nodes`, or all): a cache directory the
    non-root agent owns."""
    import os

    every = sorted(paths.nodes.iterdir()) if paths.nodes.exists() else []
    wanted = None if nodes is None else set(nodes)
    for node_dir in (d for d in every if wanted is None or d.name in wanted):
        target = node_dir / "root" / cache_dir.lstrip("/")
        target.mkdir(parents=True, exist_ok=True)
        for path in (target, *target.rglob("*")):
            os.chown(path, uid, uid)
