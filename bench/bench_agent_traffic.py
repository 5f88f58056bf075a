"""The node agents' control traffic on the real API server (issue 42): N agents, one
rollout staged on all of them.

Each agent is the real agent reduced to its control traffic: it speaks to the API server
through the agent's own adapter (`weightship.agent.kube`: `AgentKube`, `rollout_informer`)
and decides when to write with the agent's own pure core (`agent.status`: the write
clock, the jittered state-change window, the progress interval; `agent.desired`: what
the rollouts want of its node, its live peers and who holds a digest). What it leaves
out is the data plane: a stage is `--stage-s` seconds of progress, no chunk moves.
Like the real agent, each one at start reads its Node, ensures its WeightCache and lists
the WeightCaches (its node count), then lists and watches the rollouts; at each stage
start it finds its peers (today: a LIST of every WeightCache), writes Staging, byte
progress and Staged as `status.write_due` allows, and a heartbeat every 60 s.

The agents run in `--procs` worker processes (each agent one watch thread; their
requests from two bounded pools per process, so a burst of LISTs queues in the bench
instead of holding gigabytes in flight: the burst is spread, the bytes are the same).
The bench plays the operator: it watches the WeightCaches (one watch, as the operator's
informer) and writes the rollout's status once a second while any node stages, with
the prefetch counts and up to 50 unstaged nodes (as the operator's reconcile, woken at
most once a second by WeightCache changes, does). The nodes are bare Node objects (no
KWOK: their upkeep is not the agents' traffic).

Figures come from the API server's own /metrics, scraped every `--scrape-s` (the
scrapes' own GETs are not counted, being non-resource requests): requests by verb and
resource, their peak rate, watch bytes sent (apiserver_watch_events_sizes, summed over
every watcher) and their peak rate, bytes of LIST responses by resource
(apiserver_response_sizes), the API server's CPU seconds and its peak RSS; for two
phases: `join` (the agents start) and `stage` (the canary appears, until every node is
Staged).

    PYTHONPATH=operator:devtools flock /tmp/weightship-heavy.lock \\
        .venv/bin/python bench/bench_agent_traffic.py --agents 500 --designs old

The cluster is shared: the bench removes its nodes, WeightCaches and namespace after.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import itertools
import json
import logging
import os
import random
import re
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import IO, Any

from kubernetes import client, config
from kubernetes.client.rest import ApiException

from weightship.agent import desired, status
from weightship.agent.kube import REQUEST_TIMEOUT_S, AgentKube, rollout_informer
from weightship.agent.main import MIN_TICK_GAP_S, PEER_MAX_AGE_S
from weightship.api.names import (
    CACHE_PLURAL,
    GROUP,
    ROLLOUT_PLURAL,
    VERSION,
    staged_node_label,
)
from weightship.kube.informer import Informer
from weightship_dev import cluster as local_cluster
from weightship_dev import testkit
from weightship_dev.install import apply_crds
from weightship_dev.layout import ClusterPaths
from weightship_dev.nodes import admin_api

REPO = Path(__file__).resolve().parent.parent
NODE_START = 30000  # kwok-gpu-30000…: apart from bench_scale's (20000…) and the e2e tests'
BENCH_LABEL = "weightship.io/bench-agents"
MB = 1e6
MAX_UNSTAGED_LISTED = 50  # status.prefetch.nodes, as the operator bounds it
METRICS = (
    "apiserver_request_total{",
    "apiserver_watch_events_sizes_sum{",
    "apiserver_watch_events_sizes_count{",
    "apiserver_response_sizes_sum{",
    "process_cpu_seconds_total ",
    "process_resident_memory_bytes ",
)
_LABELS = re.compile(r'(\w+)="([^"]*)"')


# ---- pure: the API server's metrics and the report -----------------------------------------
@dataclass(frozen=True)
class Sample:
    """One scrape of the API server's /metrics: cumulative counters at ``t``."""

    t: float
    requests: Counter[str] = field(default_factory=Counter)  # "VERB resource[/sub]" -> count
    # resource (kind before 1.33) -> bytes and events sent to watchers, every watcher counted
    watch_bytes: Counter[str] = field(default_factory=Counter)
    watch_events: Counter[str] = field(default_factory=Counter)
    list_bytes: Counter[str] = field(default_factory=Counter)  # resource -> LIST response bytes
    cpu_s: float = 0.0
    rss_bytes: float = 0.0


