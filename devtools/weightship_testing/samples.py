"""Sample ModelRollout manifests: one valid, and invalid ones that the CRD schema (OpenAPI
and CEL) and the pydantic models must both reject. Unit tests check pydantic; the e2e suite
applies them to a real apiserver and expects the substring in the error."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

Manifest = dict[str, Any]

VALID_MANIFEST: Manifest = {
    "apiVersion": "weightship.io/v1alpha1",
    "kind": "ModelRollout",
    "metadata": {"name": "llm", "namespace": "serving"},
    "spec": {
        "replicas": 4,
        "selector": {"matchLabels": {"app": "llm"}},
        "template": {
            "metadata": {"labels": {"app": "llm"}},
            "spec": {
                "containers": [
                    {
                        "name": "server",
                        "image": "ghcr.io/example/llm-server:1.0",
                        "ports": [{"containerPort": 8000}],
                        "resources": {"limits": {"nvidia.com/gpu": 1}},
                    }
                ]
            },
        },
        "model": {
            "source": {
                "uri": "s3://models/llama3-8b/2024-06-01/",
                "endpoint": "http://minio.storage:9000",
                "region": "us-east-1",
                "credentialsSecretRef": {"name": "s3-credentials"},
            },
            "revision": "llama3-8b-2024-06-01",
        },
        "prefetch": {"minStagedPercent": 90, "bandwidthLimit": "500Mi"},
        "validation": {
            "goldenPrompts": [
                {
                    "name": "capital",
                    "prompt": "The capital of France is",
                    "maxTokens": 4,
                    "expect": {"contains": "Paris"},
                }
            ]
        },
        "strategy": {
            "canary": {
                "steps": [
                    {"setWeight": 25},
                    {"pause": {"duration": "5m"}},
                    {"analysis": {"metrics": ["error-rate"]}},
                    {"setWeight": 50},
                    {"pause": {}},
                ],
                "analysis": {
                    "prometheus": {"address": "http://prometheus.monitoring:9090"},
                    "metrics": [
                        {
                            "name": "error-rate",
                            "query": 'sum(rate(http_requests_total{namespace="{{ namespace }}",'
                            'revision="{{ canaryRevision }}",code=~"5.."}[2m]))',
                            "max": 0.01,
                            "interval": "1m",
                            "count": 3,
                        }
                    ],
                },
            }
        },
        "notifications": {
            "slack": {
                "webhookSecretRef": {"name": "slack-webhook"},
                "channel": "#ml-oncall",
            }
        },
    },
}


def _mutated(change: Callable[[Manifest], None]) -> Manifest:
    manifest = copy.deepcopy(VALID_MANIFEST)
    change(manifest["spec"])
    return manifest


def _parent(spec: Manifest, path: str) -> tuple[Any, str | int]:
    """The container holding spec.<path> (dotted, [i] for list items) and the last key."""
    parts: list[str | int] = [
        int(p) if p.isdigit() else p for p in path.replace("[", ".").replace("]", "").split(".")
    ]
    node: Any = spec
    for part in parts[:-1]:
        node = node[part]
    return node, parts[-1]


def _set(path: str, value: Any) -> Callable[[Manifest], None]:
    def change(spec: Manifest) -> None:
        node, key = _parent(spec, path)
        node[key] = value

    return change


def _delete(path: str) -> Callable[[Manifest], None]:
    def change(spec: Manifest) -> None:
        node, key = _parent(spec, path)
        del node[key]

    return change


# (description, manifest, substring expected in the apiserver's error)
INVALID_MANIFESTS: list[tuple[str, Manifest, str]] = [
    (
        "model uri is not S3",
        _mutated(_set("model.source.uri", "gs://models/llama3/")),
        "spec.model.source.uri must start with s3://",
    ),
    (
        "manifestDigest is not a sha256 digest",
        _mutated(_set("model.manifestDigest", "sha256:abc")),
        "spec.model.manifestDigest",
    ),
    (
        "both template and workloadRef",
        _mutated(_set("workloadRef", {"name": "llm"})),
        "exactly one of spec.template or spec.workloadRef must be set",
    ),
    (
        "neither template nor workloadRef",
        _mutated(_delete("template")),
        "exactly one of spec.template or spec.workloadRef must be set",
    ),
    (
        "selector does not match the template labels",
        _mutated(_set("selector.matchLabels", {"app": "other"})),
        "spec.selector.matchLabels must match spec.template.metadata.labels",
    ),
    (
        "empty steps",
        _mutated(_set("strategy.canary.steps", [])),
        "spec.strategy.canary.steps",
    ),
    (
        "a step with two actions",
        _mutated(_set("strategy.canary.steps[0]", {"setWeight": 10, "pause": {}})),
        "each step must set exactly one of setWeight, pause or analysis",
    ),
    (
        "setWeight above 100",
        _mutated(_set("strategy.canary.steps[0]", {"setWeight": 150})),
        "spec.strategy.canary.steps[0].setWeight",
    ),
    (
        "pause duration is not a Go duration",
        _mutated(_set("strategy.canary.steps[1]", {"pause": {"duration": "5 minutes"}})),
        "spec.strategy.canary.steps[1].pause.duration",
    ),
    (
        "metric without min or max",
        _mutated(_delete("strategy.canary.analysis.metrics[0].max")),
        "metric must set min, max or both",
    ),
    (
        "analysis step names an unknown metric",
        _mutated(_set("strategy.canary.steps[2]", {"analysis": {"metrics": ["latency"]}})),
        "analysis steps may only name metrics defined in spec.strategy.canary.analysis.metrics",
    ),
    (
        "analysis step without canary.analysis",
        _mutated(_delete("strategy.canary.analysis")),
        "spec.strategy.canary.analysis must be set when a step uses analysis",
    ),
    (
        "golden prompt with two expectations",
        _mutated(
            _set(
                "validation.goldenPrompts[0].expect",
                {"contains": "Paris", "prefix": " Paris"},
            )
        ),
        "expect must set exactly one of equals, prefix, contains or regex",
    ),
    (
        "checksumMode is not a mode",
        _mutated(_set("validation.checksumMode", "sometimes")),
        "spec.validation.checksumMode",
    ),
    (
        "golden prompt with both prompt and messages",
        _mutated(_set("validation.goldenPrompts[0].messages", [{"role": "user", "content": "Hi"}])),
        "set exactly one of prompt or messages",
    ),
    (
        "golden prompt with five stop sequences",
        _mutated(_set("validation.goldenPrompts[0].stop", ["a", "b", "c", "d", "e"])),
        "spec.validation.goldenPrompts[0].stop",
    ),
    (
        "golden prompt maxTokens out of range",
        _mutated(_set("validation.goldenPrompts[0].maxTokens", 5000)),
        "spec.validation.goldenPrompts[0].maxTokens",
    ),
    (
        "minStagedPercent above 100",
        _mutated(_set("prefetch.minStagedPercent", 101)),
        "spec.prefetch.minStagedPercent",
    ),
    (
        "unknown seeding backend",
        _mutated(_set("seeding", {"backend": "mpi"})),
        "spec.seeding.backend",
    ),
    (
        "bandwidthLimit is not a quantity",
        _mutated(_set("prefetch.bandwidthLimit", "fast")),
        "spec.prefetch.bandwidthLimit",
    ),
    (
        "negative replicas",
        _mutated(_set("replicas", -1)),
        "spec.replicas",
    ),
    (
        "gatewayAPI with the same stable and canary backend",
        _mutated(
            _set(
                "strategy.canary.trafficRouting",
                {
                    "gatewayAPI": {
                        "httpRoute": {"name": "llm"},
                        "stableBackend": "llm",
                        "canaryBackend": "llm",
                    }
                },
            )
        ),
        "gatewayAPI.stableBackend and gatewayAPI.canaryBackend must differ",
    ),
    (
        "unknown Slack event",
        _mutated(_set("notifications.slack.events", ["Exploded"])),
        "spec.notifications.slack.events[0]",
    ),
    (
        "missing model revision",
        _mutated(_delete("model.revision")),
        "spec.model.revision",
    ),
]


def _set_both_labels(labels: dict[str, str]) -> Callable[[Manifest], None]:
    def change(spec: Manifest) -> None:
        _set("selector.matchLabels", labels)(spec)
        _set("template.metadata.labels", labels)(spec)

    return change


# Manifests the API server once admitted and the controller then refused or crashed on
# (issue 12): both sides must refuse them now.
INVALID_MANIFESTS += [
    (
        "pause longer than a year (overflowed the core's datetime arithmetic)",
        _mutated(_set("strategy.canary.steps[1]", {"pause": {"duration": "70000000h"}})),
        "spec.strategy.canary.steps[1].pause.duration",
    ),
    (
        "metric interval beyond 24h",
        _mutated(_set("strategy.canary.analysis.metrics[0].interval", "70000000h")),
        "spec.strategy.canary.analysis.metrics[0].interval",
    ),
    (
        "metric interval of zero",
        _mutated(_set("strategy.canary.analysis.metrics[0].interval", "0s")),
        "spec.strategy.canary.analysis.metrics[0].interval",
    ),
    (
        "integer bandwidthLimit of zero",
        _mutated(_set("prefetch.bandwidthLimit", 0)),
        "spec.prefetch.bandwidthLimit",
    ),
    (
        "negative bandwidthLimit quantity",
        _mutated(_set("prefetch.bandwidthLimit", "-1")),
        "spec.prefetch.bandwidthLimit",
    ),
    (
        "milli bandwidthLimit quantity",
        _mutated(_set("prefetch.bandwidthLimit", "1m")),
        "spec.prefetch.bandwidthLimit",
    ),
    (
        "selector label key that is no qualified name",
        _mutated(_set_both_labels({"a b!": "llm"})),
        "spec.selector.matchLabels",
    ),
    (
        "template label value that is no label value",
        _mutated(_set("template.metadata.labels", {"app": "llm", "tier": "x y"})),
        "spec.template.metadata.labels",
    ),
    (
        "golden-prompt regex that is no RE2 (lookahead)",
        _mutated(_set("validation.goldenPrompts[0].expect", {"regex": "(?=Paris)"})),
        "spec.validation.goldenPrompts[0].expect.regex",
    ),
    (
        "metric query naming an unknown variable",
        _mutated(_set("strategy.canary.analysis.metrics[0].query", 'up{x="{{ bogus }}"}')),
        "spec.strategy.canary.analysis.metrics[0].query",
    ),
    (
        "Prometheus address with a Unicode space",
        _mutated(_set("strategy.canary.analysis.prometheus.address", "http://prom\u00a0x:9090")),
        "spec.strategy.canary.analysis.prometheus.address",
    ),
    (
        "in-place maxUnavailable below zero",
        _mutated(_set("strategy.canary.inPlace", {"maxUnavailable": -1})),
        "spec.strategy.canary.inPlace.maxUnavailable",
    ),
    (
        "in-place maxUnavailable percent with a leading zero",
        _mutated(_set("strategy.canary.inPlace", {"maxUnavailable": "05%"})),
        "spec.strategy.canary.inPlace.maxUnavailable",
    ),
    (
        "in-place maxHoldSeconds of zero (a held request needs some time)",
        _mutated(_set("strategy.canary.inPlace", {"maxHoldSeconds": 0})),
        "spec.strategy.canary.inPlace.maxHoldSeconds",
    ),
    (
        "in-place maxUnavailable over 100%",
        _mutated(_set("strategy.canary.inPlace", {"maxUnavailable": "150%"})),
        "spec.strategy.canary.inPlace.maxUnavailable",
    ),
    (
        "in-place maxUnavailable string that is no percent",
        _mutated(_set("strategy.canary.inPlace", {"maxUnavailable": "2"})),
        "spec.strategy.canary.inPlace.maxUnavailable",
    ),
]

# Pod templates a ReplicaSet create refuses, and quantities no one can mean (issue 23).
_SERVER = {"name": "server", "image": "ghcr.io/example/llm-server:1.0"}


def _resources(resources: dict[str, Any]) -> dict[str, Any]:
    return {"containers": [{**_SERVER, "resources": resources}]}


INVALID_MANIFESTS += [
    (
        "a pod template without containers",
        _mutated(_set("template.spec", {})),
        "spec.template.spec.containers",
    ),
    (
        "a pod template with an empty container list",
        _mutated(_set("template.spec", {"containers": []})),
        "spec.template.spec.containers",
    ),
    (
        "a container without an image",
        _mutated(_set("template.spec", {"containers": [{"name": "server"}]})),
        "spec.template.spec.containers[0].image",
    ),
    (
        "a container without a name",
        _mutated(_set("template.spec", {"containers": [{"image": "x"}]})),
        "spec.template.spec.containers[0].name",
    ),
    (
        "two containers of one name",
        _mutated(_set("template.spec", {"containers": [_SERVER, _SERVER]})),
        "container names must be unique across containers and initContainers",
    ),
    (
        "a negative CPU limit",
        _mutated(_set("template.spec", _resources({"limits": {"cpu": "-1"}}))),
        "must be a non-negative quantity",
    ),
    (
        "a memory limit that is no quantity",
        _mutated(_set("template.spec", _resources({"limits": {"memory": "lots"}}))),
        "must be a non-negative quantity",
    ),
    (
        "half a GPU",
        _mutated(_set("template.spec", _resources({"limits": {"nvidia.com/gpu": "0.5"}}))),
        "extended resources (such as nvidia.com/gpu) must be whole numbers",
    ),
    (
        "requests above limits",
        _mutated(
            _set("template.spec", _resources({"requests": {"cpu": "2"}, "limits": {"cpu": 1}}))
        ),
        "requests must be less than or equal to limits",
    ),
    (
        "a 100-digit bandwidth limit",
        _mutated(_set("prefetch.bandwidthLimit", "1" * 100)),
        "spec.prefetch.bandwidthLimit",
    ),
]
