"""Fixtures for end-to-end tests against the real local cluster.

One cluster per test run: reused when already up (`make cluster-up`), otherwise started
here and stopped when the run ends. Each test gets its own namespace and S3 bucket.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from kubernetes import client
from prometheus_api_client import PrometheusConnect

from e2e import lanes
from e2e.agent_fixtures import Agents, run_agents
from e2e.operator_fixtures import (
    PROCESS_NODES,
    OperatorProcess,
    Rollouts,
    operator_process,
    s3_secret,
)
from weightship_dev import cluster as local_cluster
from weightship_dev import demo, nodes, testkit
from weightship_dev.install import apply_crds, helm, install_chart
from weightship_dev.layout import ClusterPaths


@dataclass
class Cluster:
    paths: ClusterPaths
    api: client.ApiClient
    s3_endpoint: str
    prometheus_url: str
    process_nodes: list[str]
    kwok_nodes: list[str]

    @property
    def core(self) -> client.CoreV1Api:
        return client.CoreV1Api(self.api)

    @property
    def apps(self) -> client.AppsV1Api:
        return client.AppsV1Api(self.api)


KWOK_NODES = int(os.environ.get("WEIGHTSHIP_KWOK_NODES", "4"))


def connect(paths: ClusterPaths) -> Cluster:
    """The running local cluster's API and its nodes by kind."""
    api = nodes.admin_api(paths)
    node_list = client.CoreV1Api(api).list_node().items
    kinds = {
        n.metadata.name: (n.metadata.labels or {}).get(nodes.NODE_KIND_LABEL) for n in node_list
    }
    lane_of = {n.metadata.name: (n.metadata.labels or {}).get(lanes.LANE_LABEL) for n in node_list}
    own_kwok = {nodes.kwok_node_name(i) for i in range(KWOK_NODES)}
    return Cluster(
        paths=paths,
        api=api,
        s3_endpoint=local_cluster.s3_endpoint(),
        prometheus_url=local_cluster.prometheus_url(),
        # Under xdist, this worker's lane's (e2e/lanes.py); otherwise all of them.
        process_nodes=sorted(
            n for n, k in kinds.items() if k == "process" and lanes.lane() in (None, lane_of.get(n))
        ),
        # The cluster's own: test_scale and test_cluster_smoke add KWOK nodes for a while,
        # and under xdist the other lane may connect meanwhile.
        kwok_nodes=sorted(n for n, k in kinds.items() if k == "kwok" and n in own_kwok),
    )


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    if os.geteuid() != 0:
        pytest.fail("e2e tests need root: process nodes use network namespaces")
    paths = ClusterPaths.default()
    with lanes.cluster_startup():  # under xdist, the first worker starts it
        started_here = not local_cluster.is_up(paths)
        if started_here:
            # Whatever an earlier, interrupted run left behind (netns, etcd data) goes first.
            local_cluster.down(paths, log=lambda _: None)
            local_cluster.up(
                local_cluster.ClusterConfig(
                    paths=paths,
                    kwok_nodes=KWOK_NODES,
                    process_nodes=lanes.NODES_PER_LANE * lanes.worker_count(),
                )
            )
            if lanes.xdist_worker():
                lanes.mark_started_by_run(paths.root)
        label_lanes(paths)
        # A demo left running (`make demo`, then `make test`) runs node agents of its own
        # on the process nodes, which would share the WeightCaches with the tests' agents.
        demo.remove(paths)
    found = connect(paths)
    if len(found.process_nodes) < lanes.NODES_PER_LANE:
        pytest.fail(
            f"lane {lanes.lane()} has {len(found.process_nodes)} process nodes, needs "
            f"{lanes.NODES_PER_LANE}: a cluster started by hand has "
            f"{lanes.NODES_PER_LANE} in all; stop it (make cluster-down) or run LANES=1"
        )
    yield found
    # Under xdist the other worker may still use it: the controller stops it at the end.
    if started_here and not lanes.xdist_worker() and not os.environ.get("WEIGHTSHIP_KEEP_CLUSTER"):
        local_cluster.down(paths)


def label_lanes(paths: ClusterPaths) -> None:
    """Each process node's lane: proc-0..2 gw0, proc-3..5 gw1, ... (idempotent)."""
    core = client.CoreV1Api(nodes.admin_api(paths))
    names = {
        n.metadata.name
        for n in core.list_node(label_selector=f"{nodes.NODE_KIND_LABEL}=process").items
    }
    for index, name in enumerate(nodes.process_node_names(len(names))):
        core.patch_node(
            name, {"metadata": {"labels": {lanes.LANE_LABEL: lanes.lane_of_node(index)}}}
        )


