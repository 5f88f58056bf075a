"""Which nodes stage a rollout's weights: the operator counts them for minStagedPercent
and publishes them in status.prefetchNodeSelector, which the node agents follow (they
cannot read a workloadRef's Deployment)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from weightship.api.spec import ModelRolloutSpec

MAX_SELECTOR_LABELS = 64


def prefetch_node_selector(
    spec: ModelRolloutSpec, template: Mapping[str, Any] | None
) -> dict[str, str]:
    """spec.prefetch.nodeSelector, or else the pod template's spec.nodeSelector; {} (every
    node) when both are empty. Node affinity and taints are not read: staging may reach
    nodes the pods cannot land on, never miss one they can. Entries that are not strings,
    and any past 64 (sorted by key), are left out, which only widens the selection."""
    if spec.prefetch.node_selector:
        return dict(spec.prefetch.node_selector)
    pod_spec = (template or {}).get("spec")
    selector = pod_spec.get("nodeSelector") if isinstance(pod_spec, Mapping) else None
    if not isinstance(selector, Mapping):
        return {}
    labels = sorted(
        (k, v) for k, v in selector.items() if isinstance(k, str) and isinstance(v, str)
    )
    return dict(labels[:MAX_SELECTOR_LABELS])