def parse_metrics(text: str, t: float) -> Sample:
    """The counters this bench reads, from the Prometheus text of kube-apiserver /metrics.
    Non-resource requests (the scrape itself, /healthz) have no resource and are left out."""
    requests: Counter[str] = Counter()
    watch_bytes: Counter[str] = Counter()
    watch_events: Counter[str] = Counter()
    list_bytes: Counter[str] = Counter()
    cpu = rss = 0.0
    for line in text.splitlines():
        if not line.startswith(METRICS):
            continue
        head, _, value_text = line.rpartition(" ")
        try:
            value = float(value_text)
        except ValueError:
            continue
        if line.startswith("process_cpu_seconds_total "):
            cpu = value
            continue
        if line.startswith("process_resident_memory_bytes "):
            rss = value
            continue
        labels = dict(_LABELS.findall(head))
        if head.startswith("apiserver_request_total{"):
            resource = labels.get("resource")
            if not resource:
                continue
            sub = labels.get("subresource")
            requests[f"{labels.get('verb')} {resource}" + (f"/{sub}" if sub else "")] += int(value)
        elif head.startswith("apiserver_watch_events_sizes_sum{"):
            watch_bytes[labels.get("resource") or labels.get("kind", "")] += int(value)
        elif head.startswith("apiserver_watch_events_sizes_count{"):
            watch_events[labels.get("resource") or labels.get("kind", "")] += int(value)
        elif head.startswith("apiserver_response_sizes_sum{") and labels.get("verb") == "LIST":
            list_bytes[labels.get("resource", "")] += int(value)
    return Sample(t, requests, watch_bytes, watch_events, list_bytes, cpu, rss)


def _rate_peak(samples: list[Sample], value: Callable[[Sample], float]) -> float:
    """The highest rate of ``value`` between two consecutive samples."""
    peak = 0.0
    for a, b in itertools.pairwise(samples):
        if b.t > a.t:
            peak = max(peak, (value(b) - value(a)) / (b.t - a.t))
    return peak


def phase_figures(samples: list[Sample]) -> dict[str, Any]:
    """What the API server did between the first and the last sample of a phase."""
    if len(samples) < 2:
        raise ValueError("a phase needs at least two samples")
    first, last = samples[0], samples[-1]
    requests = last.requests - first.requests
    return {
        "seconds": last.t - first.t,
        "requests": dict(sorted(requests.items())),
        "request_total": sum(requests.values()),
        "peak_req_per_s": _rate_peak(samples, lambda s: sum(s.requests.values())),
        "watch_mb": sum((last.watch_bytes - first.watch_bytes).values()) / MB,
        "watch_by_kind_mb": {
            k: v / MB for k, v in sorted((last.watch_bytes - first.watch_bytes).items())
        },
        "watch_events": sum((last.watch_events - first.watch_events).values()),
        "peak_watch_mb_per_s": _rate_peak(samples, lambda s: sum(s.watch_bytes.values())) / MB,
        "list_mb": {k: v / MB for k, v in sorted((last.list_bytes - first.list_bytes).items())},
        "list_mb_total": sum((last.list_bytes - first.list_bytes).values()) / MB,
        "cpu_s": last.cpu_s - first.cpu_s,
        "peak_rss_mb": max(s.rss_bytes for s in samples) / MB,
    }


def summary_line(agents: int, new: Mapping[str, Any] | None, old: Mapping[str, Any]) -> str:
    """The issue's line: the stage phase of the new design, the old one's in brackets (the
    old one alone when only it ran)."""

    def part(f: Mapping[str, Any]) -> str:
        return (
            f"{f['peak_req_per_s']:.0f} req/s peak, {f['peak_watch_mb_per_s']:.2f} watch MB/s "
            f"peak, {f['list_mb_total']:.1f} MB listed per stage, apiserver "
            f"{f['cpu_s']:.1f} CPU-s"
        )

    if new is None:
        return f"control traffic at {agents} agents (today's design): {part(old)}"
    return f"control traffic at {agents} agents: {part(new)} (before: {part(old)})"


def report_rows(name: str, f: Mapping[str, Any]) -> list[str]:
    top = sorted(f["requests"].items(), key=lambda kv: -kv[1])[:8]
    return [
        f"{name}: {f['seconds']:.0f} s, {f['request_total']} requests "
        f"(peak {f['peak_req_per_s']:.0f}/s): " + ", ".join(f"{k} {v}" for k, v in top),
        f"{name}: watch {f['watch_mb']:.1f} MB in {f['watch_events']:.0f} events (peak "
        f"{f['peak_watch_mb_per_s']:.2f} MB/s; "
        + ", ".join(f"{k} {v:.1f} MB" for k, v in f["watch_by_kind_mb"].items() if v > 0.05)
        + ")",
        f"{name}: LIST responses {f['list_mb_total']:.1f} MB ("
        + ", ".join(f"{k} {v:.1f}" for k, v in f["list_mb"].items() if v > 0.05)
        + f"); API server {f['cpu_s']:.1f} CPU-s, peak RSS {f['peak_rss_mb']:.0f} MB",
    ]


def unstaged(caches: Mapping[str, str], limit: int = MAX_UNSTAGED_LISTED) -> list[str]:
    """The nodes not Staged yet (node -> state), failed first then by name, at most
    ``limit``: the operator's status.prefetch.nodes."""
    order = {"Failed": 0, "Staging": 1, "Pending": 2}
    left = [(order.get(s, 2), n) for n, s in caches.items() if s != "Staged"]
    return [n for _, n in sorted(left)[:limit]]


