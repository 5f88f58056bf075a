"""Fleet: stage one model onto N nodes over bandwidth-capped links, peer-to-peer and
origin-only, and compare with the physical bound S/B (origin-only: N·S/B).

Topology, all inside network namespaces (nothing on the host's routes or bridges):

    wsbench-sw      owns bridge br0 and one veth end per host
    wsbench-origin  versitygw on 198.18.0.100:7070
    wsbench-nI      fleet_node.py: peer server on 198.18.0.(10+I):7000, then stage()

Every veth is capped at B with tc tbf on both ends, so each host, the origin too, has B
up and B down. Origin egress is the tx byte counter of the origin's eth0 (wire bytes:
TCP/IP and HTTP headers and retransmissions included).

    sudo .venv/bin/python bench/bench_fleet.py            # 512 MiB, 8 nodes, 200 Mbit/s
    sudo .venv/bin/python bench/bench_fleet.py --quick    # 64 MiB

With WSBENCH_TRACE=1 each node also records every origin fetch and peer stream it made
(chunk, peer, start, end) in its fleet-run/nI.json ("trace"); bench/fleet_trace.py says
where the last round's time went.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Collection
from contextlib import suppress
from pathlib import Path
from typing import Any

from benchlib import (
    BUCKET,
    WORK,
    MiB,
    local_origin,
    make_model,
    manifest_for,
    manifest_path,
    model_location,
    settle,
    table,
    versitygw,
)

PREFIX = "wsbench-"
SWITCH = PREFIX + "sw"
ORIGIN_NS = PREFIX + "origin"
ORIGIN_IP, ORIGIN_PORT, PEER_PORT = "198.18.0.100", 7070, 7000
NODE_SCRIPT = Path(__file__).with_name("fleet_node.py")
RUN_DIR = WORK / "fleet-run"


def sh(*cmd: str) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=30).stdout


def node_ip(i: int) -> str:
    return f"198.18.0.{10 + i}"


def cleanup() -> None:
    """Delete every wsbench- namespace, ending the processes this benchmark left in them."""
    for line in sh("ip", "netns", "list").splitlines():
        ns = line.split(" ")[0]
        if not ns.startswith(PREFIX):
            continue
        for pid in sh("ip", "netns", "pids", ns).split():
            with suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def setup_network(
    nodes: int, rate_mbit: int, slowed: Collection[int] = (), slow_factor: float = 1.0
) -> None:
    sh("ip", "netns", "add", SWITCH)
    sh("ip", "-n", SWITCH, "link", "add", "br0", "type", "bridge")
    sh("ip", "-n", SWITCH, "link", "set", "br0", "up")
    hosts = [("origin", ORIGIN_IP)] + [(f"n{i}", node_ip(i)) for i in range(1, nodes + 1)]
    for name, addr in hosts:
        rate_kbit = rate_mbit * 1000 * (slow_factor if name in {f"n{i}" for i in slowed} else 1)
        tbf = ["root", "tbf", "rate", f"{rate_kbit:.0f}kbit", "burst", "256kb", "latency", "20ms"]
        ns, port = PREFIX + name, f"v-{name}"
        sh("ip", "netns", "add", ns)
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "-n", SWITCH, "link", "add", port, "type", "veth", "peer", "eth0", "netns", ns)
        sh("ip", "-n", SWITCH, "link", "set", port, "master", "br0", "up")
        sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
        sh("ip", "-n", ns, "link", "set", "eth0", "up")
        sh("ip", "-n", ns, "link", "set", "eth0", "address", host_mac(addr))
        sh("tc", "-n", ns, "qdisc", "add", "dev", "eth0", *tbf)  # host egress
        sh("tc", "-n", SWITCH, "qdisc", "add", "dev", port, *tbf)  # host ingress
    # Every host knows every other's MAC, as a datacenter's hosts do after their first
    # minute: resolved on the fly, ARP queued behind bulk data in a full token bucket was
    # lost, and at 48 hosts peers saw "No route to host" and connect timeouts (2026-12-06).
    neighbours = "".join(
        f"neigh replace {addr} lladdr {host_mac(addr)} dev eth0 nud permanent\n"
        for _, addr in hosts
    )
    for name, _ in hosts:
        subprocess.run(
            ["ip", "-n", PREFIX + name, "-batch", "-"],
            input=neighbours,
            check=True,
            capture_output=True,
            text=True,
            timeout=30,
        )


def host_mac(addr: str) -> str:
    """A fixed, locally administered MAC per benchmark address."""
    last = [int(x) for x in addr.split(".")[-2:]]
    return "02:00:c6:12:{:02x}:{:02x}".format(*last)


def origin_tx_bytes() -> int:
    link = json.loads(sh("ip", "-n", ORIGIN_NS, "-s", "-j", "link", "show", "dev", "eth0"))
    return int(link[0]["stats64"]["tx"]["bytes"])


class LinkSampler:
    """Byte counters of every switch port, sampled every ``period_s`` while a run stages.

    Reads ``/proc/<pid>/net/dev`` of a sleeper inside the switch namespace (no process
    started per sample). On a port, rx is what its host sent (v-origin rx: the origin's
    uplink) and tx what its host received (v-nI tx: node I's downlink)."""

    def __init__(self, period_s: float = 0.1) -> None:
        self.period_s = period_s
        self.samples: list[tuple[float, dict[str, tuple[int, int]]]] = []
        self._stop = threading.Event()
        self._sleeper = subprocess.Popen(["ip", "netns", "exec", SWITCH, "sleep", "3600"])
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _read(self) -> dict[str, tuple[int, int]]:
        ports = {}
        for line in Path(f"/proc/{self._sleeper.pid}/net/dev").read_text().splitlines()[2:]:
            name, _, rest = line.partition(":")
            fields = rest.split()
            if name.strip().startswith("v-"):
                ports[name.strip()] = (int(fields[0]), int(fields[8]))  # rx, tx bytes
        return ports

    def start(self, at: float) -> None:
        self._at = at
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.time() - self._at, self._read()))
            self._stop.wait(self.period_s)

    def stop(self) -> list[tuple[float, dict[str, tuple[int, int]]]]:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self._sleeper.kill()
        self._sleeper.wait()
        return self.samples


def cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs, from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def run_fleet(mode: str, args: argparse.Namespace, manifest_file: Path, endpoint: str) -> dict:
    """Start every node, release them together, wait (bounded) for all, collect results."""
    shutil.rmtree(RUN_DIR, ignore_errors=True)
    RUN_DIR.mkdir(parents=True)
    cache_root = Path(args.cache_root)
    shutil.rmtree(cache_root, ignore_errors=True)
    names = [f"n{i}" for i in range(1, args.nodes + 1)]
    peers = ",".join(f"{n}={node_ip(i)}:{PEER_PORT}" for i, n in enumerate(names, 1))
    location = model_location(Path(args.model))
    procs = []
    sampler = LinkSampler()
    for i, name in enumerate(names, 1):
        cmd = [
            *("ip", "netns", "exec", PREFIX + name, sys.executable, str(NODE_SCRIPT)),
            *("--node", name, "--listen", f"{node_ip(i)}:{PEER_PORT}"),
            *("--peers", "" if mode == "origin-only" else peers),
            *("--endpoint", endpoint, "--bucket", BUCKET, "--prefix", location.prefix),
            *("--manifest", str(manifest_file), "--cache", str(cache_root / name)),
            *("--run-dir", str(RUN_DIR), "--workers", str(args.workers)),
            *("--timeout", str(args.timeout)),
            *(["--no-claims"] if mode == "p2p-no-claims" else []),
            *(["--no-pacing"] if mode in ("p2p-unpaced", "p2p-round2") else []),
            *(["--per-owner", "0"] if mode == "p2p-round2" else []),
            *(["--no-late-probes"] if mode == "p2p-no-late" else []),
            *(["--no-holder-probes"] if mode in ("p2p-no-holders", "p2p-round4") else []),
            *(["--no-uplink-hold"] if mode in ("p2p-no-hold", "p2p-round4") else []),
            *(["--whole-uploads", "0"] if mode in ("p2p-no-cap", "p2p-round4") else []),
            *(["--no-redirect"] if mode in ("p2p-no-redirect", "p2p-round4") else []),
            *(["--no-split"] if mode == "p2p-no-split" else []),
            *(["--keep-origin-connections"] if mode == "p2p-keep-origin" else []),
            # The schedule before 2026-12-06: every node an origin fetcher, relays in a ring.
            *(["--relay-fanout", "1", "--origin-fetchers", "100000"] if mode == "p2p-ring" else []),
            *(
                ["--relay-fanout", mode.removeprefix(FANOUT_MODE)]
                if mode.startswith(FANOUT_MODE)
                else []
            ),
            *args.node_args.split(),
            *(args.b_node_args.split() if mode == B_MODE else []),
        ]
        with open(RUN_DIR / f"{name}.log", "wb") as log:
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT))
    try:
        wait_all(procs, [RUN_DIR / f"{n}.ready" for n in names], 60)
        tx0, cpu0 = origin_tx_bytes(), cpu_times()
        start_at = time.time() + 0.5
        sampler.start(start_at)
        (RUN_DIR / "go.tmp").write_text(repr(start_at))
        (RUN_DIR / "go.tmp").replace(RUN_DIR / "go")
        wait_all(procs, [RUN_DIR / f"{n}.json" for n in names], args.timeout)
        tx1, cpu1 = origin_tx_bytes(), cpu_times()
        links = sampler.stop()
        (RUN_DIR / "done").touch()
        wait_all(procs, [RUN_DIR / f"{n}.verified.json" for n in names], args.timeout)
        for p in procs:
            p.wait(timeout=30)
    finally:
        sampler.stop()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
        shutil.rmtree(cache_root, ignore_errors=True)
    nodes = [json.loads((RUN_DIR / f"{n}.json").read_text()) for n in names]
    bad = {n: json.loads((RUN_DIR / f"{n}.verified.json").read_text())["bad_files"] for n in names}
    secs = sorted(n["seconds"] for n in nodes)
    return {
        "mode": mode,
        "seconds": secs[-1],
        "p50_seconds": secs[len(secs) // 2],
        "nodes": nodes,
        "bad_files": {n: b for n, b in bad.items() if b},
        "origin_tx_bytes": tx1 - tx0,
        "origin_payload_bytes": sum(n["from_origin"] for n in nodes),
        "peer_bytes": sum(n["from_peers"] for n in nodes),
        "cpu_busy": (cpu1[0] - cpu0[0]) / max(1, cpu1[1] - cpu0[1]),
        # Every process's and the kernel's (the rig's network included): how near the
        # hosts, which share this machine's cores, came to using all of them.
        "machine_cpu_s": (cpu1[0] - cpu0[0]) / os.sysconf("SC_CLK_TCK"),
        "links": links,
    }


def wait_all(procs: list[subprocess.Popen[bytes]], paths: list[Path], timeout_s: float) -> None:
    """Wait until every path exists; fail fast when a node errors or exits early."""
    deadline = time.monotonic() + timeout_s
    while not all(p.exists() for p in paths):
        errors = sorted(RUN_DIR.glob("*.error"))
        if errors:
            raise RuntimeError(f"{errors[0].name}:\n{errors[0].read_text()}")
        if any(p.poll() not in (None, 0) for p in procs):
            raise RuntimeError(f"a node exited early; see {RUN_DIR}/*.log")
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s}s for {[p.name for p in paths]}")
        time.sleep(0.1)


