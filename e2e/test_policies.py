"""The chart's ValidatingAdmissionPolicies, applied to the real API server: an agent's
pod-bound token may write only its own node's WeightCache (the token's node claim), and
the operator's cluster-wide writes change only its node labels, pod conditions, Service
selectors and HTTPRoute backend weights, and it touches only its own ReplicaSets. Each
policy matches only this test's service accounts (named after a release made for the
test), so other tests sharing the cluster are untouched."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from weightship.api.names import GROUP, VERSION
from weightship_dev import testkit
from weightship_dev.install import helm
from weightship_testing.samples import VALID_MANIFEST

NAMESPACE_PREFIX = "pol-"
CHART = "charts/weightship"
NODE_NAME_EXTRA = "authentication.kubernetes.io/node-name"


@dataclass
class Release:
    name: str
    namespace: str
    docs: list[dict[str, Any]]

    def named(self, kind: str, suffix: str) -> dict[str, Any]:
        found = [
            d for d in self.docs if d["kind"] == kind and d["metadata"]["name"].endswith(suffix)
        ]
        assert len(found) == 1, (kind, suffix)
        return found[0]


def render(cluster: Any, release: str, namespace: str) -> list[dict[str, Any]]:
    out = helm(
        cluster.paths, "template", release, CHART, "--namespace", namespace,
        "--kube-version", "1.34.0", "--set", f"operator.watchNamespaces={{{namespace}}}",
    )  # fmt: skip
    return [d for d in yaml.safe_load_all(out) if d]


def user_api(cluster: Any, token: str) -> client.ApiClient:
    """An API client that authenticates with ``token`` only (no client certificate)."""
    admin = cluster.api.configuration
    cfg = client.Configuration()
    cfg.host = admin.host
    cfg.ssl_ca_cert = admin.ssl_ca_cert
    cfg.api_key = {"authorization": f"Bearer {token}"}
    return client.ApiClient(cfg)


def token_for(core: client.CoreV1Api, namespace: str, sa: str, pod: Any | None = None) -> str:
    bound = (
        client.V1BoundObjectReference(
            kind="Pod", api_version="v1", name=pod.metadata.name, uid=pod.metadata.uid
        )
        if pod is not None
        else None
    )
    request = client.AuthenticationV1TokenRequest(
        spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=600, bound_object_ref=bound)
    )
    return str(core.create_namespaced_service_account_token(sa, namespace, request).status.token)


def refused(call: Callable[[], object], needle: str) -> str:
    with pytest.raises(ApiException) as caught:
        call()
    assert caught.value.status == 403, caught.value.body
    assert needle in caught.value.body, caught.value.body
    return str(caught.value.body)


@pytest.fixture
def release(cluster: Any, namespace: str, crds: None) -> Iterator[Release]:
    """The rendered chart's policies, bindings, service accounts and roles, applied."""
    name = testkit.unique_name("pol")
    docs = render(cluster, name, namespace)
    admission = client.AdmissionregistrationV1Api(cluster.api)
    rbac = client.RbacAuthorizationV1Api(cluster.api)
    wanted = {
        "ValidatingAdmissionPolicy": (
            admission.create_validating_admission_policy,
            admission.delete_validating_admission_policy,
        ),
        "ValidatingAdmissionPolicyBinding": (
            admission.create_validating_admission_policy_binding,
            admission.delete_validating_admission_policy_binding,
        ),
        "ClusterRole": (rbac.create_cluster_role, rbac.delete_cluster_role),
        "ClusterRoleBinding": (rbac.create_cluster_role_binding, rbac.delete_cluster_role_binding),
    }
    created: list[tuple[Callable[..., object], str]] = []
    try:
        for doc in docs:
            if doc["kind"] == "ServiceAccount":
                cluster.core.create_namespaced_service_account(namespace, doc)
            elif doc["kind"] in wanted:
                create, delete = wanted[doc["kind"]]
                create(doc)
                created.append((delete, doc["metadata"]["name"]))
        r = Release(name, namespace, docs)
        wait_until_type_checked(admission, r)
        yield r
    finally:
        for delete, obj_name in reversed(created):
            try:
                delete(obj_name)
            except ApiException as e:
                if e.status != 404:
                    raise


def wait_until_type_checked(admission: client.AdmissionregistrationV1Api, r: Release) -> None:
    """The API server type-checks each policy after it is created: no warnings wanted, and
    a short wait so the policies are in force (they load asynchronously)."""
    names = [d["metadata"]["name"] for d in r.docs if d["kind"] == "ValidatingAdmissionPolicy"]
    assert len(names) == 8
    deadline = time.monotonic() + 30
    while True:
        statuses = [admission.read_validating_admission_policy(n).status for n in names]
        if all(s is not None and s.observed_generation for s in statuses):
            break
        assert time.monotonic() < deadline, "policies never type-checked"
        time.sleep(0.5)
    for name, status in zip(names, statuses, strict=True):
        warnings = status.type_checking.expression_warnings if status.type_checking else None
        assert not warnings, (name, warnings)
    time.sleep(2)  # the admission plugin picks up new policies and bindings on its own loop