# ---- one agent, its control traffic only -----------------------------------------------------
def node_name(index: int) -> str:
    return f"kwok-gpu-{index:04d}"


def digest_of(text: str) -> str:
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


@dataclass
class AgentStats:
    lists: int = 0
    writes: int = 0
    write_errors: int = 0
    discovery_errors: int = 0
    staged: int = 0
    peers_seen: int = 0  # summed over stage starts


class SimAgent:
    """One node's agent as the API server sees it (see the module's docstring)."""

    def __init__(
        self,
        node: str,
        kube: AgentKube,
        design: str,
        *,
        stage_s: float,
        total_bytes: int,
        cached: int,
        stop: threading.Event,
        rng: random.Random,
        namespace: str = "",
    ) -> None:
        self.node, self.kube, self.design, self.namespace = node, kube, design, namespace
        self.stage_s, self.total_bytes = stage_s, total_bytes
        self.rng = rng
        self.stats = AgentStats()
        self.labels: dict[str, str] = {}
        self.node_count = 1
        self.clock = status.WriteClock()
        now = datetime.now(UTC)
        # Models staged before (with their pins): what makes a WeightCache ~3 KB.
        self.entries: dict[str, status.Entry] = {
            d: status.Entry(
                d,
                "Staged",
                total_bytes,
                total_bytes,
                bytes_from_peers=total_bytes // 2,
                bytes_from_origin=total_bytes - total_bytes // 2,
                started_at=now - timedelta(hours=1),
                completed_at=now - timedelta(minutes=50),
                pinned_by=(f"serving/model-{i}",),
            )
            for i, d in enumerate(digest_of(f"old-{i}") for i in range(cached))
        }
        self.changed = threading.Event()
        self.members: Informer | None = None
        if design == PROPOSED:
            self.informer = plan_informer(kube, namespace, self.changed.set, stop)
            self.members = member_informer(kube, namespace, stop)
        else:
            self.informer = rollout_informer(kube, self.changed.set, stop=stop)
        self.last_tick = float("-inf")
        self.staging: str | None = None  # the digest being staged
        self.stage_started = 0.0  # monotonic, once its peers are known
        self.discovering = False
        self.writing = False

    # What the real agent's _join does: the node, its WeightCache, the node count.
    def join(self) -> None:
        node = self.kube.node(self.node)
        self.labels = dict(node["metadata"].get("labels") or {})
        self.kube.ensure_weight_cache(node)
        if self.members is not None:
            join_members(self.kube, self.namespace, self.node)
            self.members.start()
            self.members.synced.wait(timeout=120)
            self.node_count = max(1, len(self.members.snapshot()))
        else:
            self.node_count = max(1, len(self.kube.weight_caches()))
            self.stats.lists += 1
        self._urgent(time.monotonic())

    def _urgent(self, now: float) -> None:
        delay = status.state_write_delay_s(self.node_count, self.rng.random())
        status.mark_urgent(self.clock, now, delay)

    def discover(self, digest: str) -> None:
        """Agent._peers: the live peers and the holders of ``digest``."""
        try:
            if self.members is not None:
                self._discover_proposed(self.members, digest)
                return
            caches = self.kube.weight_caches()
            self.stats.lists += 1
            self.node_count = max(1, len(caches))
            found = desired.live_peers(caches, self.node, datetime.now(UTC), PEER_MAX_AGE_S)
            desired.staged_on(caches, digest)
            self.stats.peers_seen += len(found)
        except Exception:
            self.stats.discovery_errors += 1
        finally:
            self.stage_started = time.monotonic()
            self.discovering = False

    def _discover_proposed(self, members: Informer, digest: str) -> None:
        """Peers from the watch-fed membership (no request); holders from the operator's
        staged.weightship.io node label, a bounded LIST."""
        found = sorted((str(n), str(a)) for n, a in members.snapshot() if n != self.node)
        self.node_count = max(1, len(found) + 1)
        self.kube.core.list_node(
            label_selector=f"{staged_node_label(digest)}=true",
            limit=MAX_HOLDERS,
            _request_timeout=REQUEST_TIMEOUT_S,
        )
        self.stats.lists += 1
        self.stats.peers_seen += len(found)

    def write(self) -> None:
        """Agent._write_status."""
        try:
            body = status.build_status(
                peer_endpoint="10.0.0.1:7470",
                capacity_bytes=8 << 40,
                free_bytes=4 << 40,
                entries=list(self.entries.values()),
                now=datetime.now(UTC),
            )
            self.kube.patch_weight_cache_status(self.node, body)
            self.stats.writes += 1
        except Exception:
            self.stats.write_errors += 1
            self._urgent(time.monotonic())
        finally:
            self.writing = False

    def step(self, now: float, discovery: ThreadPoolExecutor, writes: ThreadPoolExecutor) -> None:
        """One pass of the agent's loop and its reporter (the driver calls it ~4x/s)."""
        if (
            self.changed.is_set()
            and now - self.last_tick >= MIN_TICK_GAP_S
            and self.informer.synced.is_set()
        ):
            self.changed.clear()
            self.last_tick = now
            self._tick(now, discovery)
        if self.staging is not None and not self.discovering:
            done = min(1.0, (now - self.stage_started) / self.stage_s)
            entry = self.entries[self.staging]
            if done >= 1.0:
                self.entries[self.staging] = replace(
                    entry,
                    state="Staged",
                    bytes_done=self.total_bytes,
                    bytes_from_peers=self.total_bytes,
                    completed_at=datetime.now(UTC),
                )
                self.staging = None
                self.stats.staged += 1
                self._urgent(now)
            else:
                self.entries[self.staging] = replace(
                    entry,
                    bytes_done=int(done * self.total_bytes),
                    bytes_from_peers=int(done * self.total_bytes),
                )
                self.clock.dirty = True
        if not self.writing:
            interval = status.progress_interval_s(self.node_count, min_interval_s=10.0)
            if status.write_due(self.clock, now, interval, heartbeat_s=60.0):
                status.mark_written(self.clock, now)
                self.writing = True
                writes.submit(self.write)

    def _tick(self, now: float, discovery: ThreadPoolExecutor) -> None:
        wants = desired.wanted(self.informer.snapshot(), self.labels)
        pins = {w.digest: w.pinned_by for w in wants}
        for digest, entry in list(self.entries.items()):
            pinned = tuple(sorted(pins.get(digest, ()))) or entry.pinned_by
            if pinned != entry.pinned_by:
                self.entries[digest] = replace(entry, pinned_by=pinned)
                self._urgent(now)
        if self.staging is not None:
            return
        staged = {d for d, e in self.entries.items() if e.state == "Staged"}
        nxt = desired.next_to_stage(wants, staged, {}, now)
        if nxt is None:
            return
        self.staging = nxt.digest
        self.entries[nxt.digest] = status.Entry(
            nxt.digest,
            "Staging",
            bytes_total=self.total_bytes,
            started_at=datetime.now(UTC),
            pinned_by=nxt.pinned_by,
        )
        self._urgent(now)
        self.discovering = True
        discovery.submit(self.discover, nxt.digest)