def default_cache_root(size: int, nodes: int) -> Path:
    """tmpfs when it has room: 8 nodes share this VM's one disk, a real node has its own."""
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free > 2 * size * nodes:
        return shm / "wsbench-fleet"
    return WORK / "fleet-cache"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--nodes", type=int, default=8)
    p.add_argument("--rate-mbit", type=int, default=200, help="B: every link's cap, each way")
    p.add_argument("--size-mib", type=int, default=512, help="S: model size")
    p.add_argument("--chunk-mib", type=int, help="default 4 (1 with --quick)")
    p.add_argument(
        "--piece-kib", type=int, help="piece size of the manifest (default: the format's, chunk/16)"
    )
    p.add_argument("--workers", type=int, default=4, help="stage() workers per node")
    p.add_argument(
        "--modes",
        default="p2p,origin-only",
        help="p2p, p2p-no-claims (tail claims off), p2p-unpaced (peer intake not paced), "
        "p2p-round2 (neither paced nor a per-owner limit: the code before round 3), "
        "p2p-v1 (a version 1 manifest: sha256 chunks, store-and-forward), "
        "p2p-no-late (nodes never probe whether they joined late), "
        "p2p-no-holders (a late node asks the owner first, no holder), "
        "p2p-no-hold (origin intake never waits for a busy uplink), "
        "p2p-no-cap (no limit on whole chunks a node sends at once), "
        "p2p-no-redirect (an owner holds requests for the chunks a peer claimed), "
        "p2p-round4 (none of those four: the code before them), "
        "p2p-no-split (a slow whole transfer is never split across two peers), "
        "p2p-keep-origin (one origin connection per node for the whole stage), "
        "p2p-ring (every node fetches from the origin, relays in a ring: the schedule "
        "before 2026-12-06), p2p-fanout-K (relay trees with K children per node), "
        "p2p-b (p2p with --b-node-args), origin-only",
    )
    p.add_argument(
        "--node-args", default="", help="more fleet_node.py flags for every node (exploring)"
    )
    p.add_argument(
        "--b-node-args",
        default="",
        help=f"fleet_node.py flags for mode {B_MODE} only: p2p with them, for an A/B",
    )
    p.add_argument("--rounds", type=int, default=1, help="run the modes this many times, in turn")
    p.add_argument(
        "--settle-load",
        type=float,
        default=0.5,
        help="start each round once the 1-minute load average is below this (0: at once)",
    )
    p.add_argument("--settle-max-s", type=float, default=300, help="... waiting this long at most")
    p.add_argument("--cache-root", help="node caches (default: /dev/shm when it has room)")
    p.add_argument("--quick", action="store_true", help="64 MiB model, 1 MiB chunks")
    p.add_argument(
        "--slow-hosts",
        default="",
        help="hosts (numbers: 8,13) whose links run at --slow-factor of B, both ways",
    )
    p.add_argument("--slow-factor", type=float, default=0.1)
    args = p.parse_args(argv)
    if args.quick:
        args.size_mib = 64
    args.chunk_mib = args.chunk_mib or (1 if args.quick else 4)
    if os.geteuid() != 0:
        raise SystemExit("bench_fleet needs root (network namespaces, tc)")
    size = args.size_mib * MiB
    rate = args.rate_mbit * 1e6 / 8  # bytes/s
    args.cache_root = args.cache_root or str(default_cache_root(size, args.nodes))
    args.timeout = 60 + 3 * args.nodes * size / rate  # generous; only a bound on hangs
    model = make_model(size)
    args.model = str(model)
    piece = args.piece_kib * 1024 if args.piece_kib else None
    manifest = manifest_for(model, args.chunk_mib * MiB, piece_size=piece)
    manifest_file = manifest_path(model, args.chunk_mib * MiB, piece_size=piece)
    v1_file = None
    if "p2p-v1" in args.modes.split(","):
        manifest_for(model, args.chunk_mib * MiB, version=1)
        v1_file = manifest_path(model, args.chunk_mib * MiB, 1)
    results: dict[str, Any] = {
        "size_bytes": manifest.total_size,
        "digest": manifest.digest,
        "nodes": args.nodes,
        "rate_mbit": args.rate_mbit,
        "chunk_mib": args.chunk_mib,
        "workers": args.workers,
        "bound_seconds": manifest.total_size / rate,
    }
    slowed = [int(i) for i in args.slow_hosts.split(",") if i]
    if any(not 1 <= i <= args.nodes for i in slowed):
        raise SystemExit(f"--slow-hosts: hosts are numbered 1 to {args.nodes}")
    results["slow_hosts"] = [f"n{i}" for i in slowed]
    results["slow_factor"] = args.slow_factor
    results["loadavg_before"] = os.getloadavg()[0]
    cleanup()
    try:
        with local_origin(model):
            pass  # uploaded once; the gateway in the origin namespace serves the same dir
        setup_network(args.nodes, args.rate_mbit, slowed, args.slow_factor)
        with versitygw(ORIGIN_IP, ORIGIN_PORT, netns=ORIGIN_NS) as endpoint:
            results["rounds"] = []
            for _ in range(args.rounds):  # interleaved, so load drifts hit every mode alike
                for mode in args.modes.split(","):
                    chosen = v1_file if mode == "p2p-v1" and v1_file else manifest_file
                    started_at_load = settle(args.settle_load, args.settle_max_s)
                    results[mode] = run_fleet(mode, args, chosen, endpoint)
                    results["rounds"].append(
                        summary(results[mode], manifest.total_size, rate)
                        | {"load_at_start": started_at_load}
                    )
                    if slowed:
                        slow_report(results, results[mode])  # each round's, as it ends
    finally:
        cleanup()
    results["loadavg_after"] = os.getloadavg()[0]
    (WORK / "fleet-results.json").write_text(json.dumps(results, indent=1))
    report(results)
    return results