def weightcache(name: str, node: str) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "WeightCache",
        "metadata": {"name": name},
        "spec": {"nodeName": node},
    }


def agent_pod(cluster: Any, namespace: str, sa: str, node: str) -> Any:
    """A pod bound to ``node`` (KWOK fakes its running): its token carries the node."""
    body = {
        "metadata": {"name": "agent"},
        "spec": {
            "nodeName": node,
            "serviceAccountName": sa,
            "tolerations": [{"operator": "Exists"}],
            "containers": [{"name": "agent", "image": "weightship"}],
        },
    }
    return cluster.core.create_namespaced_pod(namespace, body)


def test_an_agent_writes_only_its_own_nodes_weightcache(cluster: Any, release: Release) -> None:
    own, other = cluster.kwok_nodes[:2]
    sa = release.named("ServiceAccount", "-agent")["metadata"]["name"]
    pod = agent_pod(cluster, release.namespace, sa, own)
    agent = client.CustomObjectsApi(
        user_api(cluster, token_for(cluster.core, release.namespace, sa, pod))
    )
    admin = client.CustomObjectsApi(cluster.api)
    # Names unique to this test, carried by nodes' caches: "own" is the node's own name,
    # so the caches are cleared first and restored by no one (agents of other tests
    # write their own process nodes' caches, never KWOK nodes').
    created = []
    try:
        for name in (own, other):
            try:
                admin.delete_cluster_custom_object(GROUP, VERSION, "weightcaches", name)
            except ApiException as e:
                if e.status != 404:
                    raise
        # Its own node's: admitted.
        agent.create_cluster_custom_object(GROUP, VERSION, "weightcaches", weightcache(own, own))
        created.append(own)
        agent.patch_cluster_custom_object_status(
            GROUP, VERSION, "weightcaches", own, {"status": {"peerEndpoint": "10.0.0.1:8479"}}
        )
        # Another node's: refused, on create, on its status, and on delete.
        refused(
            lambda: agent.create_cluster_custom_object(
                GROUP, VERSION, "weightcaches", weightcache(other, other)
            ),
            "only the WeightCache of its own node",
        )
        admin.create_cluster_custom_object(
            GROUP, VERSION, "weightcaches", weightcache(other, other)
        )
        created.append(other)
        refused(
            lambda: agent.patch_cluster_custom_object_status(
                GROUP, VERSION, "weightcaches", other, {"status": {"peerEndpoint": "6.6.6.6:1"}}
            ),
            "only the WeightCache of its own node",
        )
        # (Deleting is not in the agent's RBAC at all.)
        refused(
            lambda: agent.delete_cluster_custom_object(GROUP, VERSION, "weightcaches", other),
            "forbidden",
        )
        # Its own, claiming to be another node's: refused.
        refused(
            lambda: agent.patch_cluster_custom_object(
                GROUP, VERSION, "weightcaches", own, {"spec": {"nodeName": other}}
            ),
            "spec.nodeName must be its own node's name",
        )
        # A token not bound to a pod on a node carries no node claim: no write at all.
        unbound = client.CustomObjectsApi(
            user_api(cluster, token_for(cluster.core, release.namespace, sa))
        )
        refused(
            lambda: unbound.patch_cluster_custom_object_status(
                GROUP, VERSION, "weightcaches", own, {"status": {"peerEndpoint": "6.6.6.6:1"}}
            ),
            "its token names no node",
        )
        got = admin.get_cluster_custom_object(GROUP, VERSION, "weightcaches", other)
        assert "status" not in got or got["status"].get("peerEndpoint") != "6.6.6.6:1"
    finally:
        for name in created:
            admin.delete_cluster_custom_object(GROUP, VERSION, "weightcaches", name)