# ---- the proposed design, emulated (docs/agent.md "How peers are found at 5,000 nodes") ----
# Not the agent's code: raw calls shaped as the proposal would make them, so that its
# cost is measured beside today's in the same run before anyone builds it.
PROPOSED = "proposed"
MEMBER_LABEL = "weightship.io/peer-member"
PLAN_LABEL = "weightship.io/staging-plan"
PEER_ENDPOINT_ANNOTATION = "weightship.io/peer-endpoint"
MAX_HOLDERS = 32


def member_informer(kube: AgentKube, namespace: str, stop: threading.Event) -> Informer:
    """Every agent's membership record (a Lease named after its node, written when the
    agent starts and never while it stages): (node, peer endpoint)."""
    coord = client.CoordinationV1Api(kube.api)

    def project(obj: dict[str, Any]) -> dict[Any, Any]:
        meta = obj["metadata"]
        endpoint = (meta.get("annotations") or {}).get(PEER_ENDPOINT_ANNOTATION, "")
        return {meta["name"]: (meta["name"], endpoint)}

    return Informer(
        "members",
        functools.partial(coord.list_namespaced_lease, namespace, label_selector=MEMBER_LABEL),
        project,
        page_size=None,
        stop=stop,
    )


def join_members(kube: AgentKube, namespace: str, node: str) -> None:
    coord = client.CoordinationV1Api(kube.api)
    body = {
        "metadata": {
            "name": node,
            "labels": {MEMBER_LABEL: "true"},
            "annotations": {PEER_ENDPOINT_ANNOTATION: "10.0.0.1:7470"},
        },
        "spec": {"holderIdentity": node},
    }
    try:
        coord.create_namespaced_lease(namespace, body, _request_timeout=REQUEST_TIMEOUT_S)
    except ApiException as e:
        if e.status != 409:
            raise
        coord.patch_namespaced_lease(node, namespace, body, _request_timeout=REQUEST_TIMEOUT_S)


def plan_informer(
    kube: AgentKube, namespace: str, on_change: Callable[[], None], stop: threading.Event
) -> Informer:
    """The operator's agent-facing projection of each rollout (what `desired.wanted` reads,
    written only when it changes), kept here as a ConfigMap holding the rollout's shape."""

    def project(obj: dict[str, Any]) -> dict[Any, Any]:
        meta = obj["metadata"]
        return {(meta.get("namespace"), meta["name"]): json.loads(obj["data"]["rollout"])}

    return Informer(
        "plans",
        functools.partial(
            kube.core.list_namespaced_config_map, namespace, label_selector=PLAN_LABEL
        ),
        project,
        on_event=lambda _: on_change(),
        on_list=on_change,
        page_size=None,
        stop=stop,
    )


