"""The Helm chart installs into the local cluster, and the operator it runs, as a
non-root pod with a read-only root and the chart's least-privilege RBAC, drives a rollout."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e.operator_fixtures import (
    Rollouts,
    publish_models,
    rollout_body,
    s3_secret,
)
from weightship.dev import testkit
from weightship.dev.install import apply_crds, helm, install_chart

NAMESPACE_PREFIX = "ch-"


@pytest.fixture
def release(cluster: Any, namespace: str) -> Iterator[str]:
    apply_crds(cluster.api)
    name = testkit.unique_name("ws")
    install_chart(cluster.paths, name, namespace, [namespace])
    yield name
    helm(cluster.paths, "uninstall", name, "--namespace", namespace, "--wait", "--timeout", "60s")


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
