"""Kubernetes adapter for the controller: reads and writes, with retries at the edge
(`weightship.kube.client.api_retry`, the policy the agent's adapter uses too).

All calls are synchronous (the kubernetes client is): the controller runs them from its
reconcile workers, i.e. in threads, never on the event loop. Reads of what the operator
watches come from `cache.ClusterView`, not from here; each write's answer is handed to the
view (`record_write`), so the next reconcile sees it even before the watch delivers it.
"""

from __future__ import annotations

import base64
import contextlib
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from kubernetes import client
from kubernetes.client.rest import ApiException

from weightship.api.names import API_VERSION, GROUP, ROLLOUT_KIND, ROLLOUT_PLURAL, VERSION
from weightship.kube.client import api_retry

if TYPE_CHECKING:
    from weightship.controller.cache import ClusterView


POD_WRITERS = 8
"""Pod condition writes in flight at once per operator: a scale-down of hundreds of pods
drains them all in one decision, and one write after another took seconds."""


class Conflict(Exception):
    """The object changed since it was read (HTTP 409): observe again."""


@dataclass(frozen=True)
class PodConditionWrite:
    pod: str
    condition: dict[str, Any]
    annotations: Mapping[str, str | None] | None = None
    labels: Mapping[str, str] | None = None


class Kube:
    def __init__(self, api: client.ApiClient) -> None:
        self.api = api
        self.core = client.CoreV1Api(api)
        self.apps = client.AppsV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.view: ClusterView | None = None  # set by the operator; None in plain scripts
        # Threads start on first use; idle ones cost nothing.
        self._pod_writers = ThreadPoolExecutor(POD_WRITERS, thread_name_prefix="pod-write")

    def _wrote(self, kind: str, body: dict[str, Any]) -> None:
        if self.view is not None:
            self.view.record_write(kind, body)

    def to_dict(self, obj: Any) -> dict[str, Any]:
        return dict(self.api.sanitize_for_serialization(obj))

    # ---- ModelRollout -----------------------------------------------------------------
    @api_retry
    def patch_rollout_status(
        self, namespace: str, name: str, resource_version: str, patch: dict[str, Any]
    ) -> None:
        """Merge-patch status, guarded by resourceVersion so no concurrent write is lost."""
        body = {"metadata": {"resourceVersion": resource_version}, "status": patch}
        try:
            answer = self.custom.patch_namespaced_custom_object_status(
                GROUP, VERSION, namespace, ROLLOUT_PLURAL, name, body
            )
        except ApiException as e:
            if e.status == 409:
                raise Conflict(f"{namespace}/{name} changed; re-reading") from e
            if e.status == 404:
                return  # deleted meanwhile: its delete event ends its reconciles
            raise
        self._wrote("ModelRollout", dict(answer))

    # ---- ReplicaSets and pods ---------------------------------------------------------
    @api_retry
    def create_replicaset(self, body: dict[str, Any]) -> None:
        try:
            created = self.apps.create_namespaced_replica_set(body["metadata"]["namespace"], body)
        except ApiException as e:
            # Already there: a repeated create after a restart, or before the watch brought
            # the one this operator created. Done either way.
            if e.status != 409:
                raise
            return
        self._wrote("ReplicaSet", self.to_dict(created))

    @api_retry
    def scale_replicaset(self, namespace: str, name: str, patch: dict[str, Any]) -> None:
        """A strategic merge patch (builders.scale_patch): the size, maybe the pods' env."""
        self._wrote(
            "ReplicaSet",
            self.to_dict(self.apps.patch_namespaced_replica_set(name, namespace, patch)),
        )

    @api_retry
    def patch_pod_condition(
        self,
        namespace: str,
        name: str,
        condition: dict[str, Any],
        annotations: dict[str, str | None] | None = None,
        labels: dict[str, str] | None = None,
    ) -> None:
        """Set one condition (merged by type) and, in the same write, annotations and
        labels: the status subresource carries metadata too, so no write access to pod
        specs is needed."""
        patch: dict[str, Any] = {"status": {"conditions": [condition]}}
        if annotations or labels:
            patch["metadata"] = {}
        if annotations:
            patch["metadata"]["annotations"] = annotations
        if labels:
            patch["metadata"]["labels"] = labels
        self._wrote(
            "Pod", self.to_dict(self.core.patch_namespaced_pod_status(name, namespace, patch))
        )

    def patch_pod_conditions(self, namespace: str, writes: Sequence[PodConditionWrite]) -> None:
        """Many pods' conditions, up to POD_WRITERS at once; one pod's writes stay in their
        order. Raises the first failure once every write has been tried."""
        by_pod: dict[str, list[PodConditionWrite]] = {}
        for write in writes:
            by_pod.setdefault(write.pod, []).append(write)

        def one_pod(pod_writes: list[PodConditionWrite]) -> None:
            for w in pod_writes:
                annotations = dict(w.annotations) if w.annotations else None
                labels = dict(w.labels) if w.labels else None
                self.patch_pod_condition(namespace, w.pod, w.condition, annotations, labels)

        if len(by_pod) <= 1:
            for pod_writes in by_pod.values():
                one_pod(pod_writes)
            return
        futures = [self._pod_writers.submit(one_pod, w) for w in by_pod.values()]
        errors = [e for e in (f.exception() for f in futures) if e is not None]
        if errors:
            raise errors[0]

    @api_retry
    def pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        """A pod as the API has it now (the swapper's wait for unready); None when gone."""
        try:
            return self.to_dict(self.core.read_namespaced_pod(name, namespace))
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    @api_retry
    def delete_pod(self, namespace: str, name: str) -> None:
        try:
            self.core.delete_namespaced_pod(name, namespace)
        except ApiException as e:
            if e.status != 404:
                raise

    @api_retry
    def retemplate_replicaset(self, namespace: str, name: str, patch: list[dict[str, Any]]) -> None:
        """A JSON patch of an in-place ReplicaSet (builders.retemplate_patch)."""
        self._wrote(
            "ReplicaSet",
            self.to_dict(self.apps.patch_namespaced_replica_set(name, namespace, patch)),
        )

    @api_retry
    def deployment(self, namespace: str, name: str) -> dict[str, Any] | None:
        """A Deployment's spec (template, replicas); None when there is none."""
        try:
            dep = self.apps.read_namespaced_deployment(name, namespace)
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        return dict(self.to_dict(dep)["spec"])

    @api_retry
    def scale_deployment(self, namespace: str, name: str, replicas: int) -> bool:
        """Set a Deployment's spec.replicas through its scale subresource (the only write
        the operator may make to a Deployment); False when it does not exist."""
        try:
            self.apps.patch_namespaced_deployment_scale(
                name, namespace, {"spec": {"replicas": replicas}}
            )
        except ApiException as e:
            if e.status == 404:
                return False
            raise
        return True

    # ---- Secrets, nodes, caches -------------------------------------------------------
    @api_retry
    def secret_data(self, namespace: str, name: str) -> dict[str, str]:
        secret = self.core.read_namespaced_secret(name, namespace)
        return {k: base64.b64decode(v).decode() for k, v in (secret.data or {}).items()}

    @api_retry
    def label_node(self, name: str, label: str, value: str | None) -> None:
        """Set (None: remove) a node label; no write when the watched node has it already."""
        view = self.view
        if view is not None and value is not None and view.node_has_label(name, label, value):
            return
        self.core.patch_node(name, {"metadata": {"labels": {label: value}}})
        if view is not None:
            view.noted_node_label(name, label, value)

    # ---- Events and routes ------------------------------------------------------------
    def event(self, rollout: dict[str, Any], kind: str, reason: str, message: str) -> None:
        meta = rollout["metadata"]
        now = datetime.now(UTC)
        body = client.CoreV1Event(
            metadata=client.V1ObjectMeta(
                generate_name=f"{meta['name']}.", namespace=meta["namespace"]
            ),
            involved_object=client.V1ObjectReference(
                api_version=API_VERSION,
                kind=ROLLOUT_KIND,
                name=meta["name"],
                namespace=meta["namespace"],
                uid=meta.get("uid"),
                resource_version=meta.get("resourceVersion"),
            ),
            reason=reason,
            message=message[:1024],
            type=kind,
            source=client.V1EventSource(component="weightship-controller"),
            first_timestamp=now,
            last_timestamp=now,
            count=1,
        )
        with contextlib.suppress(ApiException):  # best effort; status carries the truth
            self.core.create_namespaced_event(meta["namespace"], body)

    @api_retry
    def set_service_selector(self, namespace: str, name: str, selector: dict[str, str]) -> None:
        service = self.core.read_namespaced_service(name, namespace)
        if (service.spec.selector or {}) != selector:
            # A JSON merge patch cannot drop keys it does not name: replace the selector.
            self.core.patch_namespaced_service(
                name, namespace, [{"op": "replace", "path": "/spec/selector", "value": selector}]
            )

    @api_retry
    def set_route_weights(self, namespace: str, route: str, weights: dict[str, int]) -> None:
        """Set backendRef weights by Service name on every rule of an HTTPRoute."""
        obj = self.custom.get_namespaced_custom_object(
            "gateway.networking.k8s.io", "v1", namespace, "httproutes", route
        )
        changed = False
        for rule in obj.get("spec", {}).get("rules", []):
            for ref in rule.get("backendRefs", []):
                if ref.get("name") in weights and ref.get("weight") != weights[ref["name"]]:
                    ref["weight"] = weights[ref["name"]]
                    changed = True
        if changed:
            self.custom.replace_namespaced_custom_object(
                "gateway.networking.k8s.io", "v1", namespace, "httproutes", route, obj
            )