# ---- the worker process: a share of the agents -----------------------------------------------
def api_client(kubeconfig: str, connections: int) -> client.ApiClient:
    cfg = client.Configuration()
    config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
    cfg.connection_pool_maxsize = connections
    return client.ApiClient(cfg)


def worker(args: argparse.Namespace) -> None:
    """Run agents start..start+count-1 until stdin closes; JSON lines on stdout. Warnings
    are not logged: during an outage every watch of every agent says so (the API server's
    counters show the relists)."""
    logging.basicConfig(level=logging.ERROR)
    stop = threading.Event()
    api = api_client(args.kubeconfig, args.count + 2 * args.pool + 8)
    rng = random.Random(args.start)
    agents = [
        SimAgent(
            node_name(i),
            AgentKube(api),
            args.design,
            stage_s=args.stage_s,
            total_bytes=args.total_bytes,
            cached=args.cached,
            stop=stop,
            rng=rng,
            namespace=args.namespace,
        )
        for i in range(args.start, args.start + args.count)
    ]
    discovery = ThreadPoolExecutor(args.pool, thread_name_prefix="discovery")
    writes = ThreadPoolExecutor(args.pool, thread_name_prefix="writes")

    def say(**kv: Any) -> None:
        print(json.dumps(kv), flush=True)

    joins: list[Future[None]] = [discovery.submit(a.join) for a in agents]
    failed = sum(1 for f in joins if f.exception() is not None)
    for a in agents:
        a.informer.start()
    while not all(a.informer.synced.is_set() for a in agents):
        time.sleep(0.2)
    say(ready=True, join_failures=failed)

    def until_stdin_closes() -> None:
        sys.stdin.read()
        stop.set()

    threading.Thread(target=until_stdin_closes, daemon=True).start()
    next_report = time.monotonic() + 1.0
    while not stop.is_set():
        now = time.monotonic()
        for a in agents:
            a.step(now, discovery, writes)
        if now >= next_report:
            staged = sum(a.stats.staged for a in agents)
            say(staged=staged, writes=sum(a.stats.writes for a in agents))
            next_report = now + 2.0
        stop.wait(0.25)
    for a in agents:
        a.informer.stop(timeout_s=0.1)
    discovery.shutdown(wait=False, cancel_futures=True)
    writes.shutdown(wait=False, cancel_futures=True)
    total = AgentStats()
    for a in agents:
        for k in vars(total):
            setattr(total, k, getattr(total, k) + getattr(a.stats, k))
    say(stats=vars(total))


class Workers:
    """The worker processes of one design, and what they last said."""

    def __init__(
        self, args: argparse.Namespace, design: str, kubeconfig: Path, namespace: str
    ) -> None:
        per = -(-args.agents // args.procs)
        self.procs: list[subprocess.Popen[str]] = []
        self.said: list[dict[str, Any]] = []
        self.ready = 0
        self.stats: list[dict[str, int]] = []
        self.lock = threading.Lock()
        env = {**os.environ, "PYTHONPATH": f"{REPO / 'operator'}:{REPO / 'devtools'}"}
        for p in range(args.procs):
            start = NODE_START + p * per
            count = min(per, NODE_START + args.agents - start)
            if count <= 0:
                break
            proc = subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "worker",
                    f"--kubeconfig={kubeconfig}",
                    f"--start={start}",
                    f"--count={count}",
                    f"--design={design}",
                    f"--namespace={namespace}",
                    f"--stage-s={args.stage_s}",
                    f"--total-bytes={args.total_bytes}",
                    f"--cached={args.cached}",
                    f"--pool={args.pool}",
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env=env,
            )
            self.procs.append(proc)
            self.said.append({})
            assert proc.stdout is not None
            threading.Thread(target=self._read, args=(len(self.procs) - 1, proc.stdout)).start()

    def _read(self, index: int, out: IO[str]) -> None:
        for line in out:
            with suppress(ValueError):
                msg = json.loads(line)
                with self.lock:
                    self.said[index].update(msg)
                    if "stats" in msg:
                        self.stats.append(msg["stats"])

    def all_ready(self) -> bool:
        with self.lock:
            return all(s.get("ready") for s in self.said)

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def stop(self, timeout_s: float = 30.0) -> dict[str, int]:
        for p in self.procs:
            with suppress(OSError):
                assert p.stdin is not None
                p.stdin.close()
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        total: Counter[str] = Counter()
        with self.lock:
            for s in self.stats:
                total.update(s)
        return dict(total)


