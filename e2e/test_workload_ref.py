"""spec.workloadRef on the real cluster: a running Deployment is adopted by a ModelRollout,
keeps all of its replicas until the rollout's own pods serve, is then scaled to zero, and
gets its replicas back when the rollout is deleted or stops naming it."""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes.client.rest import ApiException

from e2e.operator_fixtures import (
    PROCESS_NODES,
    OperatorProcess,
    Rollouts,
    publish_models,
    rollout_body,
    wait_reconciled,
)
from weightship.api.names import FINALIZER
from weightship_dev import testkit

NAMESPACE_PREFIX = "wr-"
REPLICAS = 2


@pytest.fixture(scope="module")
def models(cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    s3 = testkit.s3_client(cluster.s3_endpoint)
    bucket = testkit.unique_name("wr")
    s3.create_bucket(Bucket=bucket)
    yield publish_models(cluster.s3_endpoint, bucket, tmp_path_factory.mktemp("wr"), ["v1"])
    testkit.empty_bucket(s3, bucket)
    s3.delete_bucket(Bucket=bucket)


def adopting_rollout(name: str, uri: str, endpoint: str, **spec: Any) -> dict[str, Any]:
    """A rollout of `name`'s pod template (taken from the Deployment `name`)."""
    body = rollout_body(name, uri, "v1", [{"setWeight": 50}], endpoint, replicas=REPLICAS)
    del body["spec"]["template"]
    body["spec"]["workloadRef"] = {"apiVersion": "apps/v1", "kind": "Deployment", "name": name}
    body["spec"].update(spec)
    return body


def create_deployment(cluster: Any, namespace: str, name: str, uri: str) -> None:
    """The Deployment a team ran before weightship: the echo server on process nodes."""
    template = copy.deepcopy(rollout_body(name, uri, "v1", [], "")["spec"]["template"])
    cluster.apps.create_namespaced_deployment(
        namespace,
        {
            "metadata": {"name": name},
            "spec": {
                "replicas": REPLICAS,
                "selector": {"matchLabels": {"app": name}},
                "template": template,
            },
        },
    )
    testkit.wait_until(
        lambda: (deployment(cluster, namespace, name).status.ready_replicas or 0) == REPLICAS,
        timeout=90,
        what=f"Deployment {name} ready",
    )


def deployment(cluster: Any, namespace: str, name: str) -> Any:
    return cluster.apps.read_namespaced_deployment(name, namespace)


def rollout_gone(rollouts: Rollouts, name: str) -> bool:
    try:
        rollouts.get(name)
    except ApiException as e:
        return bool(e.status == 404)
    return False


class Timeline:
    """Samples, every 0.2 s, the Deployment's spec.replicas and the available pods of the
    rollout's own ReplicaSets: the evidence that capacity never dropped."""

    def __init__(self, cluster: Any, rollouts: Rollouts, name: str) -> None:
        self.cluster, self.rollouts, self.name = cluster, rollouts, name
        self.samples: list[tuple[float, int, int]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                spec = deployment(self.cluster, self.rollouts.namespace, self.name).spec.replicas
                available = sum(
                    rs.status.available_replicas or 0 for rs in self.rollouts.replicasets(self.name)
                )
            except ApiException:
                continue
            self.samples.append((time.monotonic(), spec, available))
            time.sleep(0.2)  # the sampling period

    def __enter__(self) -> Timeline:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        self.thread.join(timeout=10)


def test_an_adopted_deployment_keeps_its_replicas_until_the_rollout_serves_and_gets_them_back(
    cluster: Any, rollouts: Rollouts, models: dict[str, str], operator: OperatorProcess
) -> None:
    namespace, name = rollouts.namespace, "llm"
    create_deployment(cluster, namespace, name, models["v1"])
    # Prefetch on and no agents in this namespace: the rollout waits in Prefetching.
    rollouts.create(adopting_rollout(name, models["v1"], cluster.s3_endpoint, prefetch={}))
    prefetching = rollouts.wait(
        name,
        "Prefetching with target nodes counted",
        lambda s: s.get("phase") == "Prefetching" and (s.get("prefetch") or {}).get("targetNodes"),
    )
    # An empty prefetch.nodeSelector means the pods' nodes: the Deployment's nodeSelector,
    # published for the agents, and only the process nodes counted (not the KWOK ones).
    status = prefetching["status"]
    assert status["prefetchNodeSelector"] == PROCESS_NODES
    nodes = cluster.core.list_node().items
    assert len(nodes) > len(cluster.process_nodes)
    assert status["prefetch"]["targetNodes"] == len(cluster.process_nodes)
    # Reconciles that began while the rollout waited in Prefetching ran to the end: the
    # Deployment was seen, and left at its replicas, not adopted.
    wait_reconciled(rollouts, operator, name)
    assert deployment(cluster, namespace, name).spec.replicas == REPLICAS
    assert "workload" not in rollouts.get(name)["status"]

    with Timeline(cluster, rollouts, name) as timeline:
        rollouts.patch_spec(name, {"prefetch": {"enabled": False}})
        testkit.wait_until(
            lambda: deployment(cluster, namespace, name).spec.replicas == 0,
            timeout=120,
            what="the Deployment scaled to zero",
            detail=lambda: str(rollouts.get(name).get("status", {}).get("message")),
        )
        time.sleep(1)  # pacing, not a wait: a few more samples once at zero
    samples = timeline.samples
    assert any(spec == REPLICAS and available < REPLICAS for _, spec, available in samples)
    for at, spec, available in samples:
        assert spec == REPLICAS or available >= REPLICAS, (
            f"the Deployment went to {spec} while the rollout had {available} available pods "
            f"({at - samples[0][0]:.1f} s in)"
        )
    adopted = rollouts.get(name)
    assert adopted["status"]["workload"] == {"name": name, "replicas": REPLICAS}
    assert adopted["status"]["phase"] == "Healthy"
    assert FINALIZER in adopted["metadata"]["finalizers"]
    rollouts.wait_event(name, "WorkloadScaledDown")
    testkit.wait_until(
        lambda: (deployment(cluster, namespace, name).status.replicas or 0) == 0,
        timeout=60,
        what="the Deployment's pods gone",
    )

    # Deleted, the rollout gives the Deployment its replicas back before it goes.
    rollouts.custom.delete_namespaced_custom_object(
        "weightship.io", "v1alpha1", namespace, "modelrollouts", name
    )

    testkit.wait_until(
        lambda: rollout_gone(rollouts, name),
        timeout=60,
        what="the rollout deleted (finalizer released)",
    )
    assert deployment(cluster, namespace, name).spec.replicas == REPLICAS
    testkit.wait_until(
        lambda: (deployment(cluster, namespace, name).status.ready_replicas or 0) == REPLICAS,
        timeout=90,
        what="the Deployment serving again",
    )


def test_a_rollout_that_stops_naming_the_deployment_gives_it_back(
    cluster: Any, rollouts: Rollouts, models: dict[str, str]
) -> None:
    namespace, name = rollouts.namespace, "llm"
    create_deployment(cluster, namespace, name, models["v1"])
    rollouts.create(adopting_rollout(name, models["v1"], cluster.s3_endpoint))
    testkit.wait_until(
        lambda: deployment(cluster, namespace, name).spec.replicas == 0,
        timeout=120,
        what="the Deployment scaled to zero",
    )
    # A sync that scales it up again (GitOps, a person) is undone, with the count to give
    # back unchanged: the Deployment is not watched, so within a re-read (30 s) and a
    # reconcile (30 s when nothing else happens).
    cluster.apps.patch_namespaced_deployment_scale(name, namespace, {"spec": {"replicas": 3}})
    testkit.wait_until(
        lambda: deployment(cluster, namespace, name).spec.replicas == 0,
        timeout=90,
        what="the Deployment scaled up by hand scaled to zero again",
    )
    assert rollouts.get(name)["status"]["workload"] == {"name": name, "replicas": REPLICAS}
    # The same pods from spec.template instead: the Deployment is given back, the rollout
    # lets go of its finalizer, and its own stable keeps serving throughout.
    template = rollout_body(name, models["v1"], "v1", [], "")["spec"]["template"]
    rollouts.patch_spec(name, {"workloadRef": None, "template": template})
    testkit.wait_until(
        lambda: deployment(cluster, namespace, name).spec.replicas == REPLICAS,
        timeout=60,
        what="the Deployment given back its replicas",
    )
    released = rollouts.wait(
        name,
        "status.workload cleared and the finalizer dropped",
        lambda s: "workload" not in s,
        timeout=30,
    )
    testkit.wait_until(
        lambda: FINALIZER not in (rollouts.get(name)["metadata"].get("finalizers") or []),
        timeout=30,
        what="the finalizer dropped",
    )
    rollouts.wait_event(name, "WorkloadReleased")
    assert released["status"]["replicas"]["stable"] == REPLICAS


def test_a_rollout_deleted_while_the_operator_is_down_gives_back_once_it_is_up(
    cluster: Any, rollouts: Rollouts, models: dict[str, str], operator: OperatorProcess
) -> None:
    """Nothing lives only in memory: the finalizer holds the deletion, status.workload
    holds the count, and a freshly started operator gives the replicas back."""
    namespace, name = rollouts.namespace, "llm"
    create_deployment(cluster, namespace, name, models["v1"])
    rollouts.create(adopting_rollout(name, models["v1"], cluster.s3_endpoint))
    testkit.wait_until(
        lambda: deployment(cluster, namespace, name).spec.replicas == 0,
        timeout=120,
        what="the Deployment scaled to zero",
    )
    operator.kill()
    try:
        rollouts.custom.delete_namespaced_custom_object(
            "weightship.io", "v1alpha1", namespace, "modelrollouts", name
        )
        # The API server's answer is the signal: it saw the finalizer and kept the
        # rollout (deletionTimestamp set); only an operator, and none runs, removes it.
        held = rollouts.get(name)
        assert (
            held["metadata"].get("deletionTimestamp")
            and FINALIZER in held["metadata"]["finalizers"]
        )
        assert deployment(cluster, namespace, name).spec.replicas == 0
    finally:
        operator.start()
    testkit.wait_until(lambda: rollout_gone(rollouts, name), timeout=90, what="the rollout gone")
    assert deployment(cluster, namespace, name).spec.replicas == REPLICAS
