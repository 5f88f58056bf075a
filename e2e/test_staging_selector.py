"""The staging selector end to end: with an empty spec.prefetch.nodeSelector, the real
agents stage onto the nodes the pod template selects, here a workloadRef Deployment's,
which the agents cannot read: they follow status.prefetchNodeSelector, published by the
operator, which counts the same nodes. Uses the `agents` fixture: run under
`flock /work/coord/agents.lock`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from e2e.agent_fixtures import PROCESS, Agents
from e2e.operator_fixtures import Rollouts, publish_models, rollout_body
from weightship.data.s3 import S3Location, S3Origin
from weightship_dev import testkit

NAMESPACE_PREFIX = "ss-"
WAVE = "weightship-e2e/staging-selector"


@pytest.fixture(scope="module")
def models(cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    s3 = testkit.s3_client(cluster.s3_endpoint)
    bucket = testkit.unique_name("ss")
    s3.create_bucket(Bucket=bucket)
    yield publish_models(
        cluster.s3_endpoint, bucket, tmp_path_factory.mktemp("ss"), ["v1", "v2"], size=3 << 20
    )
    testkit.empty_bucket(s3, bucket)
    s3.delete_bucket(Bucket=bucket)


def digest_of(cluster: Any, uri: str) -> str:
    return str(
        S3Origin(testkit.local_s3(cluster.s3_endpoint), S3Location.parse(uri))
        .read_manifest()
        .digest
    )


def adopt(
    cluster: Any, rollouts: Rollouts, name: str, uri: str, revision: str, selector: dict[str, str]
) -> None:
    """A Deployment of no replicas whose pods may run on `selector`'s nodes, and a rollout
    that refers to it, with prefetch on and no nodeSelector of its own."""
    template = rollout_body(name, uri, revision, [], "")["spec"]["template"]
    template["spec"]["nodeSelector"] = selector
    body = rollout_body(name, uri, revision, [{"setWeight": 100}], cluster.s3_endpoint)
    del body["spec"]["template"]
    body["spec"]["workloadRef"] = {"name": name}
    body["spec"]["prefetch"] = {"enabled": True, "minStagedPercent": 100}  # no nodeSelector
    cluster.apps.create_namespaced_deployment(
        rollouts.namespace,
        {
            "metadata": {"name": name},
            "spec": {
                "replicas": 0,
                "selector": {"matchLabels": {"app": name}},
                "template": template,
            },
        },
    )
    rollouts.create(body)


def test_agents_stage_where_the_deployments_pods_may_run(
    cluster: Any, agents: Agents, rollouts: Rollouts, models: dict[str, str]
) -> None:
    digest = digest_of(cluster, models["v1"])
    *chosen, other = cluster.process_nodes
    selector = {**PROCESS, WAVE: "yes"}
    try:
        for node in chosen:
            cluster.core.patch_node(node, {"metadata": {"labels": {WAVE: "yes"}}})
        adopt(cluster, rollouts, "llm", models["v1"], "v1", selector)
        agents.wait_staged(digest, nodes=chosen)
        status = rollouts.wait(
            "llm",
            "the chosen nodes counted as staged",
            lambda s: (s.get("prefetch") or {}).get("stagedNodes") == len(chosen),
        )["status"]
        assert status["prefetchNodeSelector"] == selector
        assert status["prefetch"]["targetNodes"] == len(chosen)
        # The third node's agent looked at llm as published and passed: it stages a
        # rollout created after that (its watch delivers events in order, so the snapshot
        # it acted on held llm's prefetchNodeSelector too), and not llm.
        probe = {**PROCESS, "kubernetes.io/hostname": other}
        adopt(cluster, rollouts, "probe", models["v2"], "v2", probe)
        agents.wait_staged(digest_of(cluster, models["v2"]), nodes=[other])
        assert agents.entry(other, digest) == {}, f"{other} staged a model no pod of it needs"
    finally:
        for node in chosen:
            cluster.core.patch_node(node, {"metadata": {"labels": {WAVE: None}}})
