"""The control plane at fleet scale, on the local cluster (it must be up).

N KWOK GPU nodes, each with a WeightCache that a load generator updates at the agents'
rate (a staging node writes at most once per 10 s; `--staging` of the nodes stage at any
time). Then, for each design, one operator process:

1. one rollout alone through a revision change (the reference time);
2. R rollouts at once (2 KWOK replicas, no prefetch, nothing to verify, 50% -> 100%)
   created, then all changed to a second revision;
3. one rollout of `--big` replicas through a revision change;
4. 30 s of steady state (everything Healthy).

Figures: API requests by verb and resource, per reconcile: the operator's own (its
kubernetes-client requests, counted in the process by scale_hook/sitecustomize.py) and
the API server's apiserver_request_total before and after (the whole shared cluster,
other tests included; minus the bench's own LISTs); operator RSS and threads (peak);
reconcile p50/p99 (the operator's own histogram); time from spec change to all Healthy;
how many finished; where each rollout's time went, hop by hop, and CPU per component
(scale_profile.py); the API server's own latency per write kind. The baseline is the
design before the work queue (commit 07fb27b, run from `git archive` in a temp dir with
PYTHONPATH pointing at it), in the same run.

    .venv/bin/python bench/bench_scale.py --timeout 300 --stall 60   # 5,000 nodes, 100 rollouts
    .venv/bin/python bench/bench_scale.py --nodes 200 --rollouts 100 --big 100 --timeout 120 \
        --designs new                                                 # quick

Above 1,000 nodes it first restarts the controller manager and KWOK with
components.SCALE_LIVENESS (a lease renewal per node per 50 s, NotReady after 120 s: a
kubelet's renewal every 10 s is 500 lease writes/s at 5,000 nodes, more than this machine
has for them), and back to a kubelet's 40 s after. Before any operator runs it measures
the nodes' upkeep alone (30 s), and after each phase counts the nodes with a live lease.

The cluster is shared: the bench removes its nodes, WeightCaches and namespaces after.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import numpy
import safetensors.numpy
from kubernetes import client
from kubernetes.client.rest import ApiException

from benchlib import free_port, table
from scale_profile import HOP_HEADER, CpuMeter, Timeline, hop_table, machine_busy
from weightship.api.names import GROUP, ROLLOUT_PLURAL, VERSION
from weightship.data.s3 import S3Location, S3Origin, publish
from weightship_dev import cluster as local_cluster
from weightship_dev import testkit
from weightship_dev.components import (
    KWOK_LEASE_SECONDS,
    NODE_MONITOR_GRACE_SECONDS,
    SCALE_LIVENESS,
)
from weightship_dev.install import apply_crds
from weightship_dev.layout import S3_ACCESS_KEY, S3_SECRET_KEY, ClusterPaths
from weightship_dev.nodes import NODE_LEASE_NAMESPACE, admin_api, kwok_node_body
from weightship_dev.operatorproc import OperatorProcess
from weightship_dev.scale import Fleet, describe_stragglers, healthy_on, set_node_liveness

REPO = Path(__file__).resolve().parent.parent
HOOK = Path(__file__).resolve().parent / "scale_hook"  # counts the operator's own requests
BASELINE_COMMIT = "07fb27b"
NODE_START = 20000  # kwok-gpu-20000…: apart from the cluster's own and the e2e tests' nodes
READS = ("LIST", "GET")
RESOURCES = ("modelrollouts", "replicasets", "pods", "nodes", "weightcaches", "secrets")
# Writes are counted of these too: the nodes' lease renewals (KWOK's, at 5,000 nodes a
# standing load) and Events; subresources apart (PATCH nodes/status: KWOK's node
# heartbeats; PATCH pods/status: its pods' phases; POST pods/binding: the scheduler's).
WRITTEN = (*RESOURCES, "leases", "events")
UPKEEP_S = 30.0  # the nodes alone, before any operator runs
STEADY_S = 30.0
LATENCY_OF = (
    "PATCH modelrollouts/status",
    "POST replicasets",
    "PATCH replicasets",
    "POST secrets",
    "POST events",
    "POST pods",
    "DELETE pods",
    "PUT leases",
)


# ---- the cluster's side ---------------------------------------------------------------
class ApiCounts:
    """apiserver_request_total by (verb, resource), read from the API server."""

    def __init__(self, api: client.ApiClient) -> None:
        self.api = api

    def read(self) -> Counter[tuple[str, str]]:
        return self.read_all()[0]

    def read_all(self) -> tuple[Counter[tuple[str, str]], dict[str, dict[float, float]]]:
        """The counts, and apiserver_request_duration_seconds' buckets of the writes in
        LATENCY_OF (the API server's own time for them: what a slow reconcile waits on)."""
        raw = self.api.rest_client.pool_manager.request(
            "GET", self.api.configuration.host + "/metrics"
        ).data.decode()
        out: Counter[tuple[str, str]] = Counter()
        latency: dict[str, dict[float, float]] = {}
        for line in raw.splitlines():
            if line.startswith("apiserver_request_duration_seconds_bucket{"):
                labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
                sub = labels.get("subresource")
                kind = f"{labels.get('verb')} {labels.get('resource')}" + (f"/{sub}" if sub else "")
                if kind in LATENCY_OF:
                    buckets = latency.setdefault(kind, {})
                    le = float(labels["le"])
                    buckets[le] = buckets.get(le, 0.0) + float(line.rsplit(" ", 1)[1])
                continue
            if not line.startswith("apiserver_request_total{"):
                continue
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
            if labels.get("code") == "409" and labels.get("resource") == "modelrollouts":
                # Status patches against a version already gone (stale reads): re-queued.
                out[("409", "modelrollouts")] += int(float(line.rsplit(" ", 1)[1]))
            if labels.get("resource") in WRITTEN:
                sub = labels.get("subresource")
                resource = labels["resource"] + (f"/{sub}" if sub else "")
                out[(labels["verb"], resource)] += int(float(line.rsplit(" ", 1)[1]))
        return out, latency


def make_nodes(api: client.ApiClient, count: int) -> list[str]:
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)

    def create(index: int) -> str:
        body = kwok_node_body(index)
        name = str(body["metadata"]["name"])
        try:
            node = core.create_node(body)
        except ApiException as e:
            if e.status != 409:
                raise
            node = core.read_node(name)
        cache = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "WeightCache",
            "metadata": {
                "name": name,
                "labels": {"app.kubernetes.io/managed-by": "bench-scale"},
                "ownerReferences": [
                    {"apiVersion": "v1", "kind": "Node", "name": name, "uid": node.metadata.uid}
                ],
            },
            "spec": {"nodeName": name},
        }
        try:
            custom.create_cluster_custom_object(GROUP, VERSION, "weightcaches", cache)
        except ApiException as e:
            if e.status != 409:
                raise
        write_cache(custom, name, "Staged", 1)
        return name

    with ThreadPoolExecutor(max_workers=16) as pool:
        return list(pool.map(create, range(NODE_START, NODE_START + count)))