def slow_report(r: dict[str, Any], m: dict[str, Any]) -> None:
    """The hosts not slowed (S/B at the full link), and who stopped relaying."""
    slowed = set(r["slow_hosts"])
    others = sorted(n["seconds"] for n in m["nodes"] if n["node"] not in slowed)
    stopped = {n["node"]: n.get("relay_stopped_s") for n in m["nodes"] if n.get("relay_stops")}
    bound = r["bound_seconds"]
    when = ", ".join(f"{node} at {s:.1f} s" for node, s in sorted(stopped.items()) if s)
    print(
        f"slow hosts: {len(slowed)} of {r['nodes']} at {r['slow_factor']:.0%} of B "
        f"({', '.join(sorted(slowed))}); the others' slowest {others[-1] / bound:.2f}x S/B, "
        f"p50 {others[len(others) // 2] / bound:.2f}x; {len(stopped)} stopped relaying "
        f"({len(set(stopped) - slowed)} of them not slowed{'; ' + when if when else ''})",
        flush=True,
    )


def link_use(
    links: list[tuple[float, dict[str, tuple[int, int]]]], port: str, way: int, rate: float
) -> list[float]:
    """The share of B a port carried in each whole second of the run (way 0: what its host
    sent, 1: what it received)."""
    points = [(t, ports[port][way]) for t, ports in links if port in ports]
    if len(points) < 2:
        return []
    shares = []
    for second in range(int(points[-1][0])):
        # The samples nearest each end (they drift off whole seconds): the bytes between
        # them over the time between them, not over a nominal second.
        (t0, b0), (t1, b1) = (
            min(points, key=lambda p: abs(p[0] - at)) for at in (second, second + 1)
        )
        if t1 > t0:
            shares.append((b1 - b0) / (t1 - t0) / rate)
    return shares