def test_the_operators_cluster_wide_writes_are_narrowed(cluster: Any, release: Release) -> None:
    sa = release.named("ServiceAccount", "-operator")["metadata"]["name"]
    agent_sa = release.named("ServiceAccount", "-agent")["metadata"]["name"]
    node = cluster.kwok_nodes[0]
    operator = client.CoreV1Api(user_api(cluster, token_for(cluster.core, release.namespace, sa)))
    label = f"staged.{GROUP}/{release.name[-16:]}"
    try:
        # Nodes: its staged label, yes; anything else, no.
        operator.patch_node(node, {"metadata": {"labels": {label: "true"}}})
        refused(
            lambda: operator.patch_node(node, {"metadata": {"labels": {"evil": "true"}}}),
            "only staged.weightship.io/* labels",
        )
        refused(lambda: operator.patch_node(node, {"spec": {"unschedulable": True}}), "labels")
        refused(
            lambda: operator.patch_node(node, {"metadata": {"annotations": {"x": "y"}}}), "labels"
        )
    finally:
        cluster.core.patch_node(node, {"metadata": {"labels": {label: None}}})

    # Pod status: the weights-verified condition, yes; the kubelet's conditions, no.
    pod = agent_pod(cluster, release.namespace, agent_sa, node)
    name, ns = pod.metadata.name, release.namespace
    mine = {"type": f"{GROUP}/weights-verified", "status": "True", "reason": "Verified"}
    operator.patch_namespaced_pod_status(
        name,
        ns,
        {"status": {"conditions": [mine]}, "metadata": {"annotations": {f"{GROUP}/x": "1"}}},
    )
    # A pod about to be deleted gets the lowest deletion cost (core/drain.py), and loses it.
    cost = "controller.kubernetes.io/pod-deletion-cost"
    operator.patch_namespaced_pod_status(name, ns, {"metadata": {"annotations": {cost: "-1"}}})
    operator.patch_namespaced_pod_status(name, ns, {"metadata": {"annotations": {cost: None}}})
    refused(
        lambda: operator.patch_namespaced_pod_status(
            name, ns, {"status": {"conditions": [{"type": "example.com/evil", "status": "True"}]}}
        ),
        "only weightship.io/* conditions",
    )
    refused(
        lambda: operator.patch_namespaced_pod_status(
            name, ns, {"metadata": {"annotations": {"other": "1"}}}
        ),
        "only weightship.io/* annotations",
    )
    # Its revision-hash label (an in-place swap moves a pod to its new revision), yes;
    # any other label, no. Deleting a pod that is not a ModelRollout's, no.
    operator.patch_namespaced_pod_status(
        name, ns, {"metadata": {"labels": {f"{GROUP}/revision-hash": "h2"}}}
    )
    refused(
        lambda: operator.patch_namespaced_pod_status(
            name, ns, {"metadata": {"labels": {"app": "evil"}}}
        ),
        "only the weightship.io/revision-hash label",
    )
    refused(lambda: operator.delete_namespaced_pod(name, ns), "only pods of a ModelRollout")

    # Services: the selector, moved to a revision, yes; ports or a foreign selector, no.
    cluster.core.create_namespaced_service(
        ns,
        {
            "metadata": {"name": "llm"},
            "spec": {"selector": {"app": "llm"}, "ports": [{"port": 80, "targetPort": 8000}]},
        },
    )
    selector = {"app": "llm", f"{GROUP}/revision-hash": "abc123"}
    operator.patch_namespaced_service(
        "llm", ns, [{"op": "replace", "path": "/spec/selector", "value": selector}]
    )
    refused(
        lambda: operator.patch_namespaced_service(
            "llm",
            ns,
            [{"op": "replace", "path": "/spec/ports", "value": [{"port": 22, "targetPort": 22}]}],
        ),
        "only a Service's spec.selector",
    )
    refused(
        lambda: operator.patch_namespaced_service(
            "llm", ns, [{"op": "replace", "path": "/spec/selector", "value": {"app": "db"}}]
        ),
        "only at a rollout revision",
    )


def route(namespace: str) -> dict[str, Any]:
    backends = [{"name": "llm-stable", "port": 80, "weight": 100},
                {"name": "llm-canary", "port": 80, "weight": 0}]  # fmt: skip
    return {
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "HTTPRoute",
        "metadata": {"name": "llm", "namespace": namespace},
        "spec": {
            "parentRefs": [{"name": "gw"}],
            "hostnames": ["llm.example.com"],
            "rules": [
                {
                    "matches": [{"path": {"type": "PathPrefix", "value": "/v1"}}],
                    "backendRefs": backends,
                }
            ],
        },
    }