# ---- the cluster's side ------------------------------------------------------------------------
class Scraper:
    """The API server's /metrics every ``every_s``, kept as samples."""

    def __init__(self, api: client.ApiClient, every_s: float) -> None:
        self.api, self.every_s = api, every_s
        self.samples: list[Sample] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def read(self) -> Sample:
        raw = self.api.rest_client.pool_manager.request(
            "GET", self.api.configuration.host + "/metrics", timeout=30
        ).data.decode()
        return parse_metrics(raw, time.monotonic())

    def _run(self) -> None:
        while not self.stop.is_set():
            with suppress(Exception):
                self.samples.append(self.read())
            self.stop.wait(self.every_s)

    def mark(self) -> int:
        """A sample now; its index in `samples`."""
        self.samples.append(self.read())
        return len(self.samples) - 1

    def __enter__(self) -> Scraper:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        self.thread.join()


def make_nodes(api: client.ApiClient, count: int, run: str, args: argparse.Namespace) -> list[str]:
    """Bare Node objects (no KWOK annotation: nothing renews their leases) labelled for the
    bench's rollout, each with a WeightCache holding the models staged before."""
    core = client.CoreV1Api(api)

    def create(index: int) -> str:
        name = node_name(index)
        body = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": name,
                "labels": {
                    "kubernetes.io/hostname": name,
                    "kubernetes.io/os": "linux",
                    BENCH_LABEL: run,
                },
            },
        }
        try:
            core.create_node(body)
        except ApiException as e:
            if e.status != 409:
                raise
            core.patch_node(name, {"metadata": {"labels": {BENCH_LABEL: run}}})
        agent = SimAgent(
            name,
            AgentKube(api),
            "setup",
            stage_s=1,
            total_bytes=args.total_bytes,
            cached=args.cached,
            stop=threading.Event(),
            rng=random.Random(index),
        )
        agent.kube.ensure_weight_cache(agent.kube.node(name))
        agent.write()
        return name

    with ThreadPoolExecutor(max_workers=16) as pool:
        return list(pool.map(create, range(NODE_START, NODE_START + count)))


def delete_nodes(api: client.ApiClient, names: Iterable[str]) -> None:
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)

    def delete(name: str) -> None:
        with suppress(ApiException):
            custom.delete_cluster_custom_object(GROUP, VERSION, CACHE_PLURAL, name)
        with suppress(ApiException):
            core.delete_node(name)

    with ThreadPoolExecutor(max_workers=16) as pool:
        list(pool.map(delete, names))


def rollout_body(name: str, run: str) -> dict[str, Any]:
    labels = {"app": name}
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "ModelRollout",
        "metadata": {"name": name},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {"containers": [{"name": "server", "image": "pause"}]},
            },
            "model": {
                "source": {"uri": "s3://bench/models/v2/", "endpoint": "http://10.0.0.9:7070"},
                "revision": "v2",
            },
            "prefetch": {
                "enabled": True,
                "nodeSelector": {BENCH_LABEL: run},
                "minStagedPercent": 100,
            },
            "strategy": {"canary": {"steps": [{"setWeight": 50}, {"setWeight": 100}]}},
        },
    }


class OperatorPlay:
    """The operator's share of a stage: it watches every WeightCache (one informer) and
    writes the rollout's prefetch status once a second while nodes stage."""

    def __init__(
        self, api: client.ApiClient, namespace: str, rollout: str, run: str, digest: str
    ) -> None:
        self.custom = client.CustomObjectsApi(api)
        self.namespace, self.rollout, self.run, self.digest = namespace, rollout, run, digest
        self.stop = threading.Event()

        def project(obj: dict[str, Any]) -> dict[Any, Any]:
            for m in (obj.get("status") or {}).get("manifests") or []:
                if m.get("digest") == self.digest:
                    return {obj["metadata"]["name"]: (m.get("state"), m.get("bytesDone", 0))}
            return {obj["metadata"]["name"]: ("Pending", 0)}

        self.caches = Informer(
            CACHE_PLURAL,
            lambda **kw: self.custom.list_cluster_custom_object(
                GROUP, VERSION, CACHE_PLURAL, label_selector="", **kw
            ),
            project,
            stop=self.stop,
        )
        self.writes = 0

    def write_plan(self, rollout: dict[str, Any], started: str) -> None:
        """The proposed design's agent-facing projection of the rollout: written when the
        digests change, never for progress."""
        shape = {
            "metadata": {"name": self.rollout, "namespace": self.namespace},
            "spec": {"model": rollout["spec"]["model"], "prefetch": rollout["spec"]["prefetch"]},
            "status": {
                "canaryRevision": {"manifestDigest": self.digest},
                "stableRevision": {"manifestDigest": digest_of("old-0")},
                "prefetchNodeSelector": {BENCH_LABEL: self.run},
                "stepStartTime": started,
            },
        }
        client.CoreV1Api(self.custom.api_client).create_namespaced_config_map(
            self.namespace,
            {
                "metadata": {"name": self.rollout, "labels": {PLAN_LABEL: "true"}},
                "data": {"rollout": json.dumps(shape, separators=(",", ":"))},
            },
        )

    def write(self, nodes: set[str], started: str) -> int:
        """One status write: the counts and the unstaged nodes. Returns the staged count."""
        seen = {str(k): v[0] for k, v in self.caches.items() if k in nodes and v}
        staged = sum(1 for s, _ in seen.values() if s == "Staged")
        body = {
            "status": {
                "phase": "Prefetching",
                "message": f"staging {self.digest}: {staged}/{len(nodes)} nodes",
                "canaryRevision": {
                    "revision": "v2",
                    "manifestDigest": self.digest,
                    "podTemplateHash": "bench2",
                },
                "stableRevision": {
                    "revision": "v1",
                    "manifestDigest": digest_of("old-0"),
                    "podTemplateHash": "bench1",
                },
                "stepStartTime": started,
                "prefetchNodeSelector": {BENCH_LABEL: self.run},
                "prefetch": {
                    "manifestDigest": self.digest,
                    "stagedNodes": staged,
                    "targetNodes": len(nodes),
                    "bytesStaged": sum(b for _, b in seen.values()),
                    "bytesTotal": 0,
                    "nodes": [
                        {"name": n, "state": seen[n][0] if n in seen else "Pending"}
                        for n in unstaged({n: seen.get(n, ("Pending", 0))[0] for n in nodes})
                    ],
                },
            }
        }
        self.custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, self.namespace, ROLLOUT_PLURAL, self.rollout, body
        )
        self.writes += 1
        return staged


