"""The operator as a real process, and small published models, for rollout e2e tests."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kubernetes import client

from e2e import lanes
from weightship.api.names import GROUP, ROLLOUT_PLURAL, VERSION
from weightship.data.s3 import S3Location, S3Origin, publish
from weightship_dev import testkit
from weightship_dev.install import apply_crds as apply_crds  # re-exported for tests
from weightship_dev.layout import S3_ACCESS_KEY, S3_SECRET_KEY
from weightship_dev.operatorproc import OperatorProcess as OperatorProcess  # re-exported
from weightship_testing.tinyllm import Variant
from weightship_testing.tinyllm import deploy as tinyllm
from weightship_testing.tinyllm.build import publish_versions

PROCESS_NODES = lanes.process_node_selector()  # this worker's (e2e/lanes.py)


def publish_models(
    endpoint: str, bucket: str, root: Path, versions: list[str], size: int = 2_000_000
) -> dict[str, str]:
    """Publish small random 'models' and return {version: s3 uri}."""
    s3 = testkit.local_s3(endpoint)
    uris = {}
    for version in versions:
        folder = root / version
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "model.safetensors").write_bytes(os.urandom(size))
        uri = f"s3://{bucket}/models/{version}/"
        publish(folder, S3Origin(s3, S3Location.parse(uri)), chunk_size=1 << 20)
        uris[version] = uri
    return uris


def tinyllm_models(
    endpoint: str, prefix: str, versions: list[tuple[str, Variant, int]]
) -> Iterator[dict[str, str]]:
    """Publish versions (name, variant, seed) of the tiny reference model to a new bucket;
    yield {name: s3 uri}; remove the bucket after. Same variant and seed: same digest."""
    s3 = testkit.local_s3(endpoint)
    bucket = testkit.unique_name(prefix)
    s3.create_bucket(Bucket=bucket)
    yield publish_versions(s3, bucket, "models", versions)
    testkit.empty_bucket(s3, bucket)
    s3.delete_bucket(Bucket=bucket)


def s3_secret(core: client.CoreV1Api, namespace: str) -> None:
    core.create_namespaced_secret(
        namespace,
        {
            "metadata": {"name": testkit.S3_SECRET_NAME},
            "stringData": {
                "AWS_ACCESS_KEY_ID": S3_ACCESS_KEY,
                "AWS_SECRET_ACCESS_KEY": S3_SECRET_KEY,
            },
        },
    )


def rollout_body(
    name: str,
    uri: str,
    revision: str,
    steps: list[dict[str, Any]],
    endpoint: str,
    replicas: int = 2,
    **canary: Any,
) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "ModelRollout",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {
                    "nodeSelector": PROCESS_NODES,
                    "terminationGracePeriodSeconds": 2,
                    "containers": [
                        {
                            "name": "server",
                            "image": "python:3.11-slim",
                            "command": ["python3", "-m", "weightship_dev.echoserver"],
                            "env": [
                                {
                                    "name": "POD_NAME",
                                    "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}},
                                }
                            ],
                            "ports": [{"name": "http", "containerPort": 8080}],
                            "readinessProbe": {
                                "httpGet": {"path": "/healthz", "port": "http"},
                                "periodSeconds": 1,
                            },
                        }
                    ],
                },
            },
            "model": testkit.local_model(uri, endpoint, revision),
            "prefetch": {"enabled": False},
            "validation": {"checksum": False},
            # Pods that go drain for 2 s, not the default 30 (test_no_request_lost: the
            # delay at work).
            "strategy": {"canary": {"steps": steps, "scaleDownDelaySeconds": 2, **canary}},
        },
    }


def tinyllm_rollout_body(
    name: str,
    uri: str,
    revision: str,
    steps: list[dict[str, Any]],
    endpoint: str,
    replicas: int = 2,
    env: dict[str, str] | None = None,
    **canary: Any,
) -> dict[str, Any]:
    """A rollout of the reference inference server (weightship_testing.tinyllm) with
    checksum verification and golden prompts: its pods turn Ready only once verified."""
    body = rollout_body(name, uri, revision, steps, endpoint, replicas, **canary)
    body["spec"]["template"] = tinyllm.pod_template(name, node_selector=PROCESS_NODES, env=env)
    body["spec"]["validation"] = tinyllm.validation()
    return body


class Rollouts:
    """Small helpers over the ModelRollout API for one namespace."""

    def __init__(self, api: client.ApiClient, namespace: str) -> None:
        self.api = api
        self.namespace = namespace
        self.custom = client.CustomObjectsApi(api)

    def create(self, body: dict[str, Any]) -> dict[str, Any]:
        return dict(
            self.custom.create_namespaced_custom_object(
                GROUP, VERSION, self.namespace, ROLLOUT_PLURAL, body
            )
        )

    def get(self, name: str) -> dict[str, Any]:
        return dict(
            self.custom.get_namespaced_custom_object(
                GROUP, VERSION, self.namespace, ROLLOUT_PLURAL, name
            )
        )

    def delete(self, name: str) -> None:
        self.custom.delete_namespaced_custom_object(
            GROUP, VERSION, self.namespace, ROLLOUT_PLURAL, name
        )

    def patch_spec(self, name: str, spec: dict[str, Any]) -> None:
        """Merge ``spec`` into the rollout's spec (a key set to None is removed)."""
        self.custom.patch_namespaced_custom_object(
            GROUP, VERSION, self.namespace, ROLLOUT_PLURAL, name, {"spec": spec}
        )

    def set_model(
        self, name: str, uri: str, revision: str, steps: list[dict[str, Any]] | None = None
    ) -> None:
        spec: dict[str, Any] = {"model": {"source": {"uri": uri}, "revision": revision}}
        if steps is not None:
            spec["strategy"] = {"canary": {"steps": steps}}
        self.patch_spec(name, spec)

    def wait(self, name: str, what: str, check: Any, timeout: float = 90) -> dict[str, Any]:
        def probe() -> dict[str, Any] | None:
            obj = self.get(name)
            return obj if check(obj.get("status") or {}) else None

        return testkit.wait_until(
            probe,
            timeout=timeout,
            what=f"{name}: {what}",
            detail=lambda: str((self.get(name).get("status") or {}).get("message")),
        )

    def healthy_on(self, name: str, revision: str, timeout: float = 120) -> dict[str, Any]:
        """The rollout once Healthy with `revision` stable."""
        return self.wait(
            name,
            f"Healthy on {revision}",
            lambda s: (
                s.get("phase") == "Healthy"
                and (s.get("stableRevision") or {}).get("revision") == revision
            ),
            timeout,
        )

    def wait_phase(self, name: str, phase: str, timeout: float = 90) -> dict[str, Any]:
        return self.wait(name, f"phase {phase}", lambda s: s.get("phase") == phase, timeout)

    def replicasets(self, name: str) -> list[Any]:
        return list(
            client.AppsV1Api(self.api)
            .list_namespaced_replica_set(self.namespace, label_selector=f"{GROUP}/rollout={name}")
            .items
        )

    def events(self, name: str) -> list[Any]:
        return [
            e
            for e in client.CoreV1Api(self.api).list_namespaced_event(self.namespace).items
            if e.involved_object.kind == "ModelRollout" and e.involved_object.name == name
        ]

    def wait_event(self, name: str, reason: str, timeout: float = 30) -> Any:
        """The rollout's first Event with this reason: events are posted off the reconcile
        (controller.events), so one may land after the status that follows it."""
        return testkit.wait_until(
            lambda: next((e for e in self.events(name) if e.reason == reason), None),
            timeout=timeout,
            what=f"a {reason} event of {name}",
            detail=lambda: str(sorted({e.reason for e in self.events(name)})),
        )


