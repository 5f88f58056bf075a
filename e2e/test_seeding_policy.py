"""The chart lets the operator create Secrets (each rollout's seeding key, docs/seeding.md)
and its ValidatingAdmissionPolicy narrows that to the seeding key's shape, on the real API
server: never a service-account token Secret (the token controller would fill it with a
token of any account, e.g. kube-system's), never any other Secret. The policy matches only
this test's operator service account (e2e.test_policies' release)."""

from __future__ import annotations

import copy
import time
from typing import Any

from kubernetes import client

from e2e.test_policies import Release, refused, release, token_for, user_api
from weightship.api.models import ModelRollout
from weightship.controller.seedkey import seed_key_secret
from weightship_testing.samples import VALID_MANIFEST

__all__ = ["release"]  # the fixture, shared with e2e.test_policies

NAMESPACE_PREFIX = "spol-"
MESSAGE = "only a rollout's seeding key Secret"


def test_the_operator_creates_only_seeding_key_secrets(cluster: Any, release: Release) -> None:
    ns = release.namespace
    rbac = client.RbacAuthorizationV1Api(cluster.api)
    for doc in release.docs:  # the watched namespace's Secret Role, as the chart grants it
        if doc["kind"] == "Role":
            rbac.create_namespaced_role(ns, doc)
        elif doc["kind"] == "RoleBinding":
            rbac.create_namespaced_role_binding(ns, doc)
    # The chart's Roles per watched namespace: this one's Secrets (and one for workloadRef's
    # deployments/scale).
    (role,) = [
        d
        for d in release.docs
        if d["kind"] == "Role" and any("secrets" in r.get("resources", []) for r in d["rules"])
    ]
    (rule,) = [r for r in role["rules"] if "secrets" in r.get("resources", [])]
    assert {"get", "create"} <= set(rule["verbs"])
    sa = release.named("ServiceAccount", "-operator")["metadata"]["name"]
    operator = client.CoreV1Api(user_api(cluster, token_for(cluster.core, ns, sa)))
    body = copy.deepcopy(VALID_MANIFEST)
    body["metadata"] = {
        "name": "llm",
        "namespace": ns,
        "uid": "0b5e7c1e-0000-4000-8000-000000000001",
    }
    key_secret = seed_key_secret(ModelRollout.from_body(body), bytes(range(32)))
    # RBAC lags the role's creation by a moment; the policy was in force before.
    created = None
    for _ in range(20):
        try:
            created = operator.create_namespaced_secret(ns, key_secret)
            break
        except client.ApiException as e:
            if e.status != 403 or MESSAGE in str(e.body):
                raise
            time.sleep(0.5)
    assert created is not None and created.metadata.name == "llm-seed-key"

    def secret(**fields: Any) -> dict[str, Any]:
        return {"apiVersion": "v1", "kind": "Secret", **fields}

    token_secret = secret(
        metadata={
            "name": "admin-token-seed-key",
            "annotations": {"kubernetes.io/service-account.name": "default"},
            "labels": key_secret["metadata"]["labels"],
            "ownerReferences": key_secret["metadata"]["ownerReferences"],
        },
        type="kubernetes.io/service-account-token",
    )
    refused(lambda: operator.create_namespaced_secret(ns, token_secret), MESSAGE)
    plain = secret(metadata={"name": "s3-credentials"}, type="Opaque", stringData={"k": "v"})
    refused(lambda: operator.create_namespaced_secret(ns, plain), MESSAGE)
    unowned = copy.deepcopy(key_secret)
    unowned["metadata"]["name"] = "other-seed-key"
    del unowned["metadata"]["ownerReferences"]
    refused(lambda: operator.create_namespaced_secret(ns, unowned), MESSAGE)
