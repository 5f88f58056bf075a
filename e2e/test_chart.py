"""The Helm chart installs into the local cluster, and the operator it runs, as a
non-root pod with a read-only root and the chart's least-privilege RBAC, drives a rollout.
With its agents (run this module under `flock /work/coord/agents.lock`: they write the
process nodes' WeightCaches), they stage with the credential the chart mounts and no
Secret RBAC, through the admission policies, as non-root."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from e2e import lanes
from e2e.agent_fixtures import PROCESS, forget_staging
from e2e.operator_fixtures import (
    Rollouts,
    publish_models,
    rollout_body,
    s3_secret,
)
from weightship.api.names import GROUP, VERSION, staged_node_label
from weightship_dev import promctl, testkit
from weightship_dev.install import apply_crds, helm, install_chart, prepare_cache_dirs
from weightship_dev.layout import S3_ACCESS_KEY, S3_SECRET_KEY

NAMESPACE_PREFIX = "ch-"


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


# The local cluster's Prometheus scrapes the pods annotated so (components.prometheus_config):
# like a ServiceMonitor on the metrics Service, every operator pod, standbys included.
def scrape_annotations(who: str, port: int) -> list[str]:
    return [
        f"{who}.podAnnotations.prometheus\\.io/scrape=true",
        f"{who}.podAnnotations.prometheus\\.io/port={port}",
    ]


def up_by_pod(namespace: str, component: str, window: str) -> dict[str, float]:
    """Each scraped pod of the component: the lowest `up` over the window (0: a scrape
    failed in it, the target was down)."""
    result = promctl.query(
        f'min_over_time(up{{namespace="{namespace}",'
        f'app_kubernetes_io_component="{component}"}}[{window}])'
    )
    return {r["metric"]["pod"]: float(r["value"][1]) for r in result}


def test_two_operator_replicas_are_two_scrape_targets_up(cluster: Any, namespace: str) -> None:
    """issue 40: with operator.replicas 2 the standby answers the scrape too (no target
    down, so no TargetDown in kube-prometheus-stack), saying it is not the leader."""
    apply_crds(cluster.api)
    name = testkit.unique_name("ws")
    install_chart(
        cluster.paths, name, namespace, [namespace], "operator.replicas=2",
        node_selector=PROCESS, set_strings=scrape_annotations("operator", 9100),
    )  # fmt: skip
    try:
        pods = cluster.core.list_namespaced_pod(
            namespace, label_selector="app.kubernetes.io/component=operator"
        ).items
        assert len(pods) == 2

        def leader_values() -> list[float] | None:
            got = promctl.query(f'weightship_operator_leader{{namespace="{namespace}"}}')
            values = sorted(float(r["value"][1]) for r in got)
            return values if values == [0.0, 1.0] else None

        testkit.wait_until(leader_values, timeout=90, what="a leader and a standby scraped")
        # Then, for 20 s (ten scrapes), every scrape of both pods succeeds.
        time.sleep(20)
        up = up_by_pod(namespace, "operator", "20s")
        assert up == {p.metadata.name: 1.0 for p in pods}, up
    finally:
        helm(cluster.paths, "uninstall", name, "-n", namespace, "--wait", "--timeout", "60s")


@pytest.fixture
def release_with_agents(cluster: Any, namespace: str) -> Iterator[str]:
    apply_crds(cluster.api)
    forget_staging(cluster)
    # docs/helm.md: a cache directory the agent owns (on this lane's nodes)
    prepare_cache_dirs(cluster.paths, nodes=cluster.process_nodes)
    cluster.core.create_namespaced_secret(
        namespace,
        {
            "metadata": {"name": "agent-s3"},
            "stringData": {
                "AWS_ACCESS_KEY_ID": S3_ACCESS_KEY,
                "AWS_SECRET_ACCESS_KEY": S3_SECRET_KEY,
            },
        },
    )
    name = testkit.unique_name("ws")
    install_chart(
        cluster.paths, name, namespace, [namespace],
        "agent.s3.existingSecret=agent-s3",
        "agent.extraEnv[0].name=WEIGHTSHIP_WATCH_NAMESPACES",
        f"agent.extraEnv[0].value={namespace}",
        agent=True, node_selector=PROCESS, peer_group=lanes.peer_group(),
        set_strings=scrape_annotations("agent", 9101),
    )  # fmt: skip
    try:
        yield name
    finally:
        helm(cluster.paths, "uninstall", name, "-n", namespace, "--wait", "--timeout", "60s")
        testkit.wait_until(
            lambda: (
                not cluster.core.list_namespaced_pod(
                    namespace, label_selector="app.kubernetes.io/component=agent"
                ).items
            ),
            timeout=60,
            what="the chart's agents gone",
        )
        forget_staging(cluster)


def test_the_charts_agents_stage_with_the_mounted_credential_and_no_secret_rbac(
    cluster: Any, namespace: str, release_with_agents: str, tmp_path: Path
) -> None:
    agent_sa = f"system:serviceaccount:{namespace}:{release_with_agents}-weightship-agent"
    review = client.AuthorizationV1Api(cluster.api).create_subject_access_review(
        {
            "spec": {
                "user": agent_sa,
                "resourceAttributes": {
                    "verb": "get",
                    "resource": "secrets",
                    "namespace": namespace,
                },
            }
        }
    )
    assert not review.status.allowed
    s3 = testkit.s3_client(cluster.s3_endpoint)
    bucket = testkit.unique_name("chart")
    s3.create_bucket(Bucket=bucket)
    try:
        uris = publish_models(cluster.s3_endpoint, bucket, tmp_path, ["v1"])
        s3_secret(cluster.core, namespace)  # the rollout's: only the operator reads it
        rollouts = Rollouts(cluster.api, namespace)
        body = rollout_body("llm", uris["v1"], "v1", [{"setWeight": 100}], cluster.s3_endpoint)
        body["spec"]["prefetch"] = {"enabled": True, "nodeSelector": PROCESS}
        rollouts.create(body)
        final = rollouts.wait(
            "llm",
            "Healthy, staged by the chart's agents",
            lambda s: s.get("phase") == "Healthy",
            timeout=180,
        )
        digest = final["status"]["stableRevision"]["manifestDigest"]
        custom = client.CustomObjectsApi(cluster.api)
        for node in cluster.process_nodes:
            cache = custom.get_cluster_custom_object(GROUP, VERSION, "weightcaches", node)
            states = {m["digest"]: m["state"] for m in cache["status"]["manifests"]}
            assert states.get(digest) == "Staged", (node, states)
            labels = cluster.core.read_node(node).metadata.labels or {}
            assert labels.get(staged_node_label(digest)) == "true", node
        # Ready through their probes (helm --wait), and scraped (what a PodMonitor does):
        # no agent target down.
        agents = cluster.core.list_namespaced_pod(
            namespace, label_selector="app.kubernetes.io/component=agent"
        ).items
        assert all(a.spec.containers[0].readiness_probe for a in agents)
        up = testkit.wait_until(
            lambda: (u := up_by_pod(namespace, "agent", "10s")) and len(u) == len(agents) and u,
            timeout=60,
            what="every agent scraped",
        )
        assert set(up.values()) == {1.0}, up
    finally:
        testkit.empty_bucket(s3, bucket)
        s3.delete_bucket(Bucket=bucket)