# ---- one design's run --------------------------------------------------------------------------
def run_design(
    design: str,
    args: argparse.Namespace,
    api: client.ApiClient,
    kubeconfig: Path,
    scraper: Scraper,
    nodes: list[str],
    run: str,
) -> dict[str, Any]:
    custom = client.CustomObjectsApi(api)
    namespace = testkit.create_namespace(api, f"bat-{design}")
    name = "llm"
    out: dict[str, Any] = {"design": design}
    digest = digest_of(f"{run}-{design}-canary")
    custom.create_namespaced_custom_object(
        GROUP, VERSION, namespace, ROLLOUT_PLURAL, rollout_body(name, run)
    )
    play = OperatorPlay(api, namespace, name, run, digest)
    play.caches.start()
    workers: Workers | None = None
    node_set = set(nodes)
    try:
        if design == PROPOSED:
            # Members already, as today's agents have their WeightCaches already.
            kube = AgentKube(api)
            with ThreadPoolExecutor(max_workers=16) as pool:
                list(pool.map(lambda n: join_members(kube, namespace, n), nodes))
        # Join: the agents start (their first status write included).
        first = scraper.mark()
        started = time.monotonic()
        workers = Workers(args, design, kubeconfig, namespace)
        while not workers.all_ready():
            if not workers.alive():
                raise RuntimeError("a worker process died while its agents joined")
            if time.monotonic() - started > args.timeout:
                raise RuntimeError(f"the agents did not join within {args.timeout:.0f} s")
            time.sleep(0.5)
        # Their first writes come within the state-change window.
        time.sleep(status.state_write_window_s(len(nodes)) + 2.0)
        out["join"] = phase_figures(scraper.samples[first : scraper.mark() + 1])
        out["join"]["wall_s"] = time.monotonic() - started
        print(f"{design}: {len(nodes)} agents joined in {out['join']['wall_s']:.0f} s", flush=True)
        # Stage: the canary appears; the operator writes status each second until all Staged.
        first = scraper.mark()
        started = time.monotonic()
        stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        if design == PROPOSED:
            play.write_plan(rollout_body(name, run), stamp)
        staged = play.write(node_set, stamp)
        last_print = started
        while staged < len(nodes):
            if not workers.alive():
                raise RuntimeError("a worker process died while staging")
            if time.monotonic() - started > args.timeout:
                print(f"{design}: stopped after {args.timeout:.0f} s, {staged} staged")
                break
            time.sleep(1.0)
            staged = play.write(node_set, stamp)
            if time.monotonic() - last_print > 15:
                print(f"{design}: {staged}/{len(nodes)} staged", flush=True)
                last_print = time.monotonic()
        out["stage"] = phase_figures(scraper.samples[first : scraper.mark() + 1])
        out["stage"]["wall_s"] = time.monotonic() - started
        out["stage"]["staged"] = staged
        out["stage"]["status_writes_by_operator"] = play.writes
        if args.outage_s > 0:
            out["return"] = outage(args, scraper)
            print(
                f"{design}: API server down {args.outage_s:.0f} s; the minute after its "
                f"return: peak {out['return']['peak_req_per_s']:.0f} req/s",
                flush=True,
            )
    finally:
        if workers is not None:
            out["agents"] = workers.stop()
        play.stop.set()
        play.caches.stop(timeout_s=1.0)
        testkit.delete_namespace(api, namespace)
    return out