@pytest.fixture(scope="module", autouse=True)
def cluster_share(request: pytest.FixtureRequest) -> Iterator[None]:
    """Each e2e module shares the cluster with the other lane, or holds it alone."""
    with lanes.cluster_share(
        exclusive=request.module.__name__.split(".")[-1] in lanes.EXCLUSIVE_MODULES
    ):
        yield


def _namespace(cluster: Cluster, request: pytest.FixtureRequest, name: str) -> Iterator[str]:
    # A module may set NAMESPACE_PREFIX so that its operator watches only its namespaces.
    prefix = getattr(request.module, "NAMESPACE_PREFIX", "")
    created = testkit.create_namespace(cluster.api, prefix + name)
    yield created
    testkit.delete_namespace(cluster.api, created)


@pytest.fixture
def namespace(cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[str]:
    yield from _namespace(cluster, request, request.node.name[:30])


@pytest.fixture(scope="module")
def module_namespace(cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """One namespace for the tests of a module that share what they start, with
    ``module_agents`` and ``module_rollouts``: a vLLM replica takes 40-75 s of CI's two
    cores to start, so its tests take over one another's replicas."""
    yield from _namespace(cluster, request, request.module.__name__.split(".")[-1][:30])


@pytest.fixture
def s3_bucket(cluster: Cluster) -> Iterator[tuple[Any, str]]:
    s3 = testkit.s3_client(cluster.s3_endpoint)
    bucket = testkit.unique_name("t")
    s3.create_bucket(Bucket=bucket)
    yield s3, bucket
    testkit.empty_bucket(s3, bucket)
    s3.delete_bucket(Bucket=bucket)


@pytest.fixture(scope="module")
def crds(cluster: Cluster) -> None:
    apply_crds(cluster.api)


@pytest.fixture(scope="module")
def operator(
    cluster: Cluster, crds: None, request: pytest.FixtureRequest
) -> Iterator[OperatorProcess]:
    """A real operator process per module, watching only that module's namespaces."""
    prefix = getattr(request.module, "NAMESPACE_PREFIX", "")
    if not prefix:
        pytest.fail(f"{request.module.__name__} needs NAMESPACE_PREFIX to run an operator")
    yield from operator_process(
        cluster.paths.root, cluster.paths.admin_kubeconfig, namespaces=(f"{prefix}*",)
    )


@pytest.fixture
def agents(cluster: Any, namespace: str, crds: None) -> Iterator[Agents]:
    yield from run_agents(cluster, namespace)


@pytest.fixture(scope="module")
def module_agents(cluster: Any, module_namespace: str, crds: None) -> Iterator[Agents]:
    yield from run_agents(cluster, module_namespace)


@pytest.fixture
def release(cluster: Cluster, namespace: str) -> Iterator[str]:
    """The Helm chart installed in this test's namespace, watching only it (no agents)."""
    apply_crds(cluster.api)
    name = testkit.unique_name("ws")
    install_chart(cluster.paths, name, namespace, [namespace], node_selector=PROCESS_NODES)
    yield name
    helm(cluster.paths, "uninstall", name, "--namespace", namespace, "--wait", "--timeout", "60s")


@pytest.fixture
def rollouts(cluster: Cluster, namespace: str, operator: OperatorProcess) -> Rollouts:
    """The ModelRollout API in this test's namespace, with the S3 credentials Secret."""
    s3_secret(cluster.core, namespace)
    return Rollouts(cluster.api, namespace)


@pytest.fixture(scope="module")
def module_rollouts(cluster: Cluster, module_namespace: str, operator: OperatorProcess) -> Rollouts:
    """``rollouts`` in the module's namespace (``module_namespace``)."""
    s3_secret(cluster.core, module_namespace)
    return Rollouts(cluster.api, module_namespace)


@pytest.fixture(scope="session")
def prometheus(cluster: Cluster) -> PrometheusConnect:
    return PrometheusConnect(url=cluster.prometheus_url, disable_ssl=True)


def pytest_configure(config: pytest.Config) -> None:
    if not lanes.xdist_worker():  # the controller, or a run without xdist
        os.environ.setdefault(lanes.RUN_ID_ENV, uuid.uuid4().hex)
    if timeline := os.environ.get(lanes.TIMELINE_ENV):
        config.pluginmanager.register(lanes.Timeline(timeline), "weightship-timeline")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> lanes.LaneScheduling:
    """Under xdist, the tests run in lanes (e2e/lanes.py)."""
    return lanes.LaneScheduling(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if lanes.is_e2e(item):
            item.add_marker(pytest.mark.e2e)
    lanes.arrange(items)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Under xdist: the controller stops the cluster that one of its workers started."""
    paths = ClusterPaths.default()
    if lanes.xdist_worker() or not lanes.started_by_this_run(paths.root):
        return
    lanes.forget_started(paths.root)
    if not os.environ.get("WEIGHTSHIP_KEEP_CLUSTER"):
        local_cluster.down(paths)
