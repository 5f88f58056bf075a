"""Which digests a node wants, table by table (weightship.agent.desired is pure)."""

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from weightship.agent.desired import (
    ModelSource,
    bandwidth_limit,
    live_peers,
    next_to_stage,
    retry_delay_s,
    staged_on,
    wanted,
)

A, B, C = ("sha256:" + c * 64 for c in "abc")
GPU = {"nvidia.com/gpu.present": "true", "zone": "a"}


def rollout(
    name: str = "llm",
    namespace: str = "serving",
    *,
    canary: str | None = None,
    stable: str | None = None,
    retiring: str | None = None,
    prefetch: dict[str, Any] | None = None,
    deleting: bool = False,
) -> dict[str, Any]:
    status: dict[str, Any] = {}
    for key, digest in (
        ("canaryRevision", canary),
        ("stableRevision", stable),
        ("retiring", retiring),
    ):
        if digest:
            status[key] = {"revision": "r", "manifestDigest": digest, "podTemplateHash": "h"}
    meta: dict[str, Any] = {"name": name, "namespace": namespace}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {
        "metadata": meta,
        "spec": {
            "model": {
                "source": {
                    "uri": f"s3://models/{name}/",
                    "endpoint": "http://s3:9000",
                    "credentialsSecretRef": {"name": "creds"},
                }
            },
            "prefetch": prefetch if prefetch is not None else {"nodeSelector": {"zone": "a"}},
        },
        "status": status,
    }


@pytest.mark.parametrize(
    ("rollouts", "labels", "expected"),
    [
        ([], GPU, []),
        ([rollout(canary=A, stable=B)], GPU, [(A, "canary"), (B, "stable")]),
        ([rollout(stable=B, retiring=C)], GPU, [(B, "stable"), (C, "retiring")]),
        # Not this node, prefetch off, being deleted, no digests yet: nothing.
        ([rollout(canary=A)], {"zone": "b"}, []),
        ([rollout(canary=A, prefetch={"enabled": False})], GPU, []),
        ([rollout(canary=A, deleting=True)], GPU, []),
        ([rollout()], GPU, []),
        # An empty selector matches every node (as the operator counts targets).
        ([rollout(canary=A, prefetch={})], {}, [(A, "canary")]),
        # The same digest wanted by two rollouts: one entry, the most urgent role.
        (
            [rollout("x", stable=A), rollout("y", canary=A)],
            GPU,
            [(A, "canary")],
        ),
    ],
)
def test_wanted_digests_and_roles(
    rollouts: list[dict[str, Any]], labels: dict[str, str], expected: list[tuple[str, str]]
) -> None:
    assert [(w.digest, w.role) for w in wanted(rollouts, labels)] == expected


def test_pins_sources_and_transfer_settings_merge_across_rollouts() -> None:
    x = rollout("x", stable=A, prefetch={"bandwidthLimit": "100Mi"})
    y = rollout("y", "other", canary=A, prefetch={"peerToPeer": False, "bandwidthLimit": "50M"})
    (w,) = wanted([x, y], GPU)
    assert w.pinned_by == ("other/y", "serving/x")
    assert w.peer_to_peer is False  # any rollout turning it off wins
    assert w.bandwidth_limit == 50_000_000  # the lowest cap
    # The canary's source first: it is the one that holds these weights.
    assert w.sources == (
        ModelSource("other", "s3://models/y/", "http://s3:9000", None),
        ModelSource("serving", "s3://models/x/", "http://s3:9000", None),
    )


def test_namespace_globs_limit_the_rollouts() -> None:
    rs = [rollout("x", "ag-1", canary=A), rollout("y", "prod", canary=B)]
    assert [w.digest for w in wanted(rs, GPU, ("ag-*",))] == [A]
    assert [w.digest for w in wanted(rs, GPU)] == [A, B]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, None),
        ("", None),
        (1048576, 1048576),
        ("1Mi", 1 << 20),
        ("1.5Gi", 3 << 29),
        ("500M", 500_000_000),
        ("2k", 2000),
        ("1e3", 1000),
        ("1.5", 1),
        ("9Ei", 2**63 - 1),
        ("1e30", 2**63 - 1),
    ],
)
def test_bandwidth_limit(value: Any, expected: int | None) -> None:
    assert bandwidth_limit(value) == expected


