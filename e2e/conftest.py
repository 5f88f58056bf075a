"""Fixtures for end-to-end tests against the real local cluster.

One cluster per test run: reused when already up (`make cluster-up`), otherwise started
here and stopped when the run ends. Each test gets its own namespace and S3 bucket.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from kubernetes import client
from prometheus_api_client import PrometheusConnect

from e2e.agent_fixtures import Agents, run_agents
from e2e.operator_fixtures import OperatorProcess, Rollouts, operator_process, s3_secret
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


PROCESS_NODES = int(os.environ.get("WEIGHTSHIP_PROCESS_NODES", "3"))
KWOK_NODES = int(os.environ.get("WEIGHTSHIP_KWOK_NODES", "4"))


def connect(paths: ClusterPaths) -> Cluster:
    """The running local cluster's API and its nodes by kind."""
    api = nodes.admin_api(paths)
    node_list = client.CoreV1Api(api).list_node().items
    kinds = {
        n.metadata.name: (n.metadata.labels or {}).get(nodes.NODE_KIND_LABEL) for n in node_list
    }
    return Cluster(
        paths=paths,
        api=api,
        s3_endpoint=local_cluster.s3_endpoint(),
        prometheus_url=local_cluster.prometheus_url(),
        process_nodes=sorted(n for n, k in kinds.items() if k == "process"),
        kwok_nodes=sorted(n for n, k in kinds.items() if k == "kwok"),
    )


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    if os.geteuid() != 0:
        pytest.fail("e2e tests need root: process nodes use network namespaces")
    paths = ClusterPaths.default()
    started_here = not local_cluster.is_up(paths)
    if started_here:
        # Whatever an earlier, interrupted run left behind (netns, etcd data) goes first.
        local_cluster.down(paths, log=lambda _: None)
        local_cluster.up(
            local_cluster.ClusterConfig(
                paths=paths, kwok_nodes=KWOK_NODES, process_nodes=PROCESS_NODES
            )
        )
    # A demo left running (`make demo`, then `make test`) runs node agents of its own on
    # the process nodes, which would share the WeightCaches with the tests' agents.
    demo.remove(paths)
    yield connect(paths)
    if started_here and not os.environ.get("WEIGHTSHIP_KEEP_CLUSTER"):
        local_cluster.down(paths)


@pytest.fixture
def namespace(cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[str]:
    # A module may set NAMESPACE_PREFIX so that its operator watches only its namespaces.
    prefix = getattr(request.module, "NAMESPACE_PREFIX", "")
    name = testkit.create_namespace(cluster.api, prefix + request.node.name[:30])
    yield name
    testkit.delete_namespace(cluster.api, name)


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


@pytest.fixture
def release(cluster: Cluster, namespace: str) -> Iterator[str]:
    """The Helm chart installed in this test's namespace, watching only it (no agents)."""
    apply_crds(cluster.api)
    name = testkit.unique_name("ws")
    install_chart(cluster.paths, name, namespace, [namespace])
    yield name
    helm(cluster.paths, "uninstall", name, "--namespace", namespace, "--wait", "--timeout", "60s")


@pytest.fixture
def rollouts(cluster: Cluster, namespace: str, operator: OperatorProcess) -> Rollouts:
    """The ModelRollout API in this test's namespace, with the S3 credentials Secret."""
    s3_secret(cluster.core, namespace)
    return Rollouts(cluster.api, namespace)


@pytest.fixture(scope="session")
def prometheus(cluster: Cluster) -> PrometheusConnect:
    return PrometheusConnect(url=cluster.prometheus_url, disable_ssl=True)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "/e2e/" in str(item.fspath):
            item.add_marker(pytest.mark.e2e)