def write_cache(custom: client.CustomObjectsApi, node: str, state: str, done: int) -> None:
    digest = "sha256:" + f"{hash(node) & 0xFFFFFFFF:08x}" * 8
    entry = {"digest": digest, "state": state, "bytesDone": done, "bytesTotal": 100}
    custom.patch_cluster_custom_object_status(
        GROUP,
        VERSION,
        "weightcaches",
        node,
        {"status": {"peerEndpoint": "10.0.0.1:7000", "manifests": [entry]}},
    )


def delete_nodes(api: client.ApiClient, names: list[str]) -> None:
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)

    def delete(name: str) -> None:
        with suppress(ApiException):
            custom.delete_cluster_custom_object(GROUP, VERSION, "weightcaches", name)
        with suppress(ApiException):
            core.delete_node(name)

    with ThreadPoolExecutor(max_workers=16) as pool:
        list(pool.map(delete, names))


class NodeUpkeep:
    """Whether the simulated kubelets keep the bench's nodes alive: how many have a lease
    renewed within the controller manager's grace period. A node without one goes NotReady
    and KWOK stops managing its pods (so a rollout on it never finishes)."""

    def __init__(self, api: client.ApiClient, nodes: list[str], grace_s: int) -> None:
        self.coord = client.CoordinationV1Api(api)
        self.nodes = set(nodes)
        self.grace_s = grace_s

    def live(self) -> int:
        now = time.time()
        leases = self.coord.list_namespaced_lease(NODE_LEASE_NAMESPACE).items
        return sum(
            1
            for lease in leases
            if lease.metadata.name in self.nodes
            and lease.spec.renew_time is not None
            and now - lease.spec.renew_time.timestamp() < self.grace_s
        )

    def wait_all(self, timeout: float) -> float | None:
        """Seconds until every node had a live lease (None: not within timeout)."""
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            if self.live() == len(self.nodes):
                return time.monotonic() - started
            time.sleep(2.0)
        return None


