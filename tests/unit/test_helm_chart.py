"""The Helm chart in charts/weightship, linted and rendered by the real helm binary.

helm comes from `make deps` (hack/deps.sh builds it into ~/.cache/weightship/bin), and so
does kubeconform, with schemas made from the Kubernetes OpenAPI, which lints the rendered
chart. Without them these tests fail rather than skip, so a green run always means the
chart was rendered and linted.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "weightship"
CACHE = Path(os.environ.get("WEIGHTSHIP_CACHE", Path.home() / ".cache" / "weightship"))
HELM = CACHE / "bin" / "helm"
KUBECONFORM = CACHE / "bin" / "kubeconform"  # and its schemas: `bash hack/deps.sh kubeconform`
SCHEMAS = CACHE / "kubeconform-schemas"
KUBE_VERSION = "1.34.0"
DEFAULT: tuple[str, ...] = ()
EXTRAS = ("serviceMonitor.enabled=true", "operator.peering.enabled=true")
SCOPED = ("operator.watchNamespaces={serving,ml}",)
SCENARIOS = {"default": DEFAULT, "extras": EXTRAS, "scoped": SCOPED, "all": EXTRAS + SCOPED}


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    if not HELM.is_file():
        pytest.fail(f"helm not found at {HELM}: run `make deps` (or `bash hack/deps.sh helm`)")
    result = subprocess.run([str(HELM), *args], capture_output=True, text=True, timeout=120)
    if check and result.returncode != 0:
        pytest.fail(f"helm {' '.join(args)} failed:\n{result.stdout}{result.stderr}")
    return result


def set_args(values: tuple[str, ...]) -> list[str]:
    return [arg for value in values for arg in ("--set", value)]


@cache
def render(values: tuple[str, ...]) -> tuple[dict[str, Any], ...]:
    out = helm(
        "template", "ws", str(CHART), "--namespace", "weightship-system",
        "--kube-version", KUBE_VERSION, *set_args(values),
    ).stdout  # fmt: skip
    return tuple(doc for doc in yaml.safe_load_all(out) if doc)


def of_kind(docs: tuple[dict[str, Any], ...], kind: str) -> list[dict[str, Any]]:
    return [doc for doc in docs if doc["kind"] == kind]


def one(docs: tuple[dict[str, Any], ...], kind: str, suffix: str = "") -> dict[str, Any]:
    found = [d for d in of_kind(docs, kind) if d["metadata"]["name"].endswith(suffix)]
    assert len(found) == 1, f"expected one {kind} *{suffix}, got {len(found)}"
    return found[0]


def containers(docs: tuple[dict[str, Any], ...]) -> Iterator[tuple[dict, dict]]:
    for doc in docs:
        if doc["kind"] in ("Deployment", "DaemonSet", "StatefulSet", "Job"):
            pod = doc["spec"]["template"]["spec"]
            for container in pod.get("initContainers", []) + pod["containers"]:
                yield pod, container


def rules(docs: tuple[dict[str, Any], ...], kind: str, suffix: str) -> list[dict[str, Any]]:
    return [r for d in of_kind(docs, kind) if d["metadata"]["name"].endswith(suffix)
            for r in d["rules"]]  # fmt: skip


def allows(rule: dict[str, Any], group: str, resource: str, verb: str) -> bool:
    return group in rule["apiGroups"] and resource in rule["resources"] and verb in rule["verbs"]


@pytest.mark.parametrize("values", [DEFAULT, EXTRAS + SCOPED], ids=["default", "all"])
def test_lint(values: tuple[str, ...]) -> None:
    result = helm("lint", str(CHART), "--strict", *set_args(values))
    assert "0 chart(s) failed" in result.stdout


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_container_is_locked_down(scenario: str) -> None:
    docs = render(SCENARIOS[scenario])
    found = list(containers(docs))
    assert len(found) == 2  # operator and agent
    for pod, container in found:
        ctx = container["securityContext"]
        pod_ctx = pod.get("securityContext", {})
        name = container["name"]
        assert ctx.get("runAsNonRoot", pod_ctx.get("runAsNonRoot")) is True, name
        assert ctx.get("runAsUser", pod_ctx.get("runAsUser")) not in (None, 0), name
        assert ctx["readOnlyRootFilesystem"] is True, name
        assert ctx["allowPrivilegeEscalation"] is False, name
        assert ctx["capabilities"]["drop"] == ["ALL"], name
        assert "add" not in ctx["capabilities"], name
        seccomp = ctx.get("seccompProfile", pod_ctx.get("seccompProfile"))
        assert seccomp == {"type": "RuntimeDefault"}, name
        assert not pod.get("hostNetwork") and not pod.get("hostPID"), name
        tmp = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}.get("/tmp")
        assert {"name": tmp, "emptyDir": {"sizeLimit": "256Mi"}} in pod["volumes"], name


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_rbac_is_least_privilege(scenario: str) -> None:
    docs = render(SCENARIOS[scenario])
    all_rules = [r for kind in ("ClusterRole", "Role") for r in rules(docs, kind, "")]
    assert all_rules
    for rule in all_rules:
        for key in ("apiGroups", "resources", "verbs", "resourceNames"):
            assert not any("*" in item for item in rule.get(key, [])), rule
        assert "nonResourceURLs" not in rule, rule
    operator = rules(docs, "ClusterRole", "-operator")
    deletes = {(g, r) for rule in operator if "delete" in rule["verbs"]
               for g in rule["apiGroups"] for r in rule["resources"]}  # fmt: skip
    # Pods: only a rollout's own (the operator-own-pods admission policy), to restart one
    # whose in-place swap back failed.
    assert deletes == {("apps", "replicasets"), ("", "pods")}
    # Nobody may change or list Secrets; the operator creates its seeding keys, and only
    # where the policy that allows no other Secret is installed.
    policies = {d["metadata"]["name"] for d in of_kind(docs, "ValidatingAdmissionPolicy")}
    seeding_policy = any(name.endswith("-operator-seeding-key") for name in policies)
    for rule in all_rules:
        if "secrets" in rule["resources"]:
            assert rule["verbs"] == (["get", "create"] if seeding_policy else ["get"]), rule
    required = [
        ("weightship.io", "modelrollouts/status", "patch"),
        ("weightship.io", "modelrollouts/finalizers", "update"),
        ("weightship.io", "weightcaches", "watch"),
        ("apps", "replicasets", "create"),
        ("", "pods/status", "patch"),
        ("", "nodes", "patch"),
        ("", "events", "create"),
        ("events.k8s.io", "events", "create"),
        ("gateway.networking.k8s.io", "httproutes", "patch"),
    ]
    for need in required:
        assert any(allows(rule, *need) for rule in operator), need
    assert not any(allows(r, "weightship.io", "weightcaches", "patch") for r in operator)
    agent = rules(docs, "ClusterRole", "-agent")
    for need in [
        ("weightship.io", "weightcaches", "create"),
        ("weightship.io", "weightcaches/status", "patch"),
        ("weightship.io", "modelrollouts", "watch"),
        ("", "nodes", "get"),
    ]:
        assert any(allows(rule, *need) for rule in agent), need
    assert not any(allows(r, "weightship.io", "modelrollouts", "patch") for r in agent)


def test_secrets_are_namespaced_when_namespaces_are() -> None:
    cluster_wide = rules(render(DEFAULT), "ClusterRole", "-operator")
    assert any(allows(r, "", "secrets", "get") for r in cluster_wide)
    docs = render(SCOPED)
    assert not any(allows(r, "", "secrets", "get") for r in rules(docs, "ClusterRole", ""))
    roles = [r for r in of_kind(docs, "Role") if r["metadata"]["name"].endswith("-secrets")]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["ml", "serving"]
    for binding in of_kind(docs, "RoleBinding"):
        subjects = {s["name"] for s in binding["subjects"]}
        assert subjects == {"ws-weightship-operator"}


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_workload_deployments_are_only_resized(scenario: str) -> None:
    """spec.workloadRef: the operator may change a Deployment's size (deployments/scale)
    and nothing else of it, in the watched namespaces only when those are set."""
    docs = render(SCENARIOS[scenario])
    scoped = "operator.watchNamespaces={serving,ml}" in SCENARIOS[scenario]
    everything = [r for kind in ("ClusterRole", "Role") for r in rules(docs, kind, "")]
    for verb in ("patch", "update", "create", "delete"):
        assert not any(allows(r, "apps", "deployments", verb) for r in everything), verb
    cluster_wide = rules(docs, "ClusterRole", "-operator")
    assert any(allows(r, "apps", "deployments/scale", "patch") for r in cluster_wide) != scoped
    roles = [r for r in of_kind(docs, "Role") if r["metadata"]["name"].endswith("-workloads")]
    assert sorted(r["metadata"]["namespace"] for r in roles) == (
        ["ml", "serving"] if scoped else []
    )
    for role in roles:
        assert role["rules"] == [
            {"apiGroups": ["apps"], "resources": ["deployments/scale"], "verbs": ["patch"]}
        ]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_the_agent_has_no_secret_access_at_all(scenario: str) -> None:
    """A node's agent token reads no tenant's Secret (issue 12, High 4): no verb on
    secrets in any ClusterRole or Role the agent's service account is bound to."""
    docs = render(SCENARIOS[scenario])
    agent = "ws-weightship-agent"
    bound = {
        (b["kind"], b["roleRef"]["kind"], b["roleRef"]["name"], b["metadata"].get("namespace"))
        for b in of_kind(docs, "ClusterRoleBinding") + of_kind(docs, "RoleBinding")
        if any(s["kind"] == "ServiceAccount" and s["name"] == agent for s in b["subjects"])
    }
    assert bound, "the agent is bound to its ClusterRole"
    for _binding, role_kind, role_name, namespace in bound:
        (role,) = [
            d for d in of_kind(docs, role_kind)
            if d["metadata"]["name"] == role_name and d["metadata"].get("namespace") == namespace
        ]  # fmt: skip
        for rule in role["rules"]:
            assert "secrets" not in rule["resources"], (role_name, rule)
    # Its S3 credential is a mounted Secret of its own namespace, read as files.
    custom = render(SCENARIOS[scenario] + ("agent.s3.existingSecret=agent-s3",))
    pod = one(custom, "DaemonSet", "-agent")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    volume = next(v for v in pod["volumes"] if v["name"] == "s3-credentials")
    assert volume["secret"]["secretName"] == "agent-s3"
    mount = next(m for m in container["volumeMounts"] if m["name"] == "s3-credentials")
    assert mount["readOnly"] is True
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["WEIGHTSHIP_S3_CREDENTIALS_DIR"] == mount["mountPath"]
    default_pod = one(docs, "DaemonSet", "-agent")["spec"]["template"]["spec"]
    assert not [v for v in default_pod["volumes"] if "secret" in v]


