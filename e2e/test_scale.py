"""100 rollouts at once, through two revisions, with one operator (KWOK pods).

The old design (one kopf daemon per rollout on a 32-thread executor) never reconciled
past the 32nd rollout; this fails if any rollout is left behind again. Not a benchmark:
the bounds are liveness limits, not targets (bench/bench_scale.py measures).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e.operator_fixtures import OperatorProcess, publish_models, s3_secret
from weightship_dev import testkit
from weightship_dev.nodes import delete_kwok_nodes, ensure_kwok_nodes
from weightship_dev.scale import Fleet, describe_stragglers, healthy_on

NAMESPACE_PREFIX = "sc-"
ROLLOUTS = int(os.environ.get("WEIGHTSHIP_SCALE_ROLLOUTS", "100"))
# Up to 4 pods per rollout at the 100% step (2 stable + 2 canary), 110 pods per node.
EXTRA_NODES = 4


@pytest.fixture(scope="module")
def models(cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    s3 = testkit.s3_client(cluster.s3_endpoint)
    bucket = testkit.unique_name("scale")
    s3.create_bucket(Bucket=bucket)
    yield publish_models(
        cluster.s3_endpoint, bucket, tmp_path_factory.mktemp("scale"), ["v1", "v2"], size=4096
    )
    testkit.empty_bucket(s3, bucket)
    s3.delete_bucket(Bucket=bucket)


@pytest.fixture(scope="module")
def kwok_capacity(cluster: Any) -> Iterator[list[str]]:
    names = ensure_kwok_nodes(cluster.api, EXTRA_NODES, start=7100)
    yield names
    delete_kwok_nodes(cluster.api, names)


def test_a_hundred_rollouts_reach_healthy_on_a_second_revision(
    cluster: Any,
    namespace: str,
    operator: OperatorProcess,
    models: dict[str, str],
    kwok_capacity: list[str],
    tmp_path: Path,
) -> None:
    s3_secret(cluster.core, namespace)
    fleet = Fleet(cluster.api, namespace, "m", ROLLOUTS)
    fleet.create(models["v1"], "v1", cluster.s3_endpoint)
    done, listing = fleet.wait(healthy_on("v1"), timeout=600, interval=2)
    assert len(done) == ROLLOUTS, describe_stragglers(done, listing) + "\n" + operator.tail()

    fleet.set_model(models["v2"], "v2")
    done, listing = fleet.wait(healthy_on("v2"), timeout=600, interval=2)
    assert len(done) == ROLLOUTS, describe_stragglers(done, listing) + "\n" + operator.tail()

    # Each rollout went through both revisions with exactly one ReplicaSet per revision,
    # the old one scaled to zero (once its pods drained: core/drain.py, after Healthy) and
    # the new one at full size.
    def sizes() -> dict[str, list[int]]:
        by_rollout: dict[str, list[int]] = {}
        for rs in cluster.apps.list_namespaced_replica_set(namespace).items:
            rollout = rs.metadata.labels["weightship.io/rollout"]
            by_rollout.setdefault(rollout, []).append(rs.spec.replicas)
        return {name: sorted(found) for name, found in by_rollout.items()}

    def wrong() -> dict[str, list[int]]:
        return {name: found for name, found in sizes().items() if found != [0, 2]}

    testkit.wait_until(
        lambda: not wrong(),
        timeout=240,
        what="every old ReplicaSet at 0",
        detail=lambda: str(wrong()),
    )
    assert set(sizes()) == set(fleet.names)