def settle_nodes(api: client.ApiClient, timeout: float = 240.0) -> float:
    """Wait until the controller manager is done with the new nodes (taints and labels
    set and cleared as each one turned Ready: PATCH nodes under 1/s for 5 s), so that what
    follows measures their upkeep, not their creation. Returns the seconds it took."""
    counts = ApiCounts(api)
    started = time.monotonic()
    last = counts.read()[("PATCH", "nodes")]
    while time.monotonic() - started < timeout:
        time.sleep(5.0)
        now = counts.read()[("PATCH", "nodes")]
        if now - last < 5:
            break
        last = now
    return time.monotonic() - started


def measure_upkeep(
    api: client.ApiClient, paths: ClusterPaths, upkeep: NodeUpkeep, seconds: float
) -> dict[str, Any]:
    """The nodes alone, nothing rolling: what keeping them alive costs the control plane
    (writes per second by kind, CPU per component)."""
    counts = ApiCounts(api)
    cpu = CpuMeter.for_cluster(paths.pids, {"bench": os.getpid()})
    before, cpu_before, busy = counts.read(), cpu.read(), machine_busy()
    next(busy)
    started = time.monotonic()
    time.sleep(seconds)
    wall = time.monotonic() - started
    delta = counts.read() - before
    return {
        "seconds": wall,
        "writes_per_s": {
            f"{v} {r}": n / wall
            for (v, r), n in sorted(delta.items())
            if v not in (*READS, "WATCH") and n > 0
        },
        "cpu": CpuMeter.shares(cpu_before, cpu.read(), wall),
        "machine_busy": next(busy),
        "live": upkeep.live(),
    }


def report_upkeep(u: dict[str, Any], total: int) -> None:
    writes = u["writes_per_s"]
    top = sorted(writes.items(), key=lambda kv: -kv[1])[:6]
    print(
        f"node upkeep, {u['seconds']:.0f} s with nothing rolling: {sum(writes.values()):.1f} "
        f"writes/s ({', '.join(f'{k} {v:.1f}' for k, v in top)}); live leases at the end "
        f"{u['live']}/{total}"
    )
    print(
        "  CPU, share of one core: "
        + ", ".join(f"{n} {v:.2f}" for n, v in sorted(u["cpu"].items()))
        + f"; machine busy {u['machine_busy']:.2f}"
    )


class CacheLoad:
    """WeightCache status writes at the agents' rate: each staging node once per 10 s."""

    def __init__(self, api: client.ApiClient, nodes: list[str], staging: float) -> None:
        self.custom = client.CustomObjectsApi(api)
        self.nodes = nodes
        self.rate = max(0.1, len(nodes) * staging / 10.0)
        self.stop = threading.Event()
        self.writes = 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        rng = random.Random(7)
        started = time.monotonic()
        in_flight = threading.Semaphore(8)  # a slow API server slows the load, not the bench
        with ThreadPoolExecutor(max_workers=8) as pool:
            while not self.stop.is_set():
                due = started + self.writes / self.rate
                if (wait := due - time.monotonic()) > 0:
                    self.stop.wait(wait)
                if not in_flight.acquire(timeout=1.0):
                    continue
                node = rng.choice(self.nodes)
                pool.submit(self._write, node, rng.randrange(100)).add_done_callback(
                    lambda _f: in_flight.release()
                )
                self.writes += 1

    def _write(self, node: str, done: int) -> None:
        with suppress(ApiException):
            write_cache(self.custom, node, "Staging", done)

    def __enter__(self) -> CacheLoad:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        self.thread.join()


