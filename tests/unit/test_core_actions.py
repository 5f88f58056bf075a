"""Table tests of the actions `decide` resolves for apply: which ReplicaSet may be built
and from which template, require_staged, the scale-up seed env, trivial gates, node labels
and the Services' revisions."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from weightship.api.models import ModelRollout
from weightship.api.status import RetiringRevision
from weightship.core.decide import decide
from weightship.core.decision import (
    CreateReplicaSet,
    Decision,
    NodeLabel,
    ScaleAction,
    SetGate,
)
from weightship.core.observed import NodeStaging, ObservedPod, PrefetchObservation
from weightship.core.pod_gates import pod_gates
from weightship.core.seeding import scale_up_seed, seed_root
from weightship_testing.core import (
    DIGEST_A,
    DIGEST_B,
    T0,
    at,
    healthy_rollout,
    make_rollout,
    observe,
    replica_set,
    staged,
    with_model_revision,
    with_status,
)
from weightship_testing.samples import VALID_MANIFEST

STEPS: list[dict[str, Any]] = [{"setWeight": 25}, {"setWeight": 50}, {"pause": {}}]


def creates(decision: Decision) -> dict[str, CreateReplicaSet]:
    return {a.role: a for a in decision.scales if isinstance(a, CreateReplicaSet)}


def canary_running(digest: str = DIGEST_B, **spec: Any) -> tuple[ModelRollout, str, str]:
    """Stable v1 (DIGEST_A) on 4 replicas; v2 with `digest` staged: step 0 (25%) running."""
    rollout, stable = healthy_rollout(STEPS, **spec)
    rollout = with_model_revision(rollout, "v2")
    first = decide(
        rollout, observe(replica_set(stable, 4), digest=digest, prefetch=staged(digest)), at(60)
    )
    rollout = with_status(rollout, first)
    assert rollout.status.canary_revision is not None
    return rollout, stable, rollout.status.canary_revision.pod_template_hash


# --- which ReplicaSet may be (re)built, and how --------------------------------------------


def test_a_missing_stable_is_rebuilt_from_the_spec_template_in_steady_state() -> None:
    rollout, stable = healthy_rollout(STEPS)
    decision = decide(rollout, observe(prefetch=staged(DIGEST_A)), at(10))
    assert decision.scales == (
        CreateReplicaSet(stable, "stable", 4, DIGEST_A, "spec.template", require_staged=False),
    )
    assert rollout.spec.template is not None
    action = decision.scales[0]
    assert isinstance(action, CreateReplicaSet)
    assert action.template == rollout.spec.template.to_k8s()
    assert decision.not_rebuilt == ()


def test_a_missing_stable_mid_canary_is_not_built_from_the_canary_template() -> None:
    rollout, stable, canary = canary_running()
    decision = decide(rollout, observe(replica_set(canary, 1), digest=DIGEST_B), at(70))
    assert "stable" not in creates(decision)
    assert decision.not_rebuilt == (stable,)


def test_a_missing_retiring_revision_is_not_rebuilt() -> None:
    rollout, stable, canary = canary_running()
    retiring = RetiringRevision(
        revision="v0",
        manifest_digest=DIGEST_A,
        pod_template_hash="old0000000",
        scale_down_at=at(10_000),
    )
    rollout = rollout.model_copy(
        update={"status": rollout.status.model_copy(update={"retiring": retiring})}
    )
    seen = observe(replica_set(stable, 4), replica_set(canary, 1), digest=DIGEST_B)
    decision = decide(rollout, seen, at(70))
    assert decision.not_rebuilt == ("old0000000",)
    assert creates(decision) == {}


@pytest.mark.parametrize(
    ("digest", "prefetch", "require_staged"),
    [
        (DIGEST_B, {}, True),  # new weights: only nodes that staged them
        (DIGEST_A, {}, False),  # the stable's weights: staged wherever the stable runs
        (DIGEST_B, {"enabled": False}, False),  # no prefetch: no staged label to require
    ],
)
def test_a_new_canary_requires_staged_nodes_only_for_new_prefetched_weights(
    digest: str, prefetch: dict[str, Any], require_staged: bool
) -> None:
    spec: dict[str, Any] = {}
    if prefetch:
        spec["prefetch"] = {**VALID_MANIFEST["spec"]["prefetch"], **prefetch}
    rollout, stable, canary = canary_running(digest, **spec)
    decision = decide(
        rollout, observe(replica_set(stable, 4), digest=digest, prefetch=staged(digest)), at(61)
    )
    created = creates(decision)["canary"]
    assert (created.revision_hash, created.replicas) == (canary, 1)
    assert created.manifest_digest == digest
    assert created.require_staged is require_staged


def test_a_workload_ref_revision_is_built_from_the_observed_deployment_template() -> None:
    manifest = copy.deepcopy(VALID_MANIFEST)
    template = manifest["spec"].pop("template")
    manifest["spec"]["workloadRef"] = {"name": "llm"}
    rollout = ModelRollout.model_validate(manifest)
    decision = decide(rollout, observe(prefetch=staged(DIGEST_A), workload_template=template), T0)
    (action,) = decision.scales
    assert isinstance(action, CreateReplicaSet)
    assert (action.role, action.template_source) == ("canary", "workloadRef")
    assert action.template == template


def test_nothing_is_built_while_the_spec_is_invalid() -> None:
    rollout, _ = healthy_rollout(STEPS)
    decision = decide(rollout, observe(digest=None, error="gone"), at(10))
    assert decision.scales == () and decision.not_rebuilt == ()


# --- seeding the pods a scale-up creates ----------------------------------------------------


def pod(name: str, **kw: Any) -> ObservedPod:
    """A verified, Ready pod of revision "abc" unless told otherwise."""
    base: dict[str, Any] = {
        "revision_hash": "abc",
        "uid": f"uid-{name}-0000",
        "created": "2026-11-30T00:00:00Z",
        "pod_ip": "10.0.0.1",
        "ready": True,
        "containers_ready": True,
        "weights_verified": True,
        "containers": ("server",),
    }
    return ObservedPod(name, **{**base, **kw})


@pytest.mark.parametrize(
    ("pods", "root"),
    [
        ((pod("a"),), "a"),
        ((pod("b", created="2026-11-30T02:00:00Z"), pod("a")), "a"),  # the oldest
        ((pod("b"), pod("a")), "a"),  # same age: by name
        ((pod("a", weights_verified=False),), None),
        ((pod("a", ready=False),), None),
        ((pod("a", pod_ip=None),), None),
        ((pod("a", deleting=True),), None),
        ((pod("a", revision_hash="zzz"),), None),
        ((), None),
    ],
)
def test_seed_root_is_the_oldest_verified_ready_pod_of_the_revision(
    pods: tuple[ObservedPod, ...], root: str | None
) -> None:
    found = seed_root(pods, "abc")
    assert (found.name if found else None) == root


def env_of(seed: Any) -> dict[str, str]:
    return {e.name: e.value for e in seed.env}


@pytest.mark.parametrize(
    ("broadcast", "pods", "expected"),
    [
        (
            True,
            (pod("root", pod_ip="10.0.0.9"),),
            {
                "WEIGHTSHIP_SEED_ROOT": "http://10.0.0.9:8000",
                "WEIGHTSHIP_SEED_GROUP": "llm-abc-1to4-uid-root",
                "WEIGHTSHIP_SEED_WORLD_SIZE": "4",
            },
        ),
        (
            False,
            (pod("root"),),
            {
                "WEIGHTSHIP_SEED_ROOT": "",
                "WEIGHTSHIP_SEED_GROUP": "",
                "WEIGHTSHIP_SEED_WORLD_SIZE": "",
            },
        ),
        (
            True,
            (pod("loading", weights_verified=False),),
            {
                "WEIGHTSHIP_SEED_ROOT": "",
                "WEIGHTSHIP_SEED_GROUP": "",
                "WEIGHTSHIP_SEED_WORLD_SIZE": "",
            },
        ),
    ],
)
def test_scale_up_seed_env(
    broadcast: bool, pods: tuple[ObservedPod, ...], expected: dict[str, str]
) -> None:
    rollout = make_rollout(STEPS, seeding={"broadcast": broadcast, "backend": "gloo"})
    rs = replica_set("abc", 1, containers=("server", "sidecar"))
    seed = scale_up_seed(rollout.spec, pods, rs, 4)
    assert seed is not None
    assert seed.containers == ("server", "sidecar")  # the template's, not only the root's
    values = env_of(seed)
    assert expected.items() <= values.items()
    assert values["WEIGHTSHIP_SEED_BACKEND"] == "gloo"


@pytest.mark.parametrize("target", [1, 0])
def test_no_seed_env_unless_the_replica_set_grows(target: int) -> None:
    rollout = make_rollout(STEPS)
    assert scale_up_seed(rollout.spec, (pod("root"),), replica_set("abc", 1), target) is None


def test_without_known_template_containers_the_root_names_them() -> None:
    rollout = make_rollout(STEPS)
    seed = scale_up_seed(rollout.spec, (pod("root"),), replica_set("abc", 1), 2)
    assert seed is not None and seed.containers == ("server",)


def test_decide_seeds_a_growing_canary_from_its_verified_pod() -> None:
    rollout, stable, canary = canary_running()
    root = pod("llm-c-1", revision_hash=canary, pod_ip="10.0.0.5")
    seen = observe(
        replica_set(stable, 4),
        replica_set(canary, 1, containers=("server",)),
        digest=DIGEST_B,
        prefetch=staged(DIGEST_B),
        pods=(root,),
    )
    rollout = with_status(rollout, decide(rollout, seen, at(70)))  # 25% verified: step 2
    decision = decide(rollout, seen, at(71))
    (action,) = decision.scales
    assert isinstance(action, ScaleAction)
    assert (action.role, action.replicas, action.name) == ("canary", 2, f"llm-{canary}")
    assert action.seed is not None
    values = env_of(action.seed)
    assert values["WEIGHTSHIP_SEED_ROOT"] == "http://10.0.0.5:8000"
    assert values["WEIGHTSHIP_SEED_GROUP"] == f"llm-{canary}-1to2-uid-llm-"  # uid's first 8
    assert values["WEIGHTSHIP_SEED_WORLD_SIZE"] == "2"


def test_scaling_down_carries_no_seed_env() -> None:
    rollout, stable, canary = canary_running()
    seen = observe(replica_set(stable, 4), replica_set(canary, 3), digest=DIGEST_B)
    (action,) = decide(rollout, seen, at(70)).scales
    assert isinstance(action, ScaleAction) and action.seed is None


# --- trivial gates --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("validation", "pods", "opened"),
    [
        ({"checksum": False}, (pod("a", weights_verified=False),), ["a"]),
        ({"checksum": False}, (pod("a"),), []),  # open already
        ({"checksum": False}, (pod("a", weights_verified=False, containers_ready=False),), []),
        ({"checksum": True}, (pod("a", weights_verified=False),), []),  # the verifier's job
        (
            {
                "checksum": False,
                "goldenPrompts": [{"name": "p", "prompt": "x", "expect": {"contains": "y"}}],
            },
            (pod("a", weights_verified=False),),
            [],
        ),
        (
            {"checksum": False},
            (pod("a", weights_verified=False), pod("b", weights_verified=False)),
            ["a", "b"],
        ),
    ],
)
def test_gates_open_by_themselves_only_with_nothing_to_verify(
    validation: dict[str, Any], pods: tuple[ObservedPod, ...], opened: list[str]
) -> None:
    rollout = make_rollout(STEPS, validation=validation)
    gates = pod_gates(rollout.spec, pods, T0)
    assert [g.pod for g in gates] == opened
    assert all(g == SetGate(g.pod, "True", "NothingToVerify", g.message, T0) for g in gates)


def test_decide_opens_trivial_gates_even_while_the_manifest_is_missing() -> None:
    rollout = make_rollout(STEPS, validation={"checksum": False})
    decision = decide(rollout, observe(digest=None, pods=(pod("a", weights_verified=False),)), T0)
    assert [g.pod for g in decision.pod_gates] == ["a"]


# --- staged node labels ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("nodes", "labelled"),
    [
        ((NodeStaging("n1", "Staged"),), ["n1"]),
        ((NodeStaging("n1", "Staged", labelled=True),), []),
        ((NodeStaging("n1", "Staging"), NodeStaging("n2", "Failed")), []),
        ((NodeStaging("n1", "Staged"), NodeStaging("n2", "Pending")), ["n1"]),
    ],
)
def test_staged_nodes_without_the_label_get_it(
    nodes: tuple[NodeStaging, ...], labelled: list[str]
) -> None:
    rollout, stable = healthy_rollout(STEPS)
    prefetch = PrefetchObservation(DIGEST_A, len(nodes), 1, nodes=nodes)
    decision = decide(rollout, observe(replica_set(stable, 4), prefetch=prefetch), at(10))
    assert decision.node_labels == tuple(NodeLabel(n, DIGEST_A) for n in labelled)


def test_no_node_labels_without_prefetch_observation() -> None:
    rollout, stable = healthy_rollout(STEPS)
    assert decide(rollout, observe(replica_set(stable, 4)), at(10)).node_labels == ()


# --- traffic --------------------------------------------------------------------------------


def test_without_a_canary_the_canary_service_selects_the_stable() -> None:
    routing = {
        "gatewayAPI": {
            "httpRoute": {"name": "llm"},
            "stableBackend": "llm-stable",
            "canaryBackend": "llm-canary",
        }
    }
    strategy = copy.deepcopy(VALID_MANIFEST["spec"]["strategy"])
    strategy["canary"]["trafficRouting"] = routing
    rollout, stable = healthy_rollout(STEPS, strategy=strategy)
    decision = decide(rollout, observe(replica_set(stable, 4), prefetch=staged(DIGEST_A)), at(1))
    assert decision.traffic is not None
    assert (decision.traffic.stable_hash, decision.traffic.canary_hash) == (stable, stable)
    assert (decision.traffic.stable, decision.traffic.canary) == (100, 0)


def test_the_gate_takes_a_verdict_it_does_not_show_yet() -> None:
    """The verifier's verdict is an observation: the core sets the gate from it, once."""
    from weightship.core.observed import PodVerdict

    rollout = make_rollout(STEPS)
    verdict = PodVerdict("False", "GoldenPromptFailed", "expected Paris", T0, (("a/b", "1"),))
    waiting = pod("a", weights_verified=False, verdict=verdict)
    (gate,) = pod_gates(rollout.spec, (waiting,), T0)
    assert gate == SetGate(
        "a", "False", "GoldenPromptFailed", "expected Paris", T0, (("a/b", "1"),)
    )
    shown = pod(
        "a",
        weights_verified=False,
        gate_reason="GoldenPromptFailed",
        gate_message="expected Paris",
        verdict=verdict,
    )
    assert pod_gates(rollout.spec, (shown,), T0) == ()
    draining = pod("a", weights_verified=False, gate_reason="Draining", verdict=verdict)
    assert pod_gates(rollout.spec, (draining,), T0) == ()