@pytest.mark.parametrize("bad", ["fast", "10 Mi", "-1Mi", " 1Mi", "1e3Ki", 1.5])
def test_bandwidth_limit_rejects_what_kubernetes_does_not_parse(bad: Any) -> None:
    with pytest.raises(ValueError):
        bandwidth_limit(bad)


def test_malformed_limit_is_ignored_not_fatal() -> None:
    (w,) = wanted([rollout(canary=A, prefetch={"bandwidthLimit": "lots"})], GPU)
    assert w.bandwidth_limit is None


def test_a_node_selector_is_a_map_selector() -> None:
    """nodeSelector semantics (weightship.kube.selector.labels_match): an empty one wants
    every node, a pair the node lacks wants none."""
    assert [w.digest for w in wanted([rollout(canary=A, prefetch={"nodeSelector": {}})], GPU)]
    assert not wanted([rollout(canary=A, prefetch={"nodeSelector": {"zone": "b"}})], GPU)
    assert wanted([rollout(canary=A, prefetch={"nodeSelector": {"zone": "a"}})], GPU)


def test_next_to_stage_skips_staged_and_backed_off() -> None:
    ws = wanted([rollout(canary=A, stable=B, retiring=C)], GPU)
    assert next_to_stage(ws, set(), {}, 0).digest == A  # type: ignore[union-attr]
    assert next_to_stage(ws, {A}, {}, 0).digest == B  # type: ignore[union-attr]
    assert next_to_stage(ws, {A}, {B: 10.0}, 5.0).digest == C  # type: ignore[union-attr]
    assert next_to_stage(ws, {A}, {B: 10.0}, 10.0).digest == B  # type: ignore[union-attr]
    assert next_to_stage(ws, {A, B, C}, {}, 0) is None


def test_retry_delay_doubles_to_a_cap() -> None:
    assert [retry_delay_s(n) for n in (1, 2, 3, 4)] == [5, 10, 20, 40]
    assert retry_delay_s(30) == 300


def test_live_peers_excludes_self_stale_and_endpointless() -> None:
    now = datetime(2026, 1, 1, tzinfo=UTC)
    fresh = (now - timedelta(seconds=10)).isoformat().replace("+00:00", "Z")
    stale = (now - timedelta(minutes=10)).isoformat().replace("+00:00", "Z")

    def cache(node: str, endpoint: str | None, updated: str | None) -> dict[str, Any]:
        return {
            "metadata": {"name": node},
            "spec": {"nodeName": node},
            "status": {"peerEndpoint": endpoint, "updatedAt": updated},
        }

    caches = [
        cache("me", "10.0.0.1:8479", fresh),
        cache("b", "10.0.0.3:8479", fresh),
        cache("a", "10.0.0.2:8479", fresh),
        cache("dead", "10.0.0.4:8479", stale),
        cache("new", None, fresh),
        cache("never", "10.0.0.5:8479", None),
        # No zone: not an RFC 3339 time (metav1.Time refuses it), so not a report at all.
        cache("zoneless", "10.0.0.6:8479", fresh.removesuffix("Z")),
        cache("dated", "10.0.0.7:8479", fresh[:10]),
    ]
    assert live_peers(caches, "me", now, 180) == [("a", "10.0.0.2:8479"), ("b", "10.0.0.3:8479")]


def test_staged_on_names_the_nodes_with_a_whole_copy() -> None:
    digest, other = "sha256:" + "a" * 64, "sha256:" + "b" * 64

    def cache(node: str, *manifests: tuple[str, str]) -> dict[str, Any]:
        return {
            "metadata": {"name": node},
            "spec": {"nodeName": node},
            "status": {"manifests": [{"digest": d, "state": s} for d, s in manifests]},
        }

    caches = [
        cache("done", (digest, "Staged")),
        cache("busy", (digest, "Staging")),
        cache("failed", (digest, "Failed")),
        cache("elsewhere", (other, "Staged")),
        cache("both", (other, "Staged"), (digest, "Staged")),
        {"metadata": {"name": "bare"}},
    ]
    assert staged_on(caches, digest) == {"done", "both"}
