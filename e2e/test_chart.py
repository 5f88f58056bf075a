"""The Helm chart installs into the local cluster, and the operator it runs, as a
non-root pod with a read-only root and the chart's least-privilege RBAC, drives a rollout."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e.operator_fixtures import (
    Rollouts,
    apply_crds,
    publish_models,
    rollout_body,
    s3_secret,
)
from weightship.dev import testkit
from weightship.dev.layout import bin_dir

NAMESPACE_PREFIX = "ch-"
CHART = Path(__file__).resolve().parent.parent / "charts" / "weightship"


def helm(cluster: Any, *args: str) -> str:
    proc = subprocess.run(
        [str(bin_dir() / "helm"), "--kubeconfig", str(cluster.paths.admin_kubeconfig), *args],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, f"helm {' '.join(args)}:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.fixture
def release(cluster: Any, namespace: str) -> Iterator[str]:
    apply_crds(cluster.api)
    name = testkit.unique_name("ws")
    helm(
        cluster,
        "install",
        name,
        str(CHART),
        "--namespace",
        namespace,
        "--wait",
        "--timeout",
        "120s",
        "--set",
        f"operator.watchNamespaces={{{namespace}}}",
        "--set",
        "operator.nodeSelector.weightship\\.io/node-kind=process",
        "--set",
        "agent.enabled=false",
        "--set",
        "image.tag=e2e",
    )
    yield name
    helm(cluster, "uninstall", name, "--namespace", namespace, "--wait", "--timeout", "60s")


def test_chart_installs_and_its_operator_runs_a_rollout(
    cluster: Any, namespace: str, release: str, tmp_path: Path
) -> None:
    pods = cluster.core.list_namespaced_pod(namespace).items
    operator_pod = next(p for p in pods if "operator" in p.metadata.name)
    assert operator_pod.spec.node_name in cluster.process_nodes
    sc = operator_pod.spec.containers[0].security_context
    assert sc.run_as_non_root and sc.read_only_root_filesystem

    s3 = testkit.s3_client(cluster.s3_endpoint)
    bucket = testkit.unique_name("chart")
    s3.create_bucket(Bucket=bucket)
    try:
        uris = publish_models(cluster.s3_endpoint, bucket, tmp_path, ["v1"])
        s3_secret(cluster.core, namespace)
        rollouts = Rollouts(cluster.api, namespace)
        rollouts.create(
            rollout_body("llm", uris["v1"], "v1", [{"setWeight": 100}], cluster.s3_endpoint)
        )
        rollouts.wait(
            "llm",
            "Healthy, driven by the in-cluster operator",
            lambda s: s.get("phase") == "Healthy",
            timeout=120,
        )
    finally:
        testkit.empty_bucket(s3, bucket)
        s3.delete_bucket(Bucket=bucket)
