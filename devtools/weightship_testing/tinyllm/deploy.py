"""The reference server as a ModelRollout runs it (the demo and the e2e tests): its pod
template and the readiness-gate checks that go with it. Plain dicts, no I/O."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from weightship_testing.tinyllm.knowledge import GOLDEN_PROMPTS
from weightship_testing.tinyllm.settings import DEFAULT_PORT


def pod_template(
    app: str,
    *,
    node_selector: Mapping[str, str],
    env: Mapping[str, str] | None = None,
    credentials_secret: str = "s3-credentials",  # noqa: S107 - a Secret's name
    port: int = DEFAULT_PORT,
) -> dict[str, Any]:
    """Pods running `python -m weightship_testing.tinyllm serve`, scraped by Prometheus.
    The S3 credentials come from a Secret (for a model not staged in the node cache)."""
    return {
        "metadata": {
            "labels": {"app": app},
            "annotations": {"prometheus.io/scrape": "true", "prometheus.io/port": str(port)},
        },
        "spec": {
            "nodeSelector": dict(node_selector),
            "terminationGracePeriodSeconds": 2,
            "containers": [
                {
                    "name": "server",
                    "image": "python:3.11-slim",
                    "command": ["python3", "-m", "weightship_testing.tinyllm", "serve"],
                    "env": [
                        {"name": "PORT", "value": str(port)},
                        # One thread decodes faster than two on small matrices.
                        {"name": "OMP_NUM_THREADS", "value": "1"},
                        {
                            "name": "NODE_NAME",
                            "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}},
                        },
                        *({"name": k, "value": v} for k, v in (env or {}).items()),
                    ],
                    "envFrom": [{"secretRef": {"name": credentials_secret}}],
                    "ports": [{"name": "http", "containerPort": port}],
                    "readinessProbe": {
                        "httpGet": {"path": "/healthz", "port": "http"},
                        "periodSeconds": 1,
                    },
                    # SCRATCH_DIR (default /tmp): weights staged without a node cache.
                    "volumeMounts": [{"name": "scratch", "mountPath": "/tmp"}],
                }
            ],
            "volumes": [{"name": "scratch", "emptyDir": {}}],
        },
    }


def validation(port: int = DEFAULT_PORT, timeout_seconds: int = 10) -> dict[str, Any]:
    """spec.validation: the loaded digest must be the manifest's and every golden prompt
    must be answered right before a pod gets traffic."""
    return {
        "checksum": True,
        "goldenPrompts": GOLDEN_PROMPTS,
        "endpoint": {"port": port},
        "timeoutSeconds": timeout_seconds,
    }