# ---- the operator's side --------------------------------------------------------------
class Operator:
    """`weightship operator` from `ref`'s tree (git archive into a temp dir, on PYTHONPATH),
    or from the working tree when ref is None; the e2e tests' OperatorProcess runs it."""

    def __init__(
        self, design: str, ref: str | None, kubeconfig: Path, glob: str, log: Path
    ) -> None:
        self.design, self.port = design, free_port()
        pythonpath, cwd = str(HOOK), REPO
        self.tree: Path | None = None
        if ref is not None:
            old = Path(tempfile.mkdtemp(prefix=f"ws-{design}-"))
            archive = subprocess.run(
                ["git", "-C", str(REPO), "archive", ref, "operator"],
                check=True,
                capture_output=True,
            ).stdout
            subprocess.run(["tar", "-x", "-C", str(old)], input=archive, check=True)
            pythonpath = f"{HOOK}:{old / 'operator'}"
            cwd, self.tree = old, old
        self.process = OperatorProcess(
            kubeconfig,
            log,
            (glob,),
            env={"PYTHONPATH": pythonpath},
            cwd=cwd,
            metrics_port=self.port,
        )
        self.process.start()
        assert self.process.proc is not None
        self.proc = self.process.proc
        self.peak_rss_mb, self.peak_threads = 0.0, 0
        self._stop = threading.Event()
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.5):
            with suppress(OSError):
                text = Path(f"/proc/{self.proc.pid}/status").read_text()
                rss = int(re.search(r"VmRSS:\s+(\d+)", text).group(1)) / 1024  # type: ignore[union-attr]
                threads = int(re.search(r"Threads:\s+(\d+)", text).group(1))  # type: ignore[union-attr]
                self.peak_rss_mb = max(self.peak_rss_mb, rss)
                self.peak_threads = max(self.peak_threads, threads)

    def metrics(self) -> dict[str, Any]:
        """weightship_reconciles_total and the reconcile histogram's buckets."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5) as r:
                raw = r.read().decode()
        except OSError:
            return {"reconciles": 0.0, "buckets": {}, "requests": Counter()}
        buckets: dict[float, float] = {}
        requests: Counter[tuple[str, str]] = Counter()
        reconciles = 0.0
        for line in raw.splitlines():
            if line.startswith("weightship_reconciles_total "):
                reconciles = float(line.split()[1])
            m = re.match(
                r'weightship_reconcile_duration_seconds_bucket\{le="([^"]+)"\} (\S+)', line
            )
            if m:
                buckets[float(m.group(1))] = float(m.group(2))
            if line.startswith("bench_client_requests_total{"):
                labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
                requests[(labels["verb"], labels["resource"])] += int(float(line.split()[-1]))
        return {"reconciles": reconciles, "buckets": buckets, "requests": requests}

    def wait_serving(self, timeout: float = 60) -> None:
        testkit.wait_until(
            lambda: self.proc.poll() is None and self.metrics()["buckets"],
            timeout=timeout,
            what=f"the {self.design} operator's metrics",
        )

    def stop(self) -> None:
        self._stop.set()
        self.process.stop(timeout_s=20)
        if self.tree is not None:
            shutil.rmtree(self.tree, ignore_errors=True)


def quantile(before: dict[float, float], after: dict[float, float], q: float) -> float | None:
    """Upper bound of the histogram bucket holding quantile q of the observations between
    two reads (cumulative buckets, as Prometheus keeps them)."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    total = counts[-1] if counts else 0.0
    if total <= 0:
        return None
    for bound, count in zip(bounds, counts, strict=True):
        if count >= q * total:
            return bound
    return bounds[-1]


# ---- one design's run -----------------------------------------------------------------
def publish_models(endpoint: str) -> tuple[str, dict[str, str]]:
    s3 = testkit.local_s3(endpoint)
    bucket = testkit.unique_name("bench-scale")
    s3.create_bucket(Bucket=bucket)
    uris = {}
    with tempfile.TemporaryDirectory() as tmp:
        for version in ("v1", "v2"):
            folder = Path(tmp) / version
            folder.mkdir()
            weights = numpy.frombuffer(os.urandom(4096), dtype=numpy.uint8)
            safetensors.numpy.save_file({"w": weights}, folder / "model.safetensors")
            uri = f"s3://{bucket}/models/{version}/"
            # Version 1 (sha256 chunks): the baseline design reads no other, and a control
            # plane bench does not hash.
            origin = S3Origin(s3, S3Location.parse(uri))
            publish(folder, origin, chunk_size=1 << 20, version=1)
            uris[version] = uri
    return bucket, uris