def operator_process(
    state: Path,
    kubeconfig: Path,
    namespaces: tuple[str, ...] = (),
) -> Iterator[OperatorProcess]:
    """One operator per test module, watching only that module's namespaces (globs), so
    modules never fight over each other's rollouts."""
    # One log per xdist worker: two lanes run operators at the same time.
    worker = lanes.xdist_worker()
    log = state / (f"operator-e2e-{worker}.log" if worker else "operator-e2e.log")
    op = OperatorProcess(kubeconfig, log, namespaces, metrics_port=free_port())
    op.start()
    try:
        yield op
    finally:
        op.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_reconciled(
    rollouts: Rollouts, operator: OperatorProcess, name: str, timeout: float = 60
) -> float:
    """Return once ``operator`` has run a whole reconcile of the rollout that began after
    this call: the positive signal that it saw the state as it is now and, where nothing
    changed, decided to leave it so. Each round pokes the rollout (an annotation: a watch
    event, so a reconcile) instead of waiting out the idle recheck. A reconcile that ends
    after the call may have begun before it; the next one cannot (a key is never worked
    twice at once), hence two. Returns when the second ended (the operator's clock)."""
    mark = time.time()
    for _ in range(2):
        rollouts.custom.patch_namespaced_custom_object(
            GROUP,
            VERSION,
            rollouts.namespace,
            ROLLOUT_PLURAL,
            name,
            {"metadata": {"annotations": {"e2e.weightship.io/poke": str(time.time_ns())}}},
        )
        since = mark

        def ended(since: float = since) -> float | None:
            at = operator.reconciled_at(rollouts.namespace, name)
            return at if at is not None and at > since else None

        mark = testkit.wait_until(
            ended,
            timeout=timeout,
            what=f"{name}: a reconcile by the operator after {since:.3f}",
            detail=operator.tail,
        )
    return mark