def test_the_operator_changes_only_an_httproutes_weights(cluster: Any, release: Release) -> None:
    """kube.set_route_weights replaces the route with new weights: that, and nothing else."""
    sa = release.named("ServiceAccount", "-operator")["metadata"]["name"]
    operator = client.CustomObjectsApi(
        user_api(cluster, token_for(cluster.core, release.namespace, sa))
    )
    admin = client.CustomObjectsApi(cluster.api)
    ns, gw = release.namespace, ("gateway.networking.k8s.io", "v1")
    admin.create_namespaced_custom_object(*gw, ns, "httproutes", route(ns))

    def replace(change: Callable[[dict[str, Any]], None]) -> object:
        body = operator.get_namespaced_custom_object(*gw, ns, "httproutes", "llm")
        change(body)
        return operator.replace_namespaced_custom_object(*gw, ns, "httproutes", "llm", body)

    def refs(body: dict[str, Any]) -> list[dict[str, Any]]:
        return list(body["spec"]["rules"][0]["backendRefs"])

    def weights(stable: int, canary: int) -> Callable[[dict[str, Any]], None]:
        def change(body: dict[str, Any]) -> None:
            refs(body)[0]["weight"], refs(body)[1]["weight"] = stable, canary

        return change

    replace(weights(90, 10))
    got = admin.get_namespaced_custom_object(*gw, ns, "httproutes", "llm")
    assert [r["weight"] for r in refs(got)] == [90, 10]
    needle = "only the backend weights of an HTTPRoute"
    hostile: list[Callable[[dict[str, Any]], None]] = [
        lambda b: refs(b)[1].update(name="db"),  # send the canary share to another Service
        lambda b: refs(b)[1].update(namespace="kube-system"),
        lambda b: refs(b)[1].update(port=22),
        lambda b: b["spec"]["rules"][0]["backendRefs"].append({"name": "x", "port": 80}),
        lambda b: b["spec"]["rules"][0].update(
            filters=[
                {
                    "type": "RequestMirror",
                    "requestMirror": {"backendRef": {"name": "spy", "port": 80}},
                }
            ]
        ),
        lambda b: b["spec"]["rules"][0]["matches"][0]["path"].update(value="/"),
        lambda b: b["spec"]["rules"].append({"backendRefs": [{"name": "x", "port": 80}]}),
        lambda b: b["spec"].update(parentRefs=[{"name": "public-gw"}]),
        lambda b: b["spec"].update(hostnames=["evil.example.com"]),
        lambda b: b["metadata"].setdefault("labels", {}).update(x="y"),
    ]
    for change in hostile:
        refused(lambda change=change: replace(change), needle)  # type: ignore[misc]
    # The admin (anyone but the operator) is not fenced.
    body = admin.get_namespaced_custom_object(*gw, ns, "httproutes", "llm")
    body["spec"]["hostnames"] = ["other.example.com"]
    admin.replace_namespaced_custom_object(*gw, ns, "httproutes", "llm", body)


def test_the_operator_touches_only_its_own_replicasets(cluster: Any, release: Release) -> None:
    sa = release.named("ServiceAccount", "-operator")["metadata"]["name"]
    operator = client.AppsV1Api(user_api(cluster, token_for(cluster.core, release.namespace, sa)))
    admin = client.AppsV1Api(cluster.api)
    ns = release.namespace
    rollout = copy.deepcopy(VALID_MANIFEST)
    rollout["metadata"] = {"name": "llm"}
    owner = client.CustomObjectsApi(cluster.api).create_namespaced_custom_object(
        GROUP, VERSION, ns, "modelrollouts", rollout
    )

    def replica_set(name: str, *, mine: bool) -> dict[str, Any]:
        labels = {"app": name, **({f"{GROUP}/rollout": "llm"} if mine else {})}
        meta: dict[str, Any] = {"name": name, "labels": labels}
        if mine:
            meta["ownerReferences"] = [
                {"apiVersion": owner["apiVersion"], "kind": "ModelRollout", "name": "llm",
                 "uid": owner["metadata"]["uid"], "controller": True}
            ]  # fmt: skip
        containers = [{"name": "c", "image": "x"}]
        pod = {"metadata": {"labels": labels}, "spec": {"containers": containers}}
        spec = {"replicas": 0, "selector": {"matchLabels": labels}, "template": pod}
        return {"metadata": meta, "spec": spec}

    needle = "only ReplicaSets of a ModelRollout"
    operator.create_namespaced_replica_set(ns, replica_set("mine", mine=True))
    operator.patch_namespaced_replica_set("mine", ns, {"spec": {"replicas": 1}})
    refused(
        lambda: operator.create_namespaced_replica_set(ns, replica_set("stray", mine=False)),
        needle,
    )
    admin.create_namespaced_replica_set(ns, replica_set("foreign", mine=False))
    refused(
        lambda: operator.patch_namespaced_replica_set("foreign", ns, {"spec": {"replicas": 5}}),
        needle,
    )
    adopt = {"metadata": {"labels": {f"{GROUP}/rollout": "llm"}}}
    refused(lambda: operator.patch_namespaced_replica_set("foreign", ns, adopt), needle)
    refused(lambda: operator.delete_namespaced_replica_set("foreign", ns), needle)
    # Dropping the owner from its own is a change to a ReplicaSet that is no longer its.
    orphan = [{"op": "remove", "path": "/metadata/ownerReferences"}]
    refused(lambda: operator.patch_namespaced_replica_set("mine", ns, orphan), needle)
    operator.delete_namespaced_replica_set("mine", ns)