def namespace_with_secret(api: client.ApiClient, prefix: str) -> str:
    namespace = testkit.create_namespace(api, prefix)
    client.CoreV1Api(api).create_namespaced_secret(
        namespace,
        {
            "metadata": {"name": "s3-credentials"},
            "stringData": {
                "AWS_ACCESS_KEY_ID": S3_ACCESS_KEY,
                "AWS_SECRET_ACCESS_KEY": S3_SECRET_KEY,
            },
        },
    )
    return namespace


@contextmanager
def phase(
    name: str,
    op: Operator,
    counts: ApiCounts,
    out: dict[str, Any],
    fleets: list[Fleet],
    cpu: CpuMeter,
    upkeep: NodeUpkeep,
) -> Iterator[dict[str, Any]]:
    """Figures between entering and leaving: API requests (the bench's own LISTs of
    modelrollouts taken off), reconciles and their p50/p99, CPU by component, and the
    nodes with a live lease at the end."""
    (api_before, latency_before), m_before = counts.read_all(), op.metrics()
    lists_before = sum(f.lists for f in fleets)
    cpu_before, busy = cpu.read(), machine_busy()
    next(busy)
    started = time.monotonic()
    result: dict[str, Any] = {}
    yield result
    wall = time.monotonic() - started
    result["cpu"] = CpuMeter.shares(cpu_before, cpu.read(), wall)
    result["machine_busy"] = next(busy)
    (api_after, latency_after), m_after = counts.read_all(), op.metrics()
    result["api_latency"] = {
        kind: (
            quantile(latency_before.get(kind, {}), buckets, 0.5),
            quantile(latency_before.get(kind, {}), buckets, 0.99),
        )
        for kind, buckets in sorted(latency_after.items())
        if quantile(latency_before.get(kind, {}), buckets, 0.5) is not None
    }
    delta = api_after - api_before
    delta[("LIST", "modelrollouts")] -= sum(f.lists for f in fleets) - lists_before
    reconciles = m_after["reconciles"] - m_before["reconciles"]
    mine = m_after["requests"] - m_before["requests"]
    own_reads = {f"{v} {r}": n for (v, r), n in sorted(mine.items()) if v in READS and n > 0}
    own_writes = {f"{v} {r}": n for (v, r), n in sorted(mine.items()) if v not in READS and n > 0}
    reads = {f"{v} {r}": delta[(v, r)] for v in READS for r in RESOURCES if delta[(v, r)] > 0}
    writes = {
        f"{v} {r}": n for (v, r), n in sorted(delta.items()) if v not in (*READS, "WATCH") and n > 0
    }
    result.update(
        seconds=time.monotonic() - started,
        reconciles=reconciles,
        cluster_reads=reads,
        cluster_writes=writes,
        reads=own_reads,
        writes=own_writes,
        reads_per_reconcile=sum(own_reads.values()) / reconciles if reconciles else None,
        p50=quantile(m_before["buckets"], m_after["buckets"], 0.50),
        p99=quantile(m_before["buckets"], m_after["buckets"], 0.99),
        live_leases=upkeep.live(),
    )
    out[name] = result


