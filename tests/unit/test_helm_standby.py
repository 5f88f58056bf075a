"""The chart's standby operators: `operator.replicas: 2` renders leader election on a Lease
of the release namespace (namespace-scoped RBAC on that Lease only), a
PodDisruptionBudget and anti-affinity; one replica gets no budget."""

from __future__ import annotations

from typing import Any

from tests.unit.test_helm_chart import CHART, KUBE_VERSION, helm, of_kind, one, render, set_args

TWO = ("operator.replicas=2",)


def operator_container(docs: tuple[dict[str, Any], ...]) -> dict[str, Any]:
    pod = one(docs, "Deployment", "-operator")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    return dict(container)


def test_two_replicas_elect_a_leader_on_a_lease() -> None:
    docs = render(TWO)
    deploy = one(docs, "Deployment", "-operator")
    assert deploy["spec"]["replicas"] == 2
    assert deploy["spec"]["strategy"] == {"type": "Recreate"}  # never two versions at once
    container = operator_container(docs)
    assert "--leader-elect" in container["args"]
    env = {e["name"]: e for e in container["env"]}
    assert env["WEIGHTSHIP_LEADER_ELECT_LEASE"]["value"] == "ws-weightship-operator"
    assert env["POD_NAMESPACE"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    assert env["POD_ID"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    timings = [
        float(env[f"WEIGHTSHIP_LEADER_ELECT_{key}_S"]["value"])
        for key in ("RETRY_PERIOD", "RENEW_DEADLINE", "LEASE_DURATION")
    ]
    assert timings == [2, 10, 15] and timings == sorted(timings)  # controller-runtime's
    # The standby keeps its own liveness endpoint: the probe is the same for both.
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "healthz"}
    anti = deploy["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    (term,) = anti["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    selector = deploy["spec"]["selector"]["matchLabels"]
    assert term["podAffinityTerm"]["labelSelector"]["matchLabels"] == selector


def test_the_lease_rbac_is_one_namespaced_lease() -> None:
    docs = render(TWO)
    role = one(docs, "Role", "-leader-election")
    assert role["metadata"]["namespace"] == "weightship-system"
    assert role["rules"] == [
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
        {
            "apiGroups": ["coordination.k8s.io"],
            "resources": ["leases"],
            "resourceNames": ["ws-weightship-operator"],
            "verbs": ["get", "update"],
        },
    ]
    binding = one(docs, "RoleBinding", "-leader-election")
    assert binding["metadata"]["namespace"] == "weightship-system"
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": "ws-weightship-leader-election",
    }
    assert binding["subjects"] == [
        {
            "kind": "ServiceAccount",
            "name": "ws-weightship-operator",
            "namespace": "weightship-system",
        }
    ]
    # Nothing cluster-wide on leases.
    for cluster_role in of_kind(docs, "ClusterRole"):
        for rule in cluster_role["rules"]:
            assert "leases" not in rule["resources"], cluster_role["metadata"]["name"]


def test_a_budget_comes_with_more_than_one_replica() -> None:
    docs = render(TWO)
    pdb = one(docs, "PodDisruptionBudget", "-operator")
    assert pdb["apiVersion"] == "policy/v1"
    assert pdb["spec"]["maxUnavailable"] == 1
    deploy = one(docs, "Deployment", "-operator")
    assert pdb["spec"]["selector"]["matchLabels"] == deploy["spec"]["selector"]["matchLabels"]
    single = render(())
    assert not of_kind(single, "PodDisruptionBudget")  # it would block every drain
    assert "affinity" not in one(single, "Deployment", "-operator")["spec"]["template"]["spec"]
    assert one(single, "Role", "-leader-election")  # one replica elects itself too


def test_more_replicas_without_leader_election_do_not_render() -> None:
    for values in (
        (*TWO, "operator.leaderElection.enabled=false"),
        ("operator.leaderElection.renewDeadlineSeconds=15",),
    ):
        result = helm(
            "template", "ws", str(CHART), "--kube-version", KUBE_VERSION, *set_args(values),
            check=False,
        )  # fmt: skip
        assert result.returncode != 0, values
    off = render(("operator.leaderElection.enabled=false",))
    container = operator_container(off)
    assert "--leader-elect" not in container["args"]
    assert not [e for e in container["env"] if e["name"].startswith("WEIGHTSHIP_LEADER_ELECT")]
    assert not of_kind(off, "Role")  # no Lease access either


def test_two_replicas_lint() -> None:
    result = helm("lint", str(CHART), "--strict", *set_args(TWO))
    assert "0 chart(s) failed" in result.stdout
