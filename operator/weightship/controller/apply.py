"""Carry out a Decision: ReplicaSets first, then routes, node labels and pod gates; the
status patch and events come after (reconcile.py), guarded by resourceVersion. Every
choice was made by the core (weightship.core.decide); this module only renders bodies
(builders.py) and writes them. Every write is idempotent, so a crash at any point is
repaired by the next reconcile, which observes and decides again.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

from weightship.api.models import ModelRollout
from weightship.api.names import DELETION_COST_ANNOTATION, REVISION_LABEL, staged_node_label
from weightship.controller.builders import (
    DEFAULT_CACHE_DIR,
    DRAINED_DELETION_COST,
    gate_condition,
    replicaset_body,
    replicaset_name,
    retemplate_patch,
    scale_patch,
    swap_record_write,
)
from weightship.controller.kube import Kube, PodConditionWrite
from weightship.controller.seedkey import SeedKeys
from weightship.core.decision import CreateReplicaSet, Decision, RecordSwap, ScaleWorkload
from weightship.core.pod_gates import draining, pending

log = logging.getLogger(__name__)


def carry_out(
    kube: Kube,
    rollout: ModelRollout,
    decision: Decision,
    *,
    cache_dir: str = DEFAULT_CACHE_DIR,
    seed_keys: SeedKeys | None = None,
) -> None:
    """Everything but the status patch and the events, in order. ``cache_dir`` is the node
    cache the pods' model mounts are under (the operator's install-time setting);
    ``seed_keys`` the operator's record of the seeding keys already made."""
    apply_replica_sets(kube, rollout, decision, cache_dir=cache_dir, seed_keys=seed_keys)
    apply_traffic(kube, rollout, decision)
    apply_workloads(kube, rollout.metadata.namespace or "default", decision.workloads, rollout)
    for label in decision.node_labels:
        kube.label_node(label.node, staged_node_label(label.manifest_digest), "true")
    namespace = rollout.metadata.namespace or "default"
    kube.patch_pod_conditions(namespace, pod_condition_writes(decision))
    for pod in decision.restart_pods:
        log.info("restarting pod %s/%s: its swap back to stable failed", namespace, pod)
        kube.delete_pod(namespace, pod)


def pod_condition_writes(decision: Decision) -> list[PodConditionWrite]:
    """The decision's gate, reverify, drain, undrain and swap-record writes, in that order
    (a swap's record last: its gate is the one the pod keeps)."""
    cost = {DELETION_COST_ANNOTATION: DRAINED_DELETION_COST}
    now = datetime.now(UTC)
    return [
        *(
            PodConditionWrite(g.pod, gate_condition(g), dict(g.annotations) or None)
            for g in decision.pod_gates
        ),
        *(
            PodConditionWrite(pod, gate_condition(pending(pod, "its swap was refused", now)))
            for pod in decision.reverify_pods
        ),
        *(PodConditionWrite(d.pod, gate_condition(draining(d)), cost) for d in decision.drain_pods),
        *(
            PodConditionWrite(
                pod,
                gate_condition(pending(pod, "its scale-down was called off", now)),
                {DELETION_COST_ANNOTATION: None},
            )
            for pod in decision.undrain_pods
        ),
        *map(_swap_record_write, decision.swap_records),
    ]


def _swap_record_write(record: RecordSwap) -> PodConditionWrite:
    condition, annotations, labels = swap_record_write(record)
    return PodConditionWrite(record.pod, condition, annotations, labels)


def apply_replica_sets(
    kube: Kube,
    rollout: ModelRollout,
    decision: Decision,
    *,
    cache_dir: str = DEFAULT_CACHE_DIR,
    seed_keys: SeedKeys | None = None,
) -> None:
    namespace = rollout.metadata.namespace or "default"
    keys = seed_keys if seed_keys is not None else SeedKeys(kube)
    for revision in decision.not_rebuilt:
        log.warning(
            "cannot rebuild ReplicaSet %s/%s: only the spec's current revision has a template",
            namespace,
            replicaset_name(rollout.metadata.name, revision),
        )
    for action in decision.scales:
        if isinstance(action, CreateReplicaSet):
            keys.ensure(rollout)  # before the pods that read it exist
            kube.create_replicaset(
                replicaset_body(
                    rollout,
                    template=action.template,
                    revision_hash=action.revision_hash,
                    manifest_digest=action.manifest_digest,
                    replicas=action.replicas,
                    require_staged=action.require_staged,
                    cache_dir=cache_dir,
                    template_hash=action.template_hash,
                )
            )
        else:
            kube.scale_replicaset(namespace, action.name, scale_patch(action.replicas, action.seed))
    for retemplate in decision.retemplates:
        body = replicaset_body(
            rollout,
            template=retemplate.template,
            revision_hash=retemplate.revision_hash,
            manifest_digest=retemplate.manifest_digest,
            replicas=rollout.spec.replicas,
            require_staged=False,
            cache_dir=cache_dir,
            template_hash=retemplate.template_hash,
        )
        kube.retemplate_replicaset(namespace, retemplate.name, retemplate_patch(body))


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
        (gateway.canary_backend, traffic.canary_hash),
    ):
        if revision is not None:
            kube.set_service_selector(namespace, service, {**selector, REVISION_LABEL: revision})
    kube.set_route_weights(
        gateway.http_route.namespace or namespace,
        gateway.http_route.name,
        {gateway.stable_backend: traffic.stable, gateway.canary_backend: traffic.canary},
    )


def apply_workloads(
    kube: Kube,
    namespace: str,
    workloads: Iterable[ScaleWorkload],
    rollout: ModelRollout | None = None,
) -> None:
    """spec.workloadRef Deployments: scaled down or given back (core.workload), each
    action's event posted once its scale is done (on ``rollout``)."""
    for action in workloads:
        if not kube.scale_deployment(namespace, action.name, action.replicas):
            log.info("Deployment %s/%s is gone: nothing to scale", namespace, action.name)
        elif action.event is not None and rollout is not None:
            meta = rollout.metadata
            body = {"metadata": {"name": meta.name, "namespace": namespace, "uid": meta.uid}}
            event = action.event
            kube.event(body, event.type, event.reason, event.message)


def apply_events(kube: Kube, body: dict[str, Any], decision: Decision) -> None:
    for event in decision.events:
        kube.event(body, event.type, event.reason, event.message)
