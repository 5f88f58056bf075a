"""`make demo`: a real rollout and a real rollback on the local cluster.

1. Start the cluster (if needed), install the CRDs and the Helm chart (the operator runs
   as a non-root pod on a process node).
2. Publish three model versions to the local S3 server: v1 and v2 good, v3 corrupt (its
   bytes no longer match its manifest).
3. Node agents stage each version on every process node (peer to peer, every chunk
   verified) before any canary pod exists. v1 becomes stable; v2 walks the canary steps to
   Healthy; v3's bytes fail verification on the nodes, so no pod ever sees them, and the
   progress deadline rolls it back on its own: stable (v2) stays at full size, the spec is
   left alone, and Slack is told why.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kubernetes import client
from kubernetes.client.rest import ApiException
from rich.console import Console
from rich.table import Table

from weightship.controller.builders import GROUP
from weightship.controller.kube import PLURAL, VERSION
from weightship.data.s3 import S3Location, S3Origin, publish
from weightship.dev import cluster as local_cluster
from weightship.dev import install, nodes, testkit
from weightship.dev.layout import BRIDGE_IP, S3_ACCESS_KEY, S3_SECRET_KEY, ClusterPaths
from weightship.dev.slackreceiver import SlackReceiver

NAMESPACE = "demo"
SYSTEM_NAMESPACE = "weightship-system"
BUCKET = "demo-models"
STEPS = [
    {"setWeight": 34},
    {"pause": {"duration": "5s"}},
    {"setWeight": 67},
    {"pause": {"duration": "5s"}},
    {"setWeight": 100},
]


def rollout_spec(uri: str, revision: str, endpoint: str) -> dict[str, Any]:
    secret_env = [
        {"name": key, "valueFrom": {"secretKeyRef": {"name": "s3-credentials", "key": key}}}
        for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
    ]
    return {
        "replicas": 3,
        "selector": {"matchLabels": {"app": "llm"}},
        "template": {
            "metadata": {
                "labels": {"app": "llm"},
                "annotations": {"prometheus.io/scrape": "true", "prometheus.io/port": "8080"},
            },
            "spec": {
                "nodeSelector": {"weightship.io/node-kind": "process"},
                "terminationGracePeriodSeconds": 2,
                "containers": [
                    {
                        "name": "server",
                        "image": "python:3.11-slim",
                        "command": ["python3", "-m", "weightship.dev.demoserver"],
                        "env": [
                            *secret_env,
                            {"name": "SCRATCH_DIR", "value": "/scratch"},
                            {
                                "name": "NODE_NAME",
                                "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}},
                            },
                        ],
                        "ports": [{"name": "http", "containerPort": 8080}],
                        "readinessProbe": {
                            "httpGet": {"path": "/healthz", "port": "http"},
                            "periodSeconds": 1,
                        },
                        "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}],
                    }
                ],
                "volumes": [{"name": "scratch", "emptyDir": {}}],
            },
        },
        "model": {
            "source": {
                "uri": uri,
                "endpoint": endpoint,
                "region": "us-east-1",
                "credentialsSecretRef": {"name": "s3-credentials"},
            },
            "revision": revision,
        },
        # The readiness-gate verifier arrives with its own issue; until then the demo
        # server verifies what it loads itself.
        # Node agents stage the weights on every process node before any canary pod runs.
        "prefetch": {
            "enabled": True,
            "nodeSelector": {"weightship.io/node-kind": "process"},
            "minStagedPercent": 100,
        },
        "validation": {"checksum": False},
        "strategy": {
            "canary": {
                "steps": STEPS,
                "progressDeadlineSeconds": 45,
                "abortScaleDownDelaySeconds": 5,
            }
        },
        # A local receiver stands in for Slack's incoming webhook.
        "notifications": {
            "slack": {
                "webhookSecretRef": {"name": "slack-webhook"},
                "channel": "#ml-oncall",
                "events": ["Promoted", "RolledBack", "Failed"],
            }
        },
    }


def publish_versions(endpoint: str, root: Path) -> dict[str, str]:
    s3 = testkit.local_s3(endpoint)
    try:
        s3.create_bucket(Bucket=BUCKET)
    except s3.exceptions.BucketAlreadyOwnedByYou:
        pass
    except Exception as e:
        if "BucketAlreadyExists" not in str(e) and "BucketAlreadyOwnedByYou" not in str(e):
            raise
    uris = {}
    for version in ("v1", "v2", "v3"):
        folder = root / version
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "model.safetensors").write_bytes(os.urandom(4 << 20))
        uri = f"s3://{BUCKET}/llm/{version}/"
        publish(folder, S3Origin(s3, S3Location.parse(uri)), chunk_size=1 << 20)
        uris[version] = uri
    # v3 goes bad after publishing: one byte flipped in S3, its manifest unchanged.
    key = "llm/v3/model.safetensors"
    data = bytearray(s3.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    data[len(data) // 2] ^= 0xFF
    s3.put_object(Bucket=BUCKET, Key=key, Body=bytes(data))
    return uris


class Demo:
    def __init__(self, console: Console) -> None:
        self.console = console
        self.paths = ClusterPaths.default()
        self.api: client.ApiClient
        self.custom: client.CustomObjectsApi
        self.slack: SlackReceiver

    def say(self, text: str) -> None:
        self.console.rule(f"[bold]{text}")

    def setup(self) -> dict[str, str]:
        self.say("local cluster")
        if not local_cluster.is_up(self.paths):
            local_cluster.up(local_cluster.ClusterConfig(paths=self.paths), log=self.console.print)
        self.api = nodes.admin_api(self.paths)
        self.custom = client.CustomObjectsApi(self.api)
        core = client.CoreV1Api(self.api)
        install.apply_crds(self.api)
        self.console.print("CRDs applied")
        try:
            core.delete_namespace(NAMESPACE)
            # A previous demo's operator may be gone: release its finalizers on the way out.
            for mr in self.custom.list_namespaced_custom_object(
                GROUP, VERSION, NAMESPACE, PLURAL
            ).get("items", []):
                self.custom.patch_namespaced_custom_object(
                    GROUP,
                    VERSION,
                    NAMESPACE,
                    PLURAL,
                    mr["metadata"]["name"],
                    {"metadata": {"finalizers": None}},
                )
            testkit.wait_until(
                lambda: not _exists(core, NAMESPACE), timeout=120, what="old demo namespace to go"
            )
        except ApiException as e:
            if e.status != 404:
                raise
        core.create_namespace({"metadata": {"name": NAMESPACE}})
        core.create_namespaced_secret(
            NAMESPACE,
            {
                "metadata": {"name": "s3-credentials"},
                "stringData": {
                    "AWS_ACCESS_KEY_ID": S3_ACCESS_KEY,
                    "AWS_SECRET_ACCESS_KEY": S3_SECRET_KEY,
                },
            },
        )
        install.prepare_cache_dirs(self.paths)
        with self.console.status("helm upgrade --install weightship (operator and agents)"):
            install.install_chart(
                self.paths, "weightship", SYSTEM_NAMESPACE, [NAMESPACE], agent=True
            )
        self.console.print(
            f"operator installed in {SYSTEM_NAMESPACE}, watching {NAMESPACE}; "
            "a node agent on every process node"
        )
        uris = publish_versions(local_cluster.s3_endpoint(), self.paths.root / "demo-models")
        self.console.print(
            f"published v1, v2 and v3 (corrupted after publishing) to s3://{BUCKET}/llm/"
        )
        return uris

    def get(self) -> dict[str, Any]:
        return dict(
            self.custom.get_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, "llm")
        )

    def follow(self, until: Callable[[dict[str, Any]], bool], timeout: float = 180) -> None:
        """Print each change of phase, step, weight or replica counts until `until`."""
        last, last_staging = None, ""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status = self.get().get("status") or {}
            replicas = status.get("replicas") or {}
            line = (
                status.get("phase"),
                status.get("currentStepIndex"),
                status.get("canaryWeight"),
                replicas.get("stable"),
                replicas.get("canary"),
                replicas.get("ready"),
                status.get("message"),
            )
            staging = _staging(status) if status.get("phase") == "Prefetching" else ""
            if line != last or (staging and staging != last_staging):
                phase, step, weight, stable, canary, ready, message = line
                self.console.print(
                    f"  [cyan]{phase or '-':<11}[/] step {step if step is not None else '-'}"
                    f"  weight {weight or 0:>3}%  stable {stable or 0} canary {canary or 0}"
                    f" ready {ready or 0}  [dim]{message or ''}[/]"
                )
                if staging:
                    self.console.print(f"              [magenta]staging[/] {staging}")
                last, last_staging = line, staging
            if until(status):
                return
            time.sleep(0.5)
        raise TimeoutError(
            "the rollout did not get there in time; see `weightship status "
            f"llm -n {NAMESPACE}` and the operator's log"
        )

    def run(self) -> None:
        with SlackReceiver(host=BRIDGE_IP) as slack:
            self.slack = slack
            self._run()

    def _run(self) -> None:
        uris = self.setup()
        client.CoreV1Api(self.api).create_namespaced_secret(
            NAMESPACE,
            {"metadata": {"name": "slack-webhook"}, "stringData": {"url": self.slack.url}},
        )
        endpoint = local_cluster.s3_endpoint()
        body = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "ModelRollout",
            "metadata": {"name": "llm"},
            "spec": rollout_spec(uris["v1"], "v1", endpoint),
        }

        self.say("v1: the first revision goes straight to stable")
        self.custom.create_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, body)
        self.follow(lambda s: s.get("phase") == "Healthy")

        self.say("v2: a canary walks 34% → pause → 67% → pause → 100%")
        self._set_model(uris["v2"], "v2")
        self.follow(
            lambda s: (
                s.get("phase") == "Healthy"
                and (s.get("stableRevision") or {}).get("revision") == "v2"
            )
        )

        self.say("v3: corrupt weights; the nodes refuse them and the rollout rolls back by itself")
        self._set_model(uris["v3"], "v3")
        self.follow(
            lambda s: s.get("phase") == "Degraded" and (s.get("replicas") or {}).get("canary") == 0
        )
        self.report()

    def _set_model(self, uri: str, revision: str) -> None:
        self.custom.patch_namespaced_custom_object(
            GROUP,
            VERSION,
            NAMESPACE,
            PLURAL,
            "llm",
            {"spec": {"model": {"source": {"uri": uri}, "revision": revision}}},
        )

    def print_slack(self) -> None:
        testkit.wait_until(
            lambda: any("RolledBack" in m.get("text", "") for m in self.slack.received),
            timeout=30,
            what="the Slack message about the rollback",
        )
        self.say(f"Slack ({len(self.slack.received)} messages to #ml-oncall; the last one)")
        self.console.print(_slack_text(self.slack.received[-1]))

    def report(self) -> None:
        self.say("what happened")
        obj = self.get()
        status = obj["status"]
        table = Table("at (UTC)", "revision", "outcome", "reason", "message")
        for h in status.get("history") or []:
            table.add_row(
                h["at"][11:19], h["revision"], h["outcome"], h["reason"], h.get("message") or ""
            )
        self.console.print(table)
        self.console.print(f"phase: [red]{status['phase']}[/]: {status['message']}")
        self.console.print(
            f"stable: {status['stableRevision']['revision']}  "
            f"spec still asks for: {obj['spec']['model']['revision']} "
            "(the spec is never changed: no GitOps drift)"
        )
        digest = (status.get("canaryRevision") or {}).get("manifestDigest")
        caches = self.custom.list_cluster_custom_object(GROUP, VERSION, "weightcaches")
        for cache in caches.get("items", []):
            for entry in (cache.get("status") or {}).get("manifests") or []:
                if entry.get("digest") == digest and entry.get("lastError"):
                    self.console.print(
                        f"[dim]{cache['metadata']['name']} agent:[/] "
                        f"{entry['state']}: {entry['lastError']}"
                    )
        self.print_slack()
        self.console.print(
            f"\nLook around: weightship status llm -n {NAMESPACE}; "
            f"KUBECONFIG={self.paths.admin_kubeconfig} kubectl get mr,rs,pods "
            f"-n {NAMESPACE}"
        )


def _staging(status: dict[str, Any]) -> str:
    """Per-node staging progress, e.g. `proc-0 100% · proc-1 40% · proc-2 Failed`."""
    parts = []
    for node in (status.get("prefetch") or {}).get("nodes") or []:
        total = node.get("bytesTotal") or 0
        done = node.get("bytesDone") or 0
        shown = (
            node["state"]
            if node["state"] in ("Failed", "Pending") or not total
            else (f"{100 * done // total}%")
        )
        parts.append(f"{node['name']} {shown}")
    return " · ".join(parts)


def _slack_text(message: dict[str, Any]) -> str:
    lines = []
    for block in message.get("blocks") or []:
        if block.get("type") in ("header", "section") and block.get("text"):
            lines.append(block["text"]["text"])
        for field in block.get("fields") or []:
            lines.append(field["text"].replace("\n", ": "))
    return "\n".join(lines)


def _exists(core: client.CoreV1Api, name: str) -> bool:
    try:
        core.read_namespace(name)
    except ApiException as e:
        if e.status == 404:
            return False
        raise
    return True


def main() -> None:
    Demo(Console()).run()