def outage(args: argparse.Namespace, scraper: Scraper) -> dict[str, Any]:
    """kube-apiserver and etcd SIGKILLed for ``outage_s``, then the ``after_s`` after their
    return. Its counters restart with the process: the phase starts from zero at the
    return (what it served before the first scrape is in the first interval)."""
    paths = ClusterPaths.default()
    local_cluster.kill_api_server(paths)
    time.sleep(args.outage_s)
    try:
        local_cluster.start_api_server(paths)
    finally:
        back = Sample(time.monotonic())
    first = len(scraper.samples)
    time.sleep(args.after_s)
    scraper.mark()
    figures = phase_figures([back, *scraper.samples[first:]])
    figures["peak_rss_mb"] = max(s.rss_bytes for s in scraper.samples[first:]) / MB
    return figures


def cache_size(api: client.ApiClient, nodes: list[str]) -> float:
    """Mean bytes of one of the bench's WeightCaches as the API server serves it."""
    custom = client.CustomObjectsApi(api)
    raw = custom.get_cluster_custom_object(
        GROUP, VERSION, CACHE_PLURAL, nodes[0], _preload_content=False
    ).data
    return float(len(raw))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="command")
    w = sub.add_parser("worker")
    w.add_argument("--kubeconfig", required=True)
    w.add_argument("--start", type=int, required=True)
    w.add_argument("--count", type=int, required=True)
    w.add_argument("--design", default="old")
    w.add_argument("--namespace", default="")
    w.add_argument("--stage-s", type=float, default=60.0)
    w.add_argument("--total-bytes", type=int, default=16 << 30)
    w.add_argument("--cached", type=int, default=3)
    w.add_argument("--pool", type=int, default=8)
    p.add_argument("--agents", type=int, default=500)
    p.add_argument("--procs", type=int, default=4)
    p.add_argument("--pool", type=int, default=8, help="request threads per worker and pool")
    p.add_argument("--designs", default="old")
    p.add_argument("--stage-s", type=float, default=60.0, help="seconds a stage lasts")
    p.add_argument("--total-bytes", type=int, default=16 << 30)
    p.add_argument(
        "--cached", type=int, default=3, help="models each cache holds already (~3.3 KB)"
    )
    p.add_argument("--timeout", type=float, default=480.0, help="seconds per phase")
    p.add_argument("--scrape-s", type=float, default=2.0)
    p.add_argument(
        "--outage-s",
        type=float,
        default=0.0,
        help="after the stage, kill kube-apiserver and etcd for this long (0: not)",
    )
    p.add_argument("--after-s", type=float, default=60.0, help="measured after the return")
    args = p.parse_args(argv)
    if args.command == "worker":
        worker(args)
        return {}
    paths = ClusterPaths.default()
    if not local_cluster.is_up(paths):
        raise SystemExit("the local cluster is not up (weightship-dev cluster up)")
    api = admin_api(paths)
    apply_crds(api)
    run = f"r{random.randrange(1 << 20):05x}"
    results: dict[str, Any] = {"args": vars(args), "load_before": os.getloadavg()[0]}
    nodes: list[str] = []
    try:
        started = time.monotonic()
        nodes = make_nodes(api, args.agents, run, args)
        results["cache_bytes"] = cache_size(api, nodes)
        print(
            f"{len(nodes)} nodes and WeightCaches ({results['cache_bytes']:.0f} bytes each) "
            f"in {time.monotonic() - started:.0f} s",
            flush=True,
        )
        with Scraper(api, args.scrape_s) as scraper:
            for design in args.designs.split(","):
                try:
                    results[design] = run_design(
                        design, args, api, paths.admin_kubeconfig, scraper, nodes, run
                    )
                except Exception as e:  # the other design's figures still count
                    print(f"\n{design} design: the run failed: {e!r}")
                    continue
                report(results[design], len(nodes))
    finally:
        print(f"removing {len(nodes)} nodes and their WeightCaches", flush=True)
        delete_nodes(api, nodes)
    results["load_after"] = os.getloadavg()[0]
    old, new = results.get("old"), results.get(PROPOSED)
    if old is not None and "stage" in old:
        print(
            summary_line(len(nodes), new["stage"] if new and "stage" in new else None, old["stage"])
        )
    print(f"load average before/after: {results['load_before']:.2f} / {results['load_after']:.2f}")
    return results


def report(r: Mapping[str, Any], agents: int) -> None:
    print(f"\n{r['design']} design, {agents} agents:")
    for name in ("join", "stage", "return"):
        if name in r:
            for line in report_rows(name, r[name]):
                print("  " + line)
    if "stage" in r:
        print(
            f"  stage: {r['stage']['staged']}/{agents} Staged in {r['stage']['wall_s']:.0f} s, "
            f"{r['stage']['status_writes_by_operator']} rollout status writes"
        )
    print(f"  agents: {r.get('agents')}", flush=True)


if __name__ == "__main__":
    main()
