"""Apply a Decision: ReplicaSets first, then routes, node labels and pod gates, and the
status patch last (guarded by resourceVersion). Every action is idempotent, so a crash at
any point is repaired by the next reconcile, which observes and decides again.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Any

from weightship.api.models import ModelRollout
from weightship.controller.builders import (
    REVISION_LABEL,
    VERIFIED_GATE,
    replicaset_body,
    scale_patch,
    staged_node_label,
)
from weightship.controller.kube import Kube
from weightship.controller.pods import is_true
from weightship.controller.seeding import scale_up_env
from weightship.core.decision import Decision
from weightship.core.observed import Observed

log = logging.getLogger(__name__)


def apply_scales(
    kube: Kube,
    rollout: ModelRollout,
    observed: Observed,
    decision: Decision,
    pods: list[dict[str, Any]],
) -> None:
    namespace = rollout.metadata.namespace or "default"
    canary = decision.status.canary_revision
    stable = decision.status.stable_revision
    for action in decision.scales:
        if not action.create:
            assert action.name is not None
            seen = observed.replica_set(action.revision_hash)
            size = seen.replicas if seen is not None else 0
            seeding = scale_up_env(
                rollout, pods, action.name, action.revision_hash, size, action.replicas
            )
            env, containers = seeding if seeding is not None else (None, [])
            kube.scale_replicaset(
                namespace, action.name, scale_patch(action.replicas, containers, env)
            )
            continue
        # Only the spec's current revision can be built from the spec's template.
        current = next(
            (
                r
                for r in (canary, stable)
                if r is not None and r.pod_template_hash == action.revision_hash
            ),
            None,
        )
        if current is None or current.manifest_digest is None:
            log.warning(
                "cannot rebuild ReplicaSet for revision %s: its template is gone",
                action.revision_hash,
            )
            continue
        template = (
            rollout.spec.template.to_k8s()
            if rollout.spec.template is not None
            else dict(observed.workload_template or {})
        )
        staged_elsewhere = stable is not None and stable.manifest_digest == current.manifest_digest
        kube.create_replicaset(
            replicaset_body(
                rollout,
                template=template,
                revision_hash=action.revision_hash,
                manifest_digest=current.manifest_digest,
                replicas=action.replicas,
                require_staged=rollout.spec.prefetch.enabled
                and not staged_elsewhere
                and action.role == "canary",
            )
        )


def apply_traffic(kube: Kube, rollout: ModelRollout, decision: Decision) -> None:
    """Gateway API routing: point the stable and canary Services at their revisions, then
    set the HTTPRoute's backend weights. Selectors first, so weight never reaches a Service
    that still selects the wrong pods."""
    routing = rollout.spec.strategy.canary.traffic_routing
    gateway = routing.gateway_api if routing is not None else None
    traffic = decision.traffic
    if traffic is None or gateway is None:
        return
    namespace = rollout.metadata.namespace or "default"
    selector = dict(rollout.spec.selector.match_labels or {})
    for service, revision in (
        (gateway.stable_backend, traffic.stable_hash),
        (gateway.canary_backend, traffic.canary_hash or traffic.stable_hash),
    ):
        if revision is not None:
            kube.set_service_selector(namespace, service, {**selector, REVISION_LABEL: revision})
    kube.set_route_weights(
        gateway.http_route.namespace or namespace,
        gateway.http_route.name,
        {gateway.stable_backend: traffic.stable, gateway.canary_backend: traffic.canary},
    )


def label_staged_nodes(kube: Kube, observed: Observed) -> None:
    """Canary pods require this label: it appears once a node's agent has staged them."""
    prefetch = observed.prefetch
    if prefetch is None:
        return
    label = staged_node_label(prefetch.digest)
    for node in prefetch.nodes:
        if node.state == "Staged":
            kube.label_node(node.name, label, "true")


def open_trivial_gates(kube: Kube, rollout: ModelRollout, pods: list[dict[str, Any]]) -> None:
    """With nothing to verify (no checksum, no golden prompts) the weights-verified gate
    opens once the containers are ready. Anything to verify is the verifier's job."""
    validation = rollout.spec.validation
    if validation.checksum or validation.golden_prompts:
        return
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    for pod in pods:
        if is_true(pod, "ContainersReady") and not is_true(pod, VERIFIED_GATE):
            kube.patch_pod_condition(
                pod["metadata"]["namespace"],
                pod["metadata"]["name"],
                {
                    "type": VERIFIED_GATE,
                    "status": "True",
                    "reason": "NothingToVerify",
                    "message": "spec.validation has no checksum and no golden prompts",
                    "lastTransitionTime": now,
                },
            )


def apply_events(kube: Kube, body: dict[str, Any], decision: Decision) -> None:
    for event in decision.events:
        kube.event(body, event.type, event.reason, event.message)