def test_operator_deployment() -> None:
    deploy = one(render(DEFAULT), "Deployment", "-operator")
    spec = deploy["spec"]
    assert spec["replicas"] == 1
    assert spec["strategy"] == {"type": "Recreate"}
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == f"ghcr.io/weightship/weightship:{chart()['appVersion']}"
    assert container["imagePullPolicy"] == "IfNotPresent"
    assert container["args"] == [
        "operator",
        "--liveness=http://0.0.0.0:8080/healthz",
        "--standalone",
        "--leader-elect",
    ]
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "healthz"}
    assert "readinessProbe" not in container
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"healthz": 8080, "metrics": 9100}
    env = {e["name"]: e for e in container["env"]}
    assert env["WEIGHTSHIP_METRICS_PORT"]["value"] == "9100"
    # Rollout pods' model mounts are under the agents' cache, not a rollout's choice.
    assert env["WEIGHTSHIP_CACHE_DIR"]["value"] == "/var/cache/weightship"
    custom = one(render(("agent.cacheDir=/mnt/nvme/ws",)), "Deployment", "-operator")
    custom_env = {e["name"]: e for e in custom["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert custom_env["WEIGHTSHIP_CACHE_DIR"]["value"] == "/mnt/nvme/ws"
    assert env["POD_ID"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    scoped = one(render(SCOPED + EXTRAS), "Deployment", "-operator")
    args = scoped["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[2:] == ["--namespace=serving", "--namespace=ml", "--leader-elect"]


def test_agent_daemonset() -> None:
    docs = render(DEFAULT)
    ds = one(docs, "DaemonSet", "-agent")
    pod = ds["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["args"] == ["agent"]
    env = {e["name"]: e.get("valueFrom", e.get("value")) for e in container["env"]}
    assert env["NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert env["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env["WEIGHTSHIP_CACHE_DIR"] == "/var/cache/weightship"
    assert {"name": "peer", "containerPort": 8479, "protocol": "TCP"} in container["ports"]
    cache_volume = next(v for v in pod["volumes"] if v["name"] == "cache")
    assert cache_volume["hostPath"] == {
        "path": "/var/cache/weightship",
        "type": "DirectoryOrCreate",
    }
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts["cache"] == "/var/cache/weightship"
    assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsUser"] == 65532
    assert pod["serviceAccountName"] == "ws-weightship-agent"
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert "WEIGHTSHIP_PEER_GROUP" not in env  # every agent of the cluster is a peer
    custom = render(
        (
            "agent.cacheDir=/mnt/nvme/ws",
            "agent.nodeSelector.gpu=h100",
            "agent.tolerations[0].operator=Exists",
            "agent.peerGroup=zone-a",
        )
    )
    pod = one(custom, "DaemonSet")["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert env["WEIGHTSHIP_PEER_GROUP"] == "zone-a"
    assert pod["nodeSelector"] == {"gpu": "h100"}
    assert pod["tolerations"] == [{"operator": "Exists"}]
    assert (
        next(v for v in pod["volumes"] if v["name"] == "cache")["hostPath"]["path"]
        == "/mnt/nvme/ws"
    )


def test_optional_parts() -> None:
    docs = render(DEFAULT)
    assert not of_kind(docs, "ServiceMonitor")
    assert not of_kind(docs, "CustomResourceDefinition")
    service = one(docs, "Service", "-metrics")
    assert service["spec"]["ports"][0]["port"] == 9100
    deploy = one(docs, "Deployment", "-operator")
    assert service["spec"]["selector"] == deploy["spec"]["selector"]["matchLabels"]
    extras = render(EXTRAS)
    monitor = one(extras, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    crds = {c["metadata"]["name"] for c in of_kind(extras, "CustomResourceDefinition")}
    assert crds == {"clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev"}
    peering = one(extras, "ClusterKopfPeering")
    assert peering["metadata"]["name"] == "weightship"  # kopf's settings.peering.name
    assert "post-install" in peering["metadata"]["annotations"]["helm.sh/hook"]
    assert (
        "--standalone"
        not in one(extras, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    )
    operator = rules(extras, "ClusterRole", "-operator")
    assert any(allows(r, "kopf.dev", "clusterkopfpeerings", "patch") for r in operator)
    namespaced = render(EXTRAS + SCOPED)
    assert {p["metadata"]["namespace"] for p in of_kind(namespaced, "KopfPeering")} == {
        "serving",
        "ml",
    }
    assert not of_kind(namespaced, "ClusterKopfPeering")


def test_values_schema_rejects_unknown_keys() -> None:
    for bogus in (
        "bogus=1",
        "operator.bogus=1",
        "agent.serviceAccount.bogus=1",
        "podMonitor.bogus=1",
        "agent.cacheInit.bogus=1",
        "image.bogus=1",
    ):
        result = helm(
            "template", "ws", str(CHART), "--kube-version", KUBE_VERSION, "--set", bogus,
            check=False,
        )  # fmt: skip
        assert result.returncode != 0, bogus
        assert "additional properties" in result.stderr, result.stderr
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert schema["$schema"] == "http://json-schema.org/draft-07/schema#"


def test_chart_metadata_and_crds() -> None:
    meta = chart()
    assert (meta["apiVersion"], meta["name"], meta["version"], meta["appVersion"]) == (
        "v2",
        "weightship",
        "0.1.0",
        "0.1.0",
    )
    chart_crds = sorted(p.name for p in (CHART / "crds").iterdir())
    assert chart_crds == sorted(p.name for p in (ROOT / "crds").glob("*.yaml"))
    for name in chart_crds:
        assert (CHART / "crds" / name).read_bytes() == (ROOT / "crds" / name).read_bytes(), name


def chart() -> dict[str, Any]:
    return yaml.safe_load((CHART / "Chart.yaml").read_text())


def policy_pairs(docs: tuple[dict[str, Any], ...]) -> dict[str, dict[str, Any]]:
    """Each ValidatingAdmissionPolicy by name, checked to have a Deny binding."""
    policies = {p["metadata"]["name"]: p for p in of_kind(docs, "ValidatingAdmissionPolicy")}
    bindings = of_kind(docs, "ValidatingAdmissionPolicyBinding")
    assert {b["spec"]["policyName"] for b in bindings} == set(policies)
    for binding in bindings:
        assert binding["spec"]["validationActions"] == ["Deny"]
    for policy in policies.values():
        assert policy["apiVersion"] == "admissionregistration.k8s.io/v1"
        assert policy["spec"]["failurePolicy"] == "Fail"
    return policies


def matched(policy: dict[str, Any]) -> set[tuple[str, str, str]]:
    return {
        (group, resource, op)
        for rule in policy["spec"]["matchConstraints"]["resourceRules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for op in rule["operations"]
    }


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_admission_policies_fence_the_agents_and_the_operators_writes(scenario: str) -> None:
    docs = render(SCENARIOS[scenario])
    policies = policy_pairs(docs)
    agent = policies["ws-weightship-agent-own-weightcache"]
    assert agent["spec"]["matchConditions"][0]["expression"] == (
        'request.userInfo.username == "system:serviceaccount:weightship-system:ws-weightship-agent"'
    )
    assert "authentication.kubernetes.io/node-name" in agent["spec"]["variables"][0]["expression"]
    # Every WeightCache write the agent's RBAC allows is under the node-claim policy.
    for rule in rules(docs, "ClusterRole", "-agent"):
        for resource in rule["resources"]:
            if resource.startswith("weightcaches"):
                for verb in set(rule["verbs"]) & {"create", "patch", "update", "delete"}:
                    op = {"patch": "UPDATE", "update": "UPDATE"}.get(verb, verb.upper())
                    assert ("weightship.io", resource, op) in matched(agent), (resource, verb)
    # Every cluster-wide patch the operator has on core objects is narrowed by a policy
    # that matches the operator's own service account.
    operator_user = "system:serviceaccount:weightship-system:ws-weightship-operator"
    narrowed = {
        key
        for p in policies.values()
        if operator_user in p["spec"]["matchConditions"][0]["expression"]
        for key in matched(p)
    }
    for rule in rules(docs, "ClusterRole", "-operator"):
        if {"patch", "update"} & set(rule["verbs"]):
            for group in rule["apiGroups"]:
                if group in ("weightship.io", "kopf.dev", "events.k8s.io"):
                    continue  # its own kinds: rollouts, peering, Events
                # Events: their counts. deployments/scale: a Scale carries nothing but the
                # replica count, so the subresource is itself the narrowing.
                for resource in set(rule["resources"]) - {"events", "deployments/scale"}:
                    assert (group, resource, "UPDATE") in narrowed, (group, resource)
    assert ("gateway.networking.k8s.io", "httproutes", "UPDATE") in narrowed
    # ReplicaSets, the one kind it creates and deletes anywhere: only its own.
    assert {("apps", "replicasets", op) for op in ("CREATE", "UPDATE", "DELETE")} <= narrowed
    assert ("", "pods", "DELETE") in narrowed
    assert not policy_pairs(render(("admissionPolicies.enabled=false",)))


def test_network_policy_fences_the_peer_port_to_agents() -> None:
    docs = render(DEFAULT)
    agent_pods = one(docs, "DaemonSet", "-agent")["spec"]["selector"]["matchLabels"]
    policy = one(docs, "NetworkPolicy", "-agent")
    assert policy["spec"]["podSelector"]["matchLabels"] == agent_pods
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    peer, metrics = policy["spec"]["ingress"]
    assert peer["ports"] == [{"port": 8479, "protocol": "TCP"}]
    assert peer["from"] == [{"podSelector": {"matchLabels": agent_pods}}]
    assert metrics == {"ports": [{"port": 9101, "protocol": "TCP"}]}
    # No rollout namespaces named: no policy in tenants' namespaces.
    assert len(of_kind(docs, "NetworkPolicy")) == 1
    scoped = render(("networkPolicy.rolloutNamespaces={serving}", "agent.peerPort=9000"))
    seeding = one(scoped, "NetworkPolicy", "-rollout-seeding")
    assert seeding["metadata"]["namespace"] == "serving"
    rollout_pods = {"matchExpressions": [{"key": "weightship.io/rollout", "operator": "Exists"}]}
    assert seeding["spec"]["podSelector"] == rollout_pods
    serving, peers = seeding["spec"]["ingress"]
    assert serving == {"ports": [{"port": 8000, "protocol": "TCP"}]}
    assert peers == {"from": [{"podSelector": rollout_pods}]}
    assert one(scoped, "NetworkPolicy", "-agent")["spec"]["ingress"][0]["ports"][0]["port"] == 9000
    assert not of_kind(render(("networkPolicy.enabled=false",)), "NetworkPolicy")


# ---- Extension points and kube-prometheus-stack (issue 40) ---------------------------------

DIGEST = "sha256:" + "ab" * 32


def pod_spec(docs: tuple[dict[str, Any], ...], kind: str, suffix: str) -> dict[str, Any]:
    return dict(one(docs, kind, suffix)["spec"]["template"]["spec"])


def test_an_image_digest_pins_every_container() -> None:
    docs = render((f"image.digest={DIGEST}", "image.tag=ignored", "agent.cacheInit.enabled=true"))
    images = [c["image"] for _, c in containers(docs)]
    assert len(images) == 3  # operator, agent and the cache init container
    assert set(images) == {f"ghcr.io/weightship/weightship@{DIGEST}"}
    result = helm(
        "template", "ws", str(CHART), "--kube-version", KUBE_VERSION,
        "--set", "image.digest=latest", check=False,
    )  # fmt: skip
    assert result.returncode != 0 and "/image/digest" in result.stderr


def test_extra_volumes_and_mounts_for_operator_and_agent() -> None:
    """e.g. a private S3 endpoint's CA from a ConfigMap, beside the chart's own volumes."""
    values = tuple(
        f"{who}.{key}"
        for who in ("operator", "agent")
        for key in (
            "extraVolumes[0].name=s3-ca",
            "extraVolumes[0].configMap.name=corp-ca",
            "extraVolumeMounts[0].name=s3-ca",
            "extraVolumeMounts[0].mountPath=/etc/ssl/corp",
            "extraVolumeMounts[0].readOnly=true",
        )
    )
    docs = render(values)
    for kind, suffix in (("Deployment", "-operator"), ("DaemonSet", "-agent")):
        pod = pod_spec(docs, kind, suffix)
        assert {"name": "s3-ca", "configMap": {"name": "corp-ca"}} in pod["volumes"]
        assert any(v["name"] == "tmp" for v in pod["volumes"])  # the chart's own stay
        (container,) = pod["containers"]
        mount = {"name": "s3-ca", "mountPath": "/etc/ssl/corp", "readOnly": True}
        assert mount in container["volumeMounts"]
        assert any(m["mountPath"] == "/tmp" for m in container["volumeMounts"])
    default = render(DEFAULT)
    for kind, suffix in (("Deployment", "-operator"), ("DaemonSet", "-agent")):
        assert not [v for v in pod_spec(default, kind, suffix)["volumes"] if "configMap" in v]


def test_topology_spread_constraints_select_the_operator_pods_by_default() -> None:
    docs = render(
        (
            "operator.replicas=2",
            "operator.topologySpreadConstraints[0].maxSkew=1",
            "operator.topologySpreadConstraints[0].topologyKey=topology.kubernetes.io/zone",
            "operator.topologySpreadConstraints[0].whenUnsatisfiable=ScheduleAnyway",
            "operator.topologySpreadConstraints[1].maxSkew=1",
            "operator.topologySpreadConstraints[1].topologyKey=kubernetes.io/hostname",
            "operator.topologySpreadConstraints[1].whenUnsatisfiable=DoNotSchedule",
            "operator.topologySpreadConstraints[1].labelSelector.matchLabels.team=ml",
        )
    )
    deploy = one(docs, "Deployment", "-operator")
    zone, host = deploy["spec"]["template"]["spec"]["topologySpreadConstraints"]
    assert zone == {
        "maxSkew": 1,
        "topologyKey": "topology.kubernetes.io/zone",
        "whenUnsatisfiable": "ScheduleAnyway",
        "labelSelector": {"matchLabels": deploy["spec"]["selector"]["matchLabels"]},
    }
    assert host["labelSelector"] == {"matchLabels": {"team": "ml"}}  # the user's, as given
    assert "topologySpreadConstraints" not in pod_spec(render(DEFAULT), "Deployment", "-operator")


def test_pod_annotations_and_labels() -> None:
    values = tuple(
        f"{who}.{key}"
        for who in ("operator", "agent")
        for key in ("podAnnotations.example\\.com/owner=ml-platform", "podLabels.team=ml")
    )
    docs = render(values)
    for kind, suffix in (("Deployment", "-operator"), ("DaemonSet", "-agent")):
        workload = one(docs, kind, suffix)
        meta = workload["spec"]["template"]["metadata"]
        assert meta["annotations"] == {"example.com/owner": "ml-platform"}
        assert meta["labels"]["team"] == "ml"
        # Selectors stay the chart's: a label value cannot orphan the pods.
        assert "team" not in workload["spec"]["selector"]["matchLabels"]


def test_agent_probes_use_the_peer_servers_healthz() -> None:
    (container,) = pod_spec(render(DEFAULT), "DaemonSet", "-agent")["containers"]
    ports = {p["name"] for p in container["ports"]}
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "peer"}, probe
        assert container[probe]["httpGet"]["port"] in ports
    # Liveness gives a busy peer server two minutes before a restart.
    liveness = container["livenessProbe"]
    assert liveness["periodSeconds"] * liveness["failureThreshold"] >= 120
    tuned = pod_spec(render(("agent.readinessProbe.periodSeconds=3",)), "DaemonSet", "-agent")
    assert tuned["containers"][0]["readinessProbe"]["periodSeconds"] == 3


def test_the_cache_init_container_chowns_only_the_cache_dir_with_chown_alone() -> None:
    assert "initContainers" not in pod_spec(render(DEFAULT), "DaemonSet", "-agent")
    docs = render(
        (
            "agent.cacheInit.enabled=true",
            "agent.cacheDir=/mnt/nvme/ws",
            "agent.podSecurityContext.runAsUser=1001",
            "agent.podSecurityContext.runAsGroup=2002",
        )
    )
    pod = pod_spec(docs, "DaemonSet", "-agent")
    (init,) = pod["initContainers"]
    assert init["command"] == ["chown", "1001:2002", "/mnt/nvme/ws"]  # not -R: its contents
    assert init["volumeMounts"] == [{"name": "cache", "mountPath": "/mnt/nvme/ws"}]
    ctx = init["securityContext"]
    assert ctx["runAsUser"] == 0 and ctx["runAsNonRoot"] is False
    assert ctx["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}
    assert ctx["readOnlyRootFilesystem"] is True and ctx["allowPrivilegeEscalation"] is False
    assert ctx["seccompProfile"] == {"type": "RuntimeDefault"}
    (agent,) = pod["containers"]
    assert agent["securityContext"]["runAsNonRoot"] is True  # the agent itself is unchanged


def test_a_pod_monitor_for_the_agents() -> None:
    assert not of_kind(render(DEFAULT), "PodMonitor")
    docs = render(
        (
            "podMonitor.enabled=true",
            "podMonitor.labels.release=kps",
            "podMonitor.relabelings[0].targetLabel=cluster",
            "podMonitor.relabelings[0].replacement=gpu-east",
            "podMonitor.metricRelabelings[0].action=drop",
            "podMonitor.metricRelabelings[0].sourceLabels[0]=__name__",
            "podMonitor.metricRelabelings[0].regex=python_gc_.*",
        )
    )
    monitor = one(docs, "PodMonitor", "-agent")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "kps"
    ds = one(docs, "DaemonSet", "-agent")
    assert monitor["spec"]["selector"]["matchLabels"] == ds["spec"]["selector"]["matchLabels"]
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["weightship-system"]}
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    (container,) = ds["spec"]["template"]["spec"]["containers"]
    assert {"name": "metrics", "containerPort": 9101, "protocol": "TCP"} in container["ports"]
    assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"
    node, cluster = endpoint["relabelings"]  # the chart's `node` first, then the user's
    assert node == {"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "node"}
    assert cluster == {"targetLabel": "cluster", "replacement": "gpu-east"}
    assert endpoint["metricRelabelings"] == [
        {"action": "drop", "sourceLabels": ["__name__"], "regex": "python_gc_.*"}
    ]
    assert not of_kind(render(("podMonitor.enabled=true", "agent.enabled=false")), "PodMonitor")


def test_service_monitor_labels_and_relabelings() -> None:
    docs = render(
        (
            "serviceMonitor.enabled=true",
            "serviceMonitor.labels.release=kps",
            "serviceMonitor.relabelings[0].targetLabel=cluster",
            "serviceMonitor.relabelings[0].replacement=gpu-east",
            "serviceMonitor.metricRelabelings[0].action=drop",
            "serviceMonitor.metricRelabelings[0].sourceLabels[0]=__name__",
            "serviceMonitor.metricRelabelings[0].regex=python_gc_.*",
        )
    )
    monitor = one(docs, "ServiceMonitor", "-operator")
    assert monitor["metadata"]["labels"]["release"] == "kps"
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["relabelings"] == [{"targetLabel": "cluster", "replacement": "gpu-east"}]
    assert endpoint["metricRelabelings"][0]["regex"] == "python_gc_.*"
    assert endpoint["honorLabels"] is True
    plain = one(render(EXTRAS), "ServiceMonitor", "-operator")["spec"]["endpoints"][0]
    assert "relabelings" not in plain and "metricRelabelings" not in plain


def test_extra_objects_render_through_tpl() -> None:
    as_object = 'extraObjects[0]={"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "{{ include \\"weightship.fullname\\" . }}-ca"}, "data": {"ca.crt": "x"}}'  # noqa: E501
    as_string = "extraObjects[1]=apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{ .Release.Name }}-extra\n  namespace: {{ .Release.Namespace }}\n"  # noqa: E501
    out = helm(
        "template", "ws", str(CHART), "--namespace", "weightship-system",
        "--kube-version", KUBE_VERSION, "--set-json", as_object, "--set-string", as_string,
    ).stdout  # fmt: skip
    docs = tuple(doc for doc in yaml.safe_load_all(out) if doc)
    maps = {d["metadata"]["name"]: d for d in of_kind(docs, "ConfigMap")}
    assert maps["ws-weightship-ca"]["data"] == {"ca.crt": "x"}
    assert maps["ws-extra"]["metadata"]["namespace"] == "weightship-system"
    assert not [d for d in render(DEFAULT) if d["kind"] == "ConfigMap"]


# ---- The rendered chart through kubeconform ------------------------------------------------

# Every optional part on, so that each template is linted.
EVERYTHING = (
    EXTRAS
    + SCOPED
    + (
        "operator.replicas=2",
        "podMonitor.enabled=true",
        "agent.cacheInit.enabled=true",
        "agent.s3.existingSecret=agent-s3",
        "alerts.configMap.enabled=true",
        "grafanaDashboard.enabled=true",
        "networkPolicy.rolloutNamespaces={serving}",
        f"image.digest={DIGEST}",
        "operator.topologySpreadConstraints[0].maxSkew=1",
        "operator.topologySpreadConstraints[0].topologyKey=topology.kubernetes.io/zone",
        "operator.topologySpreadConstraints[0].whenUnsatisfiable=ScheduleAnyway",
        "agent.extraVolumes[0].name=s3-ca",
        "agent.extraVolumes[0].configMap.name=corp-ca",
        "agent.extraVolumeMounts[0].name=s3-ca",
        "agent.extraVolumeMounts[0].mountPath=/etc/ssl/corp",
    )
)
# Kinds of CRDs that are not Kubernetes' own (the Prometheus Operator's, kopf's): there is
# no schema of theirs here, so kubeconform skips them by name; the tests above check them
# field by field. Everything else must have a schema and pass it.
NOT_KUBERNETES = (
    "ServiceMonitor",
    "PodMonitor",
    "PrometheusRule",
    "KopfPeering",
    "ClusterKopfPeering",
)


def kubeconform(manifests: str) -> tuple[int, list[dict[str, Any]]]:
    """kubeconform -strict on `manifests`: its exit status and each resource's result."""
    if not KUBECONFORM.is_file() or not SCHEMAS.is_dir():
        pytest.fail(
            f"kubeconform or its schemas missing in {CACHE}: `bash hack/deps.sh kubeconform`"
        )
    result = subprocess.run(
        [
            str(KUBECONFORM), "-strict", "-verbose", "-output", "json",
            "-schema-location", f"{SCHEMAS}/{{{{ .ResourceKind }}}}{{{{ .KindSuffix }}}}.json",
            "-skip", ",".join(NOT_KUBERNETES), "-",
        ],
        input=manifests, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    return result.returncode, json.loads(result.stdout)["resources"]


def rendered_text(values: tuple[str, ...]) -> str:
    return helm(
        "template", "ws", str(CHART), "--namespace", "weightship-system",
        "--kube-version", KUBE_VERSION, "--api-versions", "monitoring.coreos.com/v1/PrometheusRule",
        *set_args(values),
    ).stdout  # fmt: skip


@pytest.mark.parametrize("values", [DEFAULT, EVERYTHING], ids=["default", "everything"])
def test_the_rendered_chart_passes_kubeconform(values: tuple[str, ...]) -> None:
    text = rendered_text(values)
    code, resources = kubeconform(text)
    bad = [r for r in resources if r["status"] not in ("statusValid", "statusSkipped")]
    assert code == 0 and not bad, bad
    docs = [d for d in yaml.safe_load_all(text) if d]
    valid = sorted(r["kind"] for r in resources if r["status"] == "statusValid")
    assert valid == sorted(d["kind"] for d in docs if d["kind"] not in NOT_KUBERNETES)
    if values == EVERYTHING:
        kinds = {d["kind"] for d in docs}
        assert set(NOT_KUBERNETES) - {"ClusterKopfPeering"} <= kinds  # each template rendered


def test_kubeconform_catches_a_misspelled_field_and_a_wrong_type() -> None:
    text = rendered_text(
        (
            "operator.extraVolumes[0].name=ca",
            "operator.extraVolumes[0].confgMap.name=corp-ca",
            "agent.readinessProbe.periodSecond=3",
        )
    )
    code, resources = kubeconform(text)
    invalid = {r["kind"]: r["msg"] for r in resources if r["status"] == "statusInvalid"}
    assert code != 0
    assert "'confgMap' not allowed" in invalid["Deployment"]
    assert "'periodSecond' not allowed" in invalid["DaemonSet"]