FANOUT_MODE = "p2p-fanout-"  # then K: relay trees with K children per node (exploring)
B_MODE = "p2p-b"  # p2p with --b-node-args (exploring)


def summary(run: dict[str, Any], size: int, rate: float) -> dict[str, Any]:
    return {
        "mode": run["mode"],
        "x_bound": run["seconds"] / (size / rate),
        "origin_wire_x": run["origin_tx_bytes"] / size,
        "machine_cpu_s": run["machine_cpu_s"],
        "loadavg": os.getloadavg()[0],
    }


def report(r: dict[str, Any]) -> None:
    size, bound, n = r["size_bytes"], r["bound_seconds"], r["nodes"]
    print(
        f"\n## Fleet: {n} nodes, S = {size / MiB:.0f} MiB, B = {r['rate_mbit']} Mbit/s per link, "
        f"{r['chunk_mib']} MiB chunks, {r['workers']} workers\n"
    )
    rows = [["bound S/B", f"{bound:.1f}", "", "1.00", "", "", "", ""]]
    fanouts = tuple(m for m in r if m.startswith(FANOUT_MODE) or m == B_MODE)
    for mode, mult in (
        *((m, 1) for m in fanouts),
        ("p2p", 1),
        ("p2p-no-claims", 1),
        ("p2p-unpaced", 1),
        ("p2p-round2", 1),
        ("p2p-v1", 1),
        ("p2p-no-late", 1),
        ("p2p-no-holders", 1),
        ("p2p-no-hold", 1),
        ("p2p-no-cap", 1),
        ("p2p-no-redirect", 1),
        ("p2p-round4", 1),
        ("p2p-no-split", 1),
        ("p2p-keep-origin", 1),
        ("p2p-ring", 1),
        ("origin-only", n),
    ):
        if mode not in r:
            continue
        m = r[mode]
        rows.append(
            [
                f"{mode} (bound {mult}·S/B = {mult * bound:.1f} s)",
                f"{m['seconds']:.1f}",
                f"{m['p50_seconds']:.1f}",
                f"{m['seconds'] / bound:.2f}",
                f"{m['seconds'] / (mult * bound):.2f}",
                f"{m['origin_tx_bytes'] / size:.3f}",
                f"{m['origin_payload_bytes'] / size:.3f}",
                f"{m['cpu_busy']:.0%}",
            ]
        )
    header = ["run", "slowest s", "p50 s", "x S/B", "x own bound", "origin wire xS"]
    print(table([*header, "origin payload xS", "CPU busy"], rows))
    p2p_modes = ("p2p", "p2p-no-claims", "p2p-unpaced", "p2p-round2", "p2p-v1", "p2p-no-late")
    ablations = (
        "p2p-no-holders",
        "p2p-no-hold",
        "p2p-no-cap",
        "p2p-no-redirect",
        "p2p-round4",
        "p2p-no-split",
        "p2p-keep-origin",
        "p2p-ring",
        *fanouts,
    )
    for mode in (*p2p_modes, *ablations):
        if mode not in r:
            continue
        m = r[mode]  # its last round; the summary line is the median of its rounds
        runs = [x for x in r["rounds"] if x["mode"] == mode]
        ratios = sorted(x["x_bound"] for x in runs)
        over = f", median of {len(runs)} rounds" if len(runs) > 1 else ""
        print(
            f"\n{mode}: {ratios[len(ratios) // 2]:.2f}x S/B (target ≤ 1.10{over}), origin egress "
            f"{max(x['origin_wire_x'] for x in runs):.3f}x S on the wire (target ≤ 1.02), "
            f"slowest/p50 {m['seconds'] / m['p50_seconds']:.2f}"
        )
        if "origin-only" in r:
            print(f"speed-up over origin-only: {r['origin-only']['seconds'] / m['seconds']:.2f}x")
        cpu = sum(n.get("cpu_s", 0.0) for n in m["nodes"])
        print(
            f"the {n} node processes used {cpu:.1f} CPU s while staging "
            f"({cpu / m['seconds']:.2f} cores over the slowest node's time)"
        )
        if r.get("slow_hosts"):
            slow_report(r, m)
        else:
            stopped = [n["node"] for n in m["nodes"] if n.get("relay_stops")]
            print(f"{len(stopped)} nodes stopped relaying {stopped if stopped else ''}")
        sys_s = sum(n.get("cpu_sys_s", 0.0) for n in m["nodes"])
        wakeups = sum(n.get("wakeups", 0) for n in m["nodes"])
        print(f"of which {sys_s:.1f} CPU s in the kernel; {wakeups} thread wakeups")
        if "machine_cpu_s" in m:
            staged_gb = n * size / 1e9
            print(
                f"the machine's {os.cpu_count()} CPUs: {m['machine_cpu_s']:.1f} CPU s busy "
                f"while staging, {m['machine_cpu_s'] / staged_gb:.2f} CPU s per GB staged "
                f"({m['cpu_busy']:.0%} busy)"
            )
        print(
            f"\nper node ({mode}): own origin queue done at, chunks claimed from slow owners, "
            "slow whole transfers split\n"
        )
        rows = [
            [
                n["node"],
                f"{n['seconds']:.1f}",
                f"{n['origin_done_s']:.1f}",
                f"{n.get('claimed', 0):.0f}",
                "{used:.0f}/{unused:.0f}".format(**n.get("splits", {"used": 0, "unused": 0})),
                f"{n['from_origin'] / MiB:.0f}",
                f"{n.get('origin_requests', 0):.0f}",
                str(n["peer_answers"]["not_yet"]),
            ]
            for n in m["nodes"]
        ]
        header = ["node", "done s", "origin done s", "claimed", "splits used/unused"]
        header += ["origin MiB", "origin requests", "peer not-yet"]
        print(table(header, rows))
        links = m.get("links") or []
        if links:
            rate = r["rate_mbit"] * 1e6 / 8
            up = link_use(links, "v-origin", 0, rate)
            print(
                "\norigin uplink, % of B in each second: "
                + " ".join(f"{x:.0%}".rstrip("%") for x in up)
            )
            for node in m["nodes"]:
                for way, name in ((1, "downlink"), (0, "uplink")):
                    use = link_use(links, f"v-{node['node']}", way, rate)
                    print(
                        f"{node['node']} {name}, % of B: "
                        + " ".join(f"{x:.0%}".rstrip("%") for x in use[: int(node["seconds"])])
                    )
    if len(r["rounds"]) > len({x["mode"] for x in r["rounds"]}):
        print(
            "\nevery round (x S/B; origin wire x S; 1-minute load average at the round's "
            "start/end):\n"
        )
        modes = list(dict.fromkeys(x["mode"] for x in r["rounds"]))
        rows = []
        for mode in modes:
            runs = [x for x in r["rounds"] if x["mode"] == mode]
            ratios = sorted(x["x_bound"] for x in runs)
            rows.append(
                [
                    mode,
                    " ".join(f"{x['x_bound']:.2f}" for x in runs),
                    f"{ratios[len(ratios) // 2]:.2f}",
                    f"{max(x['origin_wire_x'] for x in runs):.3f}",
                    " ".join(f"{x['load_at_start']:.1f}/{x['loadavg']:.1f}" for x in runs),
                ]
            )
        print(table(["mode", "x S/B, in order", "median", "max origin x S", "load"], rows))
    print(f"load average before/after: {r['loadavg_before']:.2f} / {r['loadavg_after']:.2f}")


if __name__ == "__main__":
    main()