def run_design(
    design: str,
    args: argparse.Namespace,
    api: client.ApiClient,
    paths: ClusterPaths,
    uris: dict[str, str],
    endpoint: str,
    upkeep: NodeUpkeep,
) -> dict[str, Any]:
    counts = ApiCounts(api)
    prefix = f"bsc-{design}-"
    namespace = namespace_with_secret(api, prefix + "fleet")
    log = paths.root / f"bench-scale-{design}.log"
    ref = BASELINE_COMMIT if design == "old" else args.new_ref
    op = Operator(
        design, None if ref == "worktree" else ref, paths.admin_kubeconfig, f"{prefix}*", log
    )
    out: dict[str, Any] = {"design": design}
    fleets: list[Fleet] = []
    cpu = CpuMeter.for_cluster(paths.pids, {"operator": op.proc.pid, "bench": os.getpid()})
    timeline = Timeline(api, namespace)

    def wait(fleet: Fleet, revision: str, timeout: float) -> tuple[dict[str, float], int]:
        if fleet not in fleets:
            fleets.append(fleet)
        interval = 0.25 if len(fleet.names) == 1 else 0.5  # one LIST per interval
        # A fleet's progress is rollouts getting there; one rollout's (the big one's) is
        # its pods, which this does not see: it gets the whole timeout.
        stall = args.stall if len(fleet.names) > 1 else None
        done, listing = fleet.wait(
            healthy_on(revision), timeout=timeout, interval=interval, stall_s=stall
        )
        if len(done) < len(fleet.names):
            print(f"not Healthy on {revision}:\n{describe_stragglers(done, listing)}")
        return done, len(fleet.names)

    def hops(r: dict[str, Any], fleet: Fleet, revision: str, replicas: int) -> None:
        r["hops"] = hop_table(timeline.milestones(fleet.changed_at, revision, replicas))

    try:
        timeline.__enter__()
        op.wait_serving()
        solo = Fleet(api, namespace, "solo", 1)
        solo.create(uris["v1"], "v1", endpoint)
        wait(solo, "v1", args.timeout)
        with phase("solo", op, counts, out, fleets, cpu, upkeep) as r:
            solo.set_model(uris["v2"], "v2")
            done, total = wait(solo, "v2", args.timeout)
            r.update(
                finished=len(done), total=total, all_healthy_s=max(done.values(), default=None)
            )
        hops(r, solo, "v2", 2)

        fleet = Fleet(api, namespace, "m", args.rollouts)
        with phase("create", op, counts, out, fleets, cpu, upkeep) as r:
            fleet.create(uris["v1"], "v1", endpoint)
            done, total = wait(fleet, "v1", args.timeout)
            r.update(
                finished=len(done), total=total, all_healthy_s=max(done.values(), default=None)
            )
        with phase("revision", op, counts, out, fleets, cpu, upkeep) as r:
            fleet.set_model(uris["v2"], "v2")
            done, total = wait(fleet, "v2", args.timeout)
            times = sorted(done.values())
            r.update(
                finished=len(done),
                total=total,
                all_healthy_s=times[-1] if len(done) == total and times else None,
                median_s=times[len(times) // 2] if times else None,
            )
        hops(r, fleet, "v2", 2)
        if args.big and design == "old" and out["revision"]["finished"] < args.rollouts:
            # One kopf daemon thread per rollout: with the fleet's holding all of them, a
            # new rollout never starts.
            out["big_skipped"] = "the fleet never finished: its rollouts hold every thread"
        elif args.big:
            big = Fleet(api, namespace, "big", 1)
            big.create(uris["v1"], "v1", endpoint, replicas=args.big)
            wait(big, "v1", args.timeout * 2)
            with phase("big", op, counts, out, fleets, cpu, upkeep) as r:
                big.set_model(uris["v2"], "v2")
                done, total = wait(big, "v2", args.timeout * 2)
                r.update(
                    finished=len(done), total=total, all_healthy_s=max(done.values(), default=None)
                )
            hops(r, big, "v2", args.big)
        with phase("steady", op, counts, out, fleets, cpu, upkeep):
            time.sleep(STEADY_S)
        out["rss_mb"], out["threads"] = op.peak_rss_mb, op.peak_threads
    finally:
        timeline.__exit__()
        op.stop()
        release_finalizers(api, namespace)
        testkit.delete_namespace(api, namespace)
    return out


def release_finalizers(api: client.ApiClient, namespace: str) -> None:
    """The baseline design's kopf finalizers, with its operator gone, would hold the
    namespace in Terminating for good (and its rollouts would wait for the next run's
    operator of that design): drop them."""
    custom = client.CustomObjectsApi(api)
    for rollout in custom.list_namespaced_custom_object(GROUP, VERSION, namespace, ROLLOUT_PLURAL)[
        "items"
    ]:
        if rollout["metadata"].get("finalizers"):
            with suppress(ApiException):
                custom.patch_namespaced_custom_object(
                    GROUP,
                    VERSION,
                    namespace,
                    ROLLOUT_PLURAL,
                    rollout["metadata"]["name"],
                    {"metadata": {"finalizers": None}},
                )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--nodes", type=int, default=5000)
    p.add_argument("--rollouts", type=int, default=100)
    p.add_argument("--big", type=int, default=500, help="replicas of the big rollout (0: none)")
    p.add_argument("--staging", type=float, default=0.1, help="share of nodes staging")
    p.add_argument("--timeout", type=float, default=420, help="seconds per wait")
    p.add_argument(
        "--stall",
        type=float,
        default=90,
        help="stop a wait when no rollout got there for this long (how far it got is the figure)",
    )
    p.add_argument("--designs", default="new,old")
    p.add_argument(
        "--scale-liveness",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run the cluster's controller manager and KWOK with components.SCALE_LIVENESS "
        "(node leases renewed every 50 s, NotReady after 120 s) and back to a kubelet's "
        "40 s after; default: above 1,000 nodes",
    )
    p.add_argument(
        "--new-ref",
        default="HEAD",
        help="commit of the new design (worktree: the working tree as it is)",
    )
    args = p.parse_args(argv)
    paths = ClusterPaths.default()
    if not local_cluster.is_up(paths):
        raise SystemExit("the local cluster is not up (weightship-dev cluster up)")
    api = admin_api(paths)
    apply_crds(api)  # a fresh cluster has none until the first e2e run
    endpoint = local_cluster.s3_endpoint()
    results: dict[str, Any] = {"args": vars(args), "load_before": os.getloadavg()[0]}
    bucket, uris = publish_models(endpoint)
    nodes: list[str] = []
    scale_liveness = args.scale_liveness if args.scale_liveness is not None else args.nodes > 1000
    lease_s, grace_s = SCALE_LIVENESS if scale_liveness else (0, NODE_MONITOR_GRACE_SECONDS)
    try:
        if scale_liveness:
            took = set_node_liveness(paths, lease_s, grace_s)
            print(
                f"controller manager and KWOK restarted in {took:.0f} s: node leases of "
                f"{lease_s} s (renewed every {lease_s / 4:.0f} s), NotReady after {grace_s} s"
            )
        started = time.monotonic()
        nodes = make_nodes(api, args.nodes)
        results["nodes_s"] = time.monotonic() - started
        print(f"{len(nodes)} KWOK nodes with a WeightCache each in {results['nodes_s']:.0f}s")
        upkeep = NodeUpkeep(api, nodes, grace_s)
        results["leases_s"] = upkeep.wait_all(timeout=300)
        print(f"every node with a live lease after {_fmt(results['leases_s'], ' s')} more")
        results["settle_s"] = settle_nodes(api)
        print(f"the controller manager done with the new nodes {results['settle_s']:.0f} s later")
        results["upkeep"] = measure_upkeep(api, paths, upkeep, UPKEEP_S)
        report_upkeep(results["upkeep"], len(nodes))
        with CacheLoad(api, nodes, args.staging) as load:
            print(f"WeightCache load: {load.rate:.0f} status writes/s")
            for design in args.designs.split(","):
                try:
                    results[design] = run_design(design, args, api, paths, uris, endpoint, upkeep)
                except Exception as e:  # the other design's figures still count
                    print(f"\n{design} design: the run failed: {e!r}")
                    continue
                report_design(results[design])
            results["cache_writes"] = load.writes
    finally:
        print(f"removing {len(nodes)} nodes and their WeightCaches")
        delete_nodes(api, nodes)
        if scale_liveness:
            set_node_liveness(paths, KWOK_LEASE_SECONDS, NODE_MONITOR_GRACE_SECONDS)
            print("controller manager and KWOK back to 40 s leases and grace period")
        s3 = testkit.local_s3(endpoint)
        testkit.empty_bucket(s3, bucket)
        s3.delete_bucket(Bucket=bucket)
    results["load_after"] = os.getloadavg()[0]
    summarize(results)
    return results


def _fmt(value: Any, unit: str = "", digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}{unit}"
    return f"{value}{unit}"


def report_design(r: dict[str, Any]) -> None:
    rows = []
    for name in ("solo", "create", "revision", "big", "steady"):
        if name not in r:
            continue
        f = r[name]
        finished = f"{f['finished']}/{f['total']}" if "finished" in f else ""
        rows.append(
            [
                name,
                finished,
                _fmt(f.get("all_healthy_s"), " s"),
                _fmt(f["reconciles"], digits=0),
                _fmt(f["reads_per_reconcile"], digits=2),
                _fmt(f["p50"], " s", 3),
                _fmt(f["p99"], " s", 3),
                ", ".join(f"{k} {v}" for k, v in f["reads"].items()) or "none",
                _fmt(sum(f["cluster_reads"].values())),
                _fmt(f.get("live_leases")),
            ]
        )
    print(f"\n{r['design']} design: peak RSS {r['rss_mb']:.0f} MB, {r['threads']} threads")
    header = [
        "phase",
        "Healthy",
        "all Healthy",
        "reconciles",
        "reads/rec",
        "p50",
        "p99",
        "operator's LIST/GET",
        "cluster LIST/GET",
        "live leases after",
    ]
    print(table(header, rows))
    for name in ("revision", "steady"):
        if name in r:
            print(f"{name}: operator's writes {r[name]['writes']}")
            print(f"{name}: cluster-wide writes {r[name]['cluster_writes']}")
            print(f"{name}: cluster-wide LIST/GET {r[name]['cluster_reads']}")
    if "cpu" in r.get("revision", {}):
        f = r["revision"]
        writes = sum(f["cluster_writes"].values())
        cpu_s = f["cpu"].get("kube-apiserver", 0.0) * f["seconds"]
        if writes:
            # What the API server alone needs for the phase's writes (and the watch events
            # each fans out), were it given both cores: a floor for the phase's time.
            print(
                f"revision: {writes} writes cluster-wide in {f['seconds']:.1f} s, API server "
                f"{cpu_s:.1f} CPU-s ({1000 * cpu_s / writes:.1f} ms a write): at least "
                f"{cpu_s / 2:.1f} s on 2 cores"
            )
    if r.get("revision", {}).get("api_latency"):
        print(
            "revision: the API server's own time per write, p50/p99 (bucket bounds): "
            + ", ".join(
                f"{kind} {_fmt(p50, ' s', 3)}/{_fmt(p99, ' s', 3)}"
                for kind, (p50, p99) in r["revision"]["api_latency"].items()
            )
        )
    if "big_skipped" in r:
        print(f"big: not run: {r['big_skipped']}")
    for name in ("solo", "revision", "big"):
        if "hops" in r.get(name, {}):
            print(f"\n{name}: where the time went, from each rollout's spec change")
            print(table(HOP_HEADER, r[name]["hops"]))
    print("\nCPU, share of one core (machine: 2 cores)")
    names = sorted({n for f in r.values() if isinstance(f, dict) for n in f.get("cpu", {})})
    rows = [
        [
            p,
            *(_fmt(r[p]["cpu"].get(n), digits=2) for n in names),
            _fmt(r[p]["machine_busy"], digits=2),
        ]
        for p in ("solo", "create", "revision", "big", "steady")
        if "cpu" in r.get(p, {})
    ]
    print(table(["phase", *names, "machine busy"], rows))


def summarize(results: dict[str, Any]) -> None:
    new, old = results.get("new"), results.get("old")
    print(
        f"\nload average before/after: {results['load_before']:.2f} / {results['load_after']:.2f}"
    )
    if new is None:
        return
    rev, solo = new["revision"], new["solo"]
    ratio = (
        rev["all_healthy_s"] / solo["all_healthy_s"]
        if rev.get("all_healthy_s") and solo.get("all_healthy_s")
        else None
    )
    base = ""
    if old is not None:
        o = old["revision"]
        base = (
            f"; old: {o['finished']}/{o['total']} Healthy, "
            f"{_fmt(o['reads_per_reconcile'], digits=1)} reads/reconcile, "
            f"RSS {old['rss_mb']:.0f} MB, {old['threads']} threads"
        )
    print(
        f"bench_scale: {results['args']['nodes']} nodes, {rev['finished']}/{rev['total']} "
        f"rollouts Healthy on rev 2 in {_fmt(rev.get('all_healthy_s'), ' s')} "
        f"({_fmt(ratio, 'x', 2)} one alone), steady reads/reconcile "
        f"{_fmt(new['steady']['reads_per_reconcile'], digits=2)}, p99 "
        f"{_fmt(rev['p99'], ' s', 3)}, RSS {new['rss_mb']:.0f} MB, {new['threads']} threads{base}"
    )


if __name__ == "__main__":
    main()
