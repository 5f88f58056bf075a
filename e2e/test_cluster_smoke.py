"""The local cluster is real: API semantics, pods that run, networking, probes, gates."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from weightship_dev import testkit
from weightship_dev.nodes import GPU_TAINT, NODE_KIND_LABEL

ECHO_DATA = "/var/lib/weightship-echo"

SMOKE_CRD: dict[str, Any] = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "widgets.smoke.weightship.io"},
    "spec": {
        "group": "smoke.weightship.io",
        "scope": "Namespaced",
        "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "properties": {
                            "spec": {
                                "type": "object",
                                "required": ["size"],
                                "properties": {
                                    "size": {"type": "integer", "minimum": 1, "maximum": 10}
                                },
                            },
                            "status": {
                                "type": "object",
                                "properties": {"phase": {"type": "string"}},
                            },
                        },
                    }
                },
            }
        ],
    },
}


def echo_container(**extra: Any) -> dict[str, Any]:
    def field(path: str) -> dict[str, Any]:
        return {"valueFrom": {"fieldRef": {"fieldPath": path}}}

    return {
        "name": "echo",
        "image": "python:3.11-slim",
        "command": ["python3", "-m", "weightship_dev.echoserver"],
        "env": [
            {"name": "POD_NAME", **field("metadata.name")},
            {"name": "POD_NAMESPACE", **field("metadata.namespace")},
            {"name": "NODE_NAME", **field("spec.nodeName")},
            {"name": "POD_IP", **field("status.podIP")},
            {"name": "HOST_IP", **field("status.hostIP")},
            {"name": "ECHO_DATA_DIR", "value": ECHO_DATA},
            {"name": "ECHO_MESSAGE", "value": "hello from $(POD_NAME)"},
        ],
        "ports": [{"name": "http", "containerPort": 8080}],
        "readinessProbe": {
            "httpGet": {"path": "/healthz", "port": "http"},
            "periodSeconds": 1,
            "failureThreshold": 2,
        },
        "volumeMounts": [{"name": "data", "mountPath": ECHO_DATA}],
        **extra,
    }


def echo_pod_spec(namespace: str, **extra: Any) -> dict[str, Any]:
    """An echo server whose hostPath is per test namespace, so runs never mix."""
    return {
        "containers": [echo_container()],
        "volumes": [
            {
                "name": "data",
                "hostPath": {
                    "path": f"/var/lib/weightship-echo/{namespace}",
                    "type": "DirectoryOrCreate",
                },
            }
        ],
        "terminationGracePeriodSeconds": 5,
        **extra,
    }


def http_json(url: str, timeout: float = 5) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


def describe_pods(cluster: Any, namespace: str) -> str:
    lines = []
    for p in cluster.core.list_namespaced_pod(namespace).items:
        states = [
            (c.name, c.ready, c.restart_count, c.state.waiting and c.state.waiting.message)
            for c in p.status.container_statuses or []
        ]
        lines.append(f"{p.metadata.name} on {p.spec.node_name}: {p.status.phase} {states}")
    return "\n".join(lines)


def pods_by_node(cluster: Any, namespace: str, selector: str) -> dict[str, Any]:
    pods = cluster.core.list_namespaced_pod(namespace, label_selector=selector).items
    return {p.spec.node_name: p for p in pods}


def test_crd_with_status_subresource_and_schema_rejection(cluster: Any) -> None:
    ext = client.ApiextensionsV1Api(cluster.api)
    try:
        ext.create_custom_resource_definition(SMOKE_CRD)
    except ApiException as e:
        assert e.status == 409
    custom = client.CustomObjectsApi(cluster.api)
    ns = testkit.create_namespace(cluster.api, "crd")
    try:

        def established() -> bool:
            crd = ext.read_custom_resource_definition(SMOKE_CRD["metadata"]["name"])
            return any(
                c.type == "Established" and c.status == "True" for c in crd.status.conditions or []
            )

        testkit.wait_until(established, timeout=30, what="CRD Established")
        args = ("smoke.weightship.io", "v1", ns, "widgets")
        body = {
            "apiVersion": "smoke.weightship.io/v1",
            "kind": "Widget",
            "metadata": {"name": "ok"},
            "spec": {"size": 3},
        }
        testkit.wait_until(
            lambda: custom.create_namespaced_custom_object(*args, body),
            timeout=30,
            what="first Widget accepted",
        )
        # The status subresource is separate: spec writes do not change status.
        custom.patch_namespaced_custom_object_status(*args, "ok", {"status": {"phase": "Done"}})
        custom.patch_namespaced_custom_object(*args, "ok", {"status": {"phase": "Ignored"}})
        assert custom.get_namespaced_custom_object(*args, "ok")["status"]["phase"] == "Done"

        bad = {**body, "metadata": {"name": "bad"}, "spec": {"size": 11}}
        with pytest.raises(ApiException) as err:
            custom.create_namespaced_custom_object(*args, bad)
        assert err.value.status == 422
        assert "spec.size" in err.value.body
    finally:
        testkit.delete_namespace(cluster.api, ns)


def test_daemonset_runs_real_pods_on_every_node(cluster: Any, namespace: str) -> None:
    labels = {"app": "echo"}
    ds = {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": "echo"},
        "spec": {
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": echo_pod_spec(namespace, tolerations=[{**GPU_TAINT, "operator": "Equal"}]),
            },
        },
    }
    cluster.apps.create_namespaced_daemon_set(namespace, ds)
    all_nodes = cluster.process_nodes + cluster.kwok_nodes

    def all_ready() -> dict[str, Any] | None:
        pods = pods_by_node(cluster, namespace, "app=echo")
        ready = {
            n: p
            for n, p in pods.items()
            if testkit.condition(testkit.pod_dict(cluster.api, p), "Ready")
            and p.status.phase == "Running"
            and all(c.ready for c in p.status.container_statuses or [])
        }
        return ready if set(ready) >= set(all_nodes) else None

    ready = testkit.wait_until(
        all_ready,
        timeout=120,
        what="echo pod Ready on every node",
        detail=lambda: describe_pods(cluster, namespace),
    )
    proc_pods = {n: ready[n] for n in cluster.process_nodes}
    ips = {p.status.pod_ip for p in proc_pods.values()}
    assert len(ips) == len(proc_pods), "each pod has its own IP"

    # The host reaches every process-node pod, and each pod knows who and where it is.
    for node, pod in proc_pods.items():
        info = http_json(f"http://{pod.status.pod_ip}:8080/")
        assert info["POD_NAME"] == pod.metadata.name
        assert info["NODE_NAME"] == node
        assert info["POD_IP"] == pod.status.pod_ip
        assert info["ECHO_MESSAGE"] == f"hello from {pod.metadata.name}"

    # Pod-to-pod: the first pod fetches the second one's identity from inside its namespace.
    first, second = list(proc_pods.values())[:2]
    via_peer = http_json(
        f"http://{first.status.pod_ip}:8080/peer?ip={second.status.pod_ip}&port=8080"
    )
    assert via_peer["POD_NAME"] == second.metadata.name

    # hostPath is per node: each node's directory holds only its own pod's marker.
    for node, pod in proc_pods.items():
        data_dir = cluster.paths.node_dir(node) / "root/var/lib/weightship-echo" / namespace
        assert sorted(p.name for p in data_dir.glob("*.started")) == [
            f"{pod.metadata.name}.started"
        ]

    # KWOK pods reached Running on the fake GPU nodes.
    for node in cluster.kwok_nodes:
        assert ready[node].status.phase == "Running"


def test_graceful_deletion_sends_sigterm_and_cleans_up(cluster: Any, namespace: str) -> None:
    node = cluster.process_nodes[0]
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "graceful"},
        "spec": echo_pod_spec(namespace, nodeName=node),
    }
    cluster.core.create_namespaced_pod(namespace, pod)
    testkit.wait_until(
        lambda: (
            cluster.core.read_namespaced_pod("graceful", namespace).status.pod_ip
            and _ready(cluster, namespace, "graceful")
        ),
        timeout=60,
        what="pod Ready",
    )
    uid = cluster.core.read_namespaced_pod("graceful", namespace).metadata.uid
    cluster.core.delete_namespaced_pod("graceful", namespace)

    def gone() -> bool:
        try:
            cluster.core.read_namespaced_pod("graceful", namespace)
        except ApiException as e:
            return e.status == 404
        return False

    testkit.wait_until(gone, timeout=30, what="pod deleted by the kubelet")
    marker = (
        cluster.paths.node_dir(node)
        / "root/var/lib/weightship-echo"
        / namespace
        / "graceful.terminated"
    )
    assert marker.read_text() == "SIGTERM\n"
    assert not Path("/run/netns", "wsp-" + uid.replace("-", "")[:12]).exists()


def _ready(cluster: Any, namespace: str, name: str) -> bool:
    pod = testkit.pod_dict(cluster.api, cluster.core.read_namespaced_pod(name, namespace))
    cond = testkit.condition(pod, "Ready")
    return bool(cond and cond["status"] == "True")


def test_readiness_gate_holds_pod_until_condition_true(cluster: Any, namespace: str) -> None:
    gate = "weightship.io/weights-verified"
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "gated"},
        "spec": echo_pod_spec(
            namespace, nodeName=cluster.process_nodes[1], readinessGates=[{"conditionType": gate}]
        ),
    }
    cluster.core.create_namespaced_pod(namespace, pod)

    def containers_ready() -> dict[str, Any] | None:
        p = testkit.pod_dict(cluster.api, cluster.core.read_namespaced_pod("gated", namespace))
        cond = testkit.condition(p, "ContainersReady")
        return p if cond and cond["status"] == "True" else None

    p = testkit.wait_until(containers_ready, timeout=60, what="containers ready")
    ready = testkit.condition(p, "Ready")
    assert ready and ready["status"] == "False"
    assert ready["reason"] == "ReadinessGatesNotReady"

    def set_gate(status: str) -> None:
        cluster.core.patch_namespaced_pod_status(
            "gated",
            namespace,
            {
                "status": {
                    "conditions": [
                        {
                            "type": gate,
                            "status": status,
                            "reason": "Test",
                            "message": "set by the test",
                        }
                    ]
                }
            },
        )

    set_gate("False")
    assert not _ready(cluster, namespace, "gated")
    set_gate("True")
    testkit.wait_until(
        lambda: _ready(cluster, namespace, "gated"),
        timeout=20,
        what="Ready after the gate turned True",
    )
    set_gate("False")
    testkit.wait_until(
        lambda: not _ready(cluster, namespace, "gated"),
        timeout=20,
        what="not Ready after the gate turned False",
    )


def test_prometheus_scrapes_pod_metrics(cluster: Any, namespace: str, prometheus: Any) -> None:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "scraped",
            "labels": {"app": "scraped"},
            "annotations": {"prometheus.io/scrape": "true", "prometheus.io/port": "8080"},
        },
        "spec": echo_pod_spec(namespace, nodeName=cluster.process_nodes[0]),
    }
    cluster.core.create_namespaced_pod(namespace, pod)
    testkit.wait_until(lambda: _ready(cluster, namespace, "scraped"), timeout=60, what="pod Ready")
    ip = cluster.core.read_namespaced_pod("scraped", namespace).status.pod_ip
    for _ in range(3):
        http_json(f"http://{ip}:8080/")
    query = f'weightship_echo_requests_total{{namespace="{namespace}",pod="scraped",path="/"}}'
    result = testkit.wait_until(
        lambda: prometheus.custom_query(query), timeout=60, what=f"Prometheus to return {query}"
    )
    assert float(result[0]["value"][1]) >= 3


def test_pod_reads_the_api_with_its_own_service_account(cluster: Any, namespace: str) -> None:
    rbac = client.RbacAuthorizationV1Api(cluster.api)
    rbac.create_namespaced_role(
        namespace,
        {
            "metadata": {"name": "read-pods"},
            "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]}],
        },
    )
    rbac.create_namespaced_role_binding(
        namespace,
        {
            "metadata": {"name": "read-pods"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "Role",
                "name": "read-pods",
            },
            "subjects": [{"kind": "ServiceAccount", "name": "default", "namespace": namespace}],
        },
    )
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "api-user"},
        "spec": echo_pod_spec(
            namespace, nodeName=cluster.process_nodes[2 % len(cluster.process_nodes)]
        ),
    }
    cluster.core.create_namespaced_pod(namespace, pod)
    testkit.wait_until(lambda: _ready(cluster, namespace, "api-user"), timeout=60, what="pod Ready")
    live = cluster.core.read_namespaced_pod("api-user", namespace)
    # The handler imports the kubernetes client on its first call: 0.7 s on a quiet
    # core, over 5 s on the 2-core CI machine under both lanes (it timed out twice there).
    who = http_json(f"http://{live.status.pod_ip}:8080/whoami", timeout=60)
    assert who == {"uid": live.metadata.uid, "node": live.spec.node_name}


@pytest.mark.parametrize(("policy", "phase"), [("Never", "Failed"), ("OnFailure", "Running")])
def test_restart_policy(cluster: Any, namespace: str, policy: str, phase: str) -> None:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "exits"},
        "spec": {
            "nodeName": cluster.process_nodes[0],
            "restartPolicy": policy,
            "containers": [
                {
                    "name": "main",
                    "image": "python:3.11-slim",
                    "command": ["python3", "-c", "import sys; sys.exit(3)"],
                }
            ],
        },
    }
    cluster.core.create_namespaced_pod(namespace, pod)

    def observed() -> Any:
        p = cluster.core.read_namespaced_pod("exits", namespace)
        statuses = p.status.container_statuses or []
        if policy == "Never" and p.status.phase == "Failed":
            return p
        if policy == "OnFailure" and statuses and statuses[0].restart_count >= 2:
            return p
        return None

    p = testkit.wait_until(observed, timeout=60, what=f"restartPolicy {policy} behaviour")
    assert p.status.phase == phase
    if policy == "Never":
        assert p.status.container_statuses[0].state.terminated.exit_code == 3


def test_configmap_and_secret_volumes(cluster: Any, namespace: str) -> None:
    cluster.core.create_namespaced_config_map(
        namespace, {"metadata": {"name": "cfg"}, "data": {"greeting": "hi"}}
    )
    cluster.core.create_namespaced_secret(
        namespace, {"metadata": {"name": "sec"}, "stringData": {"token": "s3cr3t"}}
    )
    script = (
        "import pathlib,sys; a=pathlib.Path('/etc/cfg/greeting').read_text();"
        " b=pathlib.Path('/etc/sec/token').read_text();"
        " sys.exit(0 if (a, b) == ('hi', 's3cr3t') else 7)"
    )
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "volumes"},
        "spec": {
            "nodeName": cluster.process_nodes[0],
            "restartPolicy": "Never",
            "containers": [
                {
                    "name": "main",
                    "image": "python:3.11-slim",
                    "command": ["python3", "-c", script],
                    "volumeMounts": [
                        {"name": "cfg", "mountPath": "/etc/cfg"},
                        {"name": "sec", "mountPath": "/etc/sec", "readOnly": True},
                    ],
                }
            ],
            "volumes": [
                {"name": "cfg", "configMap": {"name": "cfg"}},
                {"name": "sec", "secret": {"secretName": "sec"}},
            ],
        },
    }
    cluster.core.create_namespaced_pod(namespace, pod)
    p = testkit.wait_until(
        lambda: (lambda p: p if p.status.phase in ("Succeeded", "Failed") else None)(
            cluster.core.read_namespaced_pod("volumes", namespace)
        ),
        timeout=60,
        what="pod to finish",
    )
    assert p.status.phase == "Succeeded"


def test_thousand_kwok_nodes_and_a_daemonset_over_them(cluster: Any, namespace: str) -> None:
    from weightship_dev.nodes import delete_kwok_nodes, ensure_kwok_nodes

    count = 1000
    names = ensure_kwok_nodes(cluster.api, count, start=1000, workers=32)
    try:

        def ready_kwok_nodes() -> int:
            nodes = cluster.core.list_node(label_selector=f"{NODE_KIND_LABEL}=kwok").items
            return sum(
                any(c.type == "Ready" and c.status == "True" for c in n.status.conditions or [])
                for n in nodes
            )

        expected = count + len(cluster.kwok_nodes)
        testkit.wait_until(
            lambda: ready_kwok_nodes() >= expected,
            timeout=600,
            interval=3,
            what="1,000 KWOK nodes Ready",
            detail=lambda: f"{ready_kwok_nodes()} of {expected} Ready",
        )
        labels = {"app": "fleet-agent"}
        ds = {
            "apiVersion": "apps/v1",
            "kind": "DaemonSet",
            "metadata": {"name": "fleet-agent"},
            "spec": {
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {
                        "nodeSelector": {NODE_KIND_LABEL: "kwok"},
                        "tolerations": [{**GPU_TAINT, "operator": "Equal"}],
                        "containers": [{"name": "agent", "image": "pause"}],
                    },
                },
            },
        }
        cluster.apps.create_namespaced_daemon_set(namespace, ds)

        def converged() -> bool:
            st = cluster.apps.read_namespaced_daemon_set_status("fleet-agent", namespace).status
            return st.desired_number_scheduled == expected and st.number_ready == expected

        def detail() -> str:
            st = cluster.apps.read_namespaced_daemon_set_status("fleet-agent", namespace).status
            return (
                f"desired={st.desired_number_scheduled} scheduled="
                f"{st.current_number_scheduled} ready={st.number_ready}"
            )

        testkit.wait_until(
            converged, timeout=600, interval=2, what="DaemonSet over 1,000 nodes", detail=detail
        )
    finally:
        cluster.apps.delete_namespaced_daemon_set("fleet-agent", namespace)
        delete_kwok_nodes(cluster.api, names, workers=32)


def test_volume_over_the_checkout_keeps_the_image_visible(cluster: Any, namespace: str) -> None:
    """An emptyDir mounted over a parent of the checkout (as /tmp is when CI clones into
    /tmp) must not hide the interpreter and package that stand in for the image."""
    checkout_parent = str(Path(__file__).resolve().parents[1].parent)
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "shadowed"},
        "spec": {
            "nodeName": cluster.process_nodes[0],
            "restartPolicy": "Never",
            "securityContext": {"runAsUser": 65532, "runAsNonRoot": True},
            "containers": [
                {
                    "name": "main",
                    "image": "python:3.11-slim",
                    "command": [
                        "python3",
                        "-c",
                        "import weightship, pathlib; "
                        f"pathlib.Path('{checkout_parent}/scratch').write_text('ok')",
                    ],
                    "securityContext": {"readOnlyRootFilesystem": True},
                    "volumeMounts": [{"name": "scratch", "mountPath": checkout_parent}],
                }
            ],
            "volumes": [{"name": "scratch", "emptyDir": {}}],
        },
    }
    cluster.core.create_namespaced_pod(namespace, pod)
    p = testkit.wait_until(
        lambda: (lambda p: p if p.status.phase in ("Succeeded", "Failed") else None)(
            cluster.core.read_namespaced_pod("shadowed", namespace)
        ),
        timeout=60,
        what="pod to finish",
    )
    assert p.status.phase == "Succeeded", describe_pods(cluster, namespace)
