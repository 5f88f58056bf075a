"""spec.workloadRef under the chart's least-privilege RBAC: the operator the chart runs
(its own ServiceAccount, a Role granting only `patch` on deployments/scale in the watched
namespace) scales an adopted Deployment to zero and gives its replicas back on deletion."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kubernetes import client

from e2e.operator_fixtures import Rollouts, publish_models, s3_secret
from e2e.test_workload_ref import (
    REPLICAS,
    adopting_rollout,
    create_deployment,
    deployment,
    rollout_gone,
)
from weightship_dev import testkit

NAMESPACE_PREFIX = "wrc-"


def test_the_charts_operator_hands_a_deployment_over_and_back(
    cluster: Any, namespace: str, release: str, tmp_path: Path
) -> None:
    operator = f"system:serviceaccount:{namespace}:{release}-weightship-operator"

    def allowed(verb: str, resource: str, subresource: str = "", where: str = namespace) -> bool:
        attributes = {"verb": verb, "group": "apps", "resource": resource, "namespace": where}
        if subresource:
            attributes["subresource"] = subresource
        review = client.AuthorizationV1Api(cluster.api).create_subject_access_review(
            {"spec": {"user": operator, "resourceAttributes": attributes}}
        )
        return bool(review.status.allowed)

    # Its size, and only in the namespace it watches; never the Deployment itself.
    assert allowed("patch", "deployments", "scale")
    assert not allowed("patch", "deployments", "scale", where="default")
    assert not allowed("patch", "deployments") and not allowed("update", "deployments")
    s3 = testkit.s3_client(cluster.s3_endpoint)
    bucket = testkit.unique_name("wrc")
    s3.create_bucket(Bucket=bucket)
    try:
        uris = publish_models(cluster.s3_endpoint, bucket, tmp_path, ["v1"])
        s3_secret(cluster.core, namespace)
        rollouts = Rollouts(cluster.api, namespace)
        create_deployment(cluster, namespace, "llm", uris["v1"])
        body = adopting_rollout("llm", uris["v1"], cluster.s3_endpoint)
        rollouts.create(body)
        testkit.wait_until(
            lambda: deployment(cluster, namespace, "llm").spec.replicas == 0,
            timeout=150,
            what="the Deployment scaled to zero by the chart's operator",
            detail=lambda: str(rollouts.get("llm").get("status", {}).get("message")),
        )
        assert rollouts.get("llm")["status"]["workload"] == {"name": "llm", "replicas": REPLICAS}
        rollouts.custom.delete_namespaced_custom_object(
            "weightship.io", "v1alpha1", namespace, "modelrollouts", "llm"
        )
        testkit.wait_until(
            lambda: rollout_gone(rollouts, "llm"), timeout=90, what="the rollout deleted"
        )
        assert deployment(cluster, namespace, "llm").spec.replicas == REPLICAS
    finally:
        testkit.empty_bucket(s3, bucket)
        s3.delete_bucket(Bucket=bucket)
