"""One reconcile: read the rollout, observe, decide, apply. Status is the only memory.

Everything read comes from one snapshot of the watch caches (`cache.ClusterView`), taken
once: observe projects it for `decide`, and apply acts on the same pods `decide` saw. A
decision that changed the status is followed, in the same reconcile, by the decisions that
need no new observation (`_follow_on`, each on a fresh snapshot), and one status patch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from weightship.api.models import ModelRollout
from weightship.api.status import ModelRolloutStatus
from weightship.controller import apply, metrics
from weightship.controller.builders import DEFAULT_CACHE_DIR
from weightship.controller.cache import ClusterView, RolloutKey
from weightship.controller.events import EventPoster
from weightship.controller.kube import Kube
from weightship.controller.observe import (
    ManifestResolver,
    MeasureFn,
    Measurements,
    Templates,
    observe,
    prometheus_measure,
)
from weightship.controller.seedkey import SeedKeys
from weightship.controller.swapper import Swapper
from weightship.controller.verifier import Verifier
from weightship.core.decide import decide, decide_invalid_spec
from weightship.core.decision import Decision
from weightship.core.gates import DEFAULT_GATES, GateSet
from weightship.core.observed import PodSwap, PodVerdict
from weightship.notify import blocks
from weightship.notify.slack import SlackSender

log = logging.getLogger(__name__)

IDLE_RECHECK_SECONDS = 30.0
VERIFY_RECHECK_SECONDS = 2.0  # while pods wait for a verdict (their server is loading)
SLOW_RECONCILE_SECONDS = 1.0  # logged, to see which rollout a high p99 comes from
LOOKUP_RECHECK_SECONDS = 1.0  # a measurement is running; its completion requeues sooner
FOLLOW_ON_LINKS = 3  # decisions after the first in one reconcile (_follow_on)


def _never(key: RolloutKey) -> None:
    return None


@dataclass
class Reconciler:
    kube: Kube
    view: ClusterView
    gates: GateSet = DEFAULT_GATES
    measure: MeasureFn = prometheus_measure
    slack: SlackSender | None = None
    verifier: Verifier | None = None
    swapper: Swapper | None = None
    """Follows in-place swaps on the pods' servers and reports how they ended (None: the
    decision's swaps are recorded, not carried out)."""
    requeue: Callable[[RolloutKey], None] = _never
    """Called when a lookup the reconcile did not wait for completes (the work queue's add)."""
    cache_dir: str = DEFAULT_CACHE_DIR  # the node cache (install-time: WEIGHTSHIP_CACHE_DIR)
    events: EventPoster | None = None
    """Posts Events off the worker (None: the reconcile posts them itself)."""
    manifests: ManifestResolver = field(init=False)
    measurements: Measurements = field(init=False)
    templates: Templates = field(init=False)
    seed_keys: SeedKeys = field(init=False)

    def __post_init__(self) -> None:
        self.kube.view = self.view
        self.seed_keys = SeedKeys(self.kube)
        self.manifests = ManifestResolver(self.kube, self.requeue)
        self.measurements = Measurements(self.measure, self.requeue)
        self.templates = Templates(self.kube)

    def close(self) -> None:
        self.manifests.lookups.shutdown()
        self.measurements.lookups.shutdown()
        if self.events is not None:
            self.events.close()

    def once(self, namespace: str, name: str) -> float | None:
        """Reconcile one rollout. Returns seconds until the next run (None: it is gone)."""
        started = time.monotonic()
        laps = _Laps(started)
        try:
            return self._once(namespace, name, laps)
        except Exception:
            metrics.RECONCILE_ERRORS.inc()
            raise
        finally:
            seconds = time.monotonic() - started
            metrics.RECONCILES.inc()
            metrics.RECONCILE_SECONDS.observe(seconds)
            if seconds >= SLOW_RECONCILE_SECONDS:
                log.info(
                    "reconciling %s/%s took %.2f s (%s)", namespace, name, seconds, laps.summary()
                )

    def _once(self, namespace: str, name: str, laps: _Laps) -> float | None:
        objects = self.view.rollout_objects(namespace, name)
        laps.lap("read")
        if objects is None:
            metrics.forget_rollout(namespace, name)
            return None
        body, pods = objects.rollout, objects.pods
        now = datetime.now(UTC)
        resource_version = body["metadata"]["resourceVersion"]
        try:
            rollout = ModelRollout.from_body(body)
        except ValidationError as e:
            status = ModelRolloutStatus.model_validate(body.get("status") or {})
            decision = decide_invalid_spec(
                status, int(body["metadata"].get("generation", 0)), _first_error(e), now
            )
            self._write(body, status, decision, resource_version)
            metrics.record_rollout(namespace, name, decision.status, IDLE_RECHECK_SECONDS)
            return IDLE_RECHECK_SECONDS
        observation = observe(
            self.view,
            objects,
            rollout,
            self.manifests,
            self.measurements,
            self.templates,
            now,
            *self._reports(pods),
        )
        laps.lap("observe")
        if observation is None:
            return None  # the manifest is being read; its completion requeues the rollout
        observed = observation.observed
        decision = decide(rollout, observed, now, self.gates)
        laps.lap("decide")
        apply.carry_out(
            self.kube, rollout, decision, cache_dir=self.cache_dir, seed_keys=self.seed_keys
        )
        self._forget_scaled(namespace, decision)
        laps.lap("apply")
        decision = self._follow_on(rollout, decision, now)
        laps.lap("follow-on")
        if self.swapper is not None:
            self.swapper.submit(rollout, decision.swaps, pods)
            verifying = self.swapper.resume(rollout, pods)
        else:
            verifying = False
        verifying = (self.verifier is not None and self.verifier.submit(rollout, pods)) or verifying
        self._write(body, rollout.status, decision, resource_version)
        laps.lap("status")
        delay = IDLE_RECHECK_SECONDS if decision.requeue_after is None else decision.requeue_after
        metrics.record_rollout(namespace, name, decision.status, delay)
        if observation.waiting:
            delay = max(delay, LOOKUP_RECHECK_SECONDS)
        return min(delay, VERIFY_RECHECK_SECONDS) if verifying else delay

    def _follow_on(self, rollout: ModelRollout, decision: Decision, now: datetime) -> Decision:
        """Decide again on the status just decided, while that changes it: the links of a
        chain that need no new observation (a step completed and the next one begins;
        promoted, then serving) go out as one status patch, not one each (each a write, its
        watch event and another reconcile: 7 status patches per revision change of a
        two-step canary, 3 with this). Each link reads the view again, which holds the
        writes so far (its overlay), so no link repeats an action. Returns the last link's
        decision with every link's events, notifications and swaps."""
        links = [decision]
        current = rollout
        meta = rollout.metadata
        requeue_after: float | None = 0.0  # unless a decide on the final status says
        for _ in range(FOLLOW_ON_LINKS):
            last = links[-1]
            if last.workloads or not last.status_patch(current.status):
                requeue_after = last.requeue_after  # settled (or a Deployment to read again)
                break
            current = current.model_copy(update={"status": last.status})
            objects = self.view.rollout_objects(meta.namespace or "default", meta.name)
            if objects is None:
                break
            observation = observe(
                self.view,
                objects,
                current,
                self.manifests,
                self.measurements,
                self.templates,
                now,
                *self._reports(objects.pods),
            )
            if observation is None:
                break
            following = decide(current, observation.observed, now, self.gates)
            if not following.status_patch(current.status) and not _acts(following):
                requeue_after = following.requeue_after  # decided on the final status
                break
            apply.carry_out(
                self.kube, current, following, cache_dir=self.cache_dir, seed_keys=self.seed_keys
            )
            self._forget_scaled(meta.namespace or "default", following)
            links.append(following)
        if len(links) == 1:
            return decision
        return replace(
            links[-1],
            # Each link's swaps were recorded by its apply: the swapper follows them all.
            swaps=tuple(s for link in links for s in link.swaps),
            events=tuple(e for link in links for e in link.events),
            notifications=tuple(n for link in links for n in link.notifications),
            requeue_after=requeue_after,
        )

    def _reports(
        self, pods: list[dict[str, Any]]
    ) -> tuple[dict[str, PodVerdict], dict[str, PodSwap]]:
        """What the observation sources found that the pods do not show yet: the
        verifier's verdicts and the swapper's reports, by pod uid."""
        return (
            self.verifier.pending(pods) if self.verifier is not None else {},
            self.swapper.pending(pods) if self.swapper is not None else {},
        )

    def _forget_scaled(self, namespace: str, decision: Decision) -> None:
        """A workloadRef Deployment just scaled is read again, not the count before."""
        for scaled in decision.workloads:
            self.templates.forget(namespace, scaled.name)

    def _write(
        self,
        body: dict[str, object],
        old: ModelRolloutStatus,
        decision: Decision,
        resource_version: str,
    ) -> None:
        patch = decision.status_patch(old)
        meta = body["metadata"]
        assert isinstance(meta, dict)
        if patch:
            self.kube.patch_rollout_status(meta["namespace"], meta["name"], resource_version, patch)
        # Events and messages only after the status write succeeded: a 409 retries
        # without duplicates.
        if self.events is None:
            apply.apply_events(self.kube, dict(body), decision)
        else:
            for event in decision.events:
                self.events.submit(dict(body), event.type, event.reason, event.message)
        if decision.notifications:
            self._notify(dict(body), decision)

    def _notify(self, body: dict[str, Any], decision: Decision) -> None:
        slack = ((body.get("spec") or {}).get("notifications") or {}).get("slack")
        if not slack or self.slack is None:
            return
        ref = slack["webhookSecretRef"]
        namespace = body["metadata"]["namespace"]
        try:
            url = self.kube.secret_data(namespace, ref["name"])[ref.get("key", "url")]
        except Exception as e:  # a missing Secret must not stop the rollout
            self.kube.event(
                body,
                "Warning",
                "NotificationFailed",
                f"cannot read the Slack webhook from Secret {ref['name']}: {type(e).__name__}",
            )
            return
        for note in decision.notifications:
            self.slack.submit(
                url,
                blocks.payload(note, slack.get("channel")),
                on_failure=lambda error: self.kube.event(
                    body, "Warning", "NotificationFailed", error
                ),
            )


class _Laps:
    """Where one reconcile's time went, for the slow-reconcile log line: seconds per
    stage (read the caches, observe, decide, apply's writes, the status write)."""

    def __init__(self, started: float) -> None:
        self.last = started
        self.seconds: dict[str, float] = {}

    def lap(self, stage: str) -> None:
        now = time.monotonic()
        self.seconds[stage] = self.seconds.get(stage, 0.0) + now - self.last
        self.last = now

    def summary(self) -> str:
        return ", ".join(f"{stage} {s:.2f}" for stage, s in self.seconds.items()) or "-"


def _acts(decision: Decision) -> bool:
    """Whether carrying the decision out writes anything besides the status."""
    return bool(
        decision.scales
        or decision.node_labels
        or decision.pod_gates
        or decision.drain_pods
        or decision.undrain_pods
        or decision.workloads
        or decision.swaps
        or decision.swap_records
        or decision.retemplates
        or decision.restart_pods
        or decision.reverify_pods
        or decision.events
        or decision.notifications
    )


def _first_error(error: ValidationError) -> str:
    first = error.errors()[0]
    location = ".".join(str(p) for p in first["loc"])
    return f"{location}: {first['msg']}"
