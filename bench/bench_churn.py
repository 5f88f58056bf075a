"""Churn: 8 bandwidth-shaped hosts stage one model peer to peer while 2 of the first 7
are killed mid-stage (SIGKILL, serving and fetching) and the 8th joins late.

The network is bench_fleet's (network namespaces, every link capped at B with tc tbf).
The first 7 nodes start together, each given the 7 of them as peers (what the agent
lists at stage start); at ``--kill-at`` of S/B two of them are killed; at ``--join-at``
the 8th starts, given all 8 (the 2 dead included: it finds out). Every surviving node
must stage the model; each then hashes its staged files against the manifest's sha256
(nothing unverified was stored, so nothing unverified could have been served), and the
peer verification failures every node counted are summed (a byte served unverified
would have shown there). Origin egress is the origin's tx byte counter, as in
bench_fleet; the dead nodes' chunks are fetched again, so it is above S.

    .venv/bin/python bench/bench_churn.py            # 512 MiB, 8 nodes, 200 Mbit/s (root)
    .venv/bin/python bench/bench_churn.py --quick    # 64 MiB
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench_fleet import (
    NODE_SCRIPT,
    ORIGIN_IP,
    ORIGIN_NS,
    ORIGIN_PORT,
    PEER_PORT,
    PREFIX,
    RUN_DIR,
    cleanup,
    default_cache_root,
    node_ip,
    origin_tx_bytes,
    setup_network,
)
from benchlib import (
    BUCKET,
    WORK,
    MiB,
    local_origin,
    make_model,
    manifest_for,
    manifest_path,
    model_location,
    table,
    versitygw,
)

NODES = 8
KILLED = ("n2", "n5")
LATE = "n8"


def start_node(
    name: str, peers: list[str], args: argparse.Namespace, endpoint: str
) -> subprocess.Popen[bytes]:
    i = int(name[1:])
    location = model_location(Path(args.model))
    cmd = [
        *("ip", "netns", "exec", PREFIX + name, sys.executable, str(NODE_SCRIPT)),
        *("--node", name, "--listen", f"{node_ip(i)}:{PEER_PORT}"),
        *("--peers", ",".join(f"{n}={node_ip(int(n[1:]))}:{PEER_PORT}" for n in peers)),
        *("--endpoint", endpoint, "--bucket", BUCKET, "--prefix", location.prefix),
        *("--manifest", str(args.manifest_file), "--cache", str(Path(args.cache_root) / name)),
        *("--run-dir", str(RUN_DIR), "--workers", str(args.workers)),
        *("--timeout", str(args.timeout)),
    ]
    with open(RUN_DIR / f"{name}.log", "wb") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


def wait_files(
    procs: dict[str, subprocess.Popen[bytes]], names: list[str], suffix: str, timeout_s: float
) -> None:
    """Wait (bounded) until every named node wrote RUN_DIR/<name><suffix>; fail fast when
    a node that is not meant to die errors or exits."""
    deadline = time.monotonic() + timeout_s
    while not all((RUN_DIR / f"{n}{suffix}").exists() for n in names):
        errors = [p for p in sorted(RUN_DIR.glob("*.error")) if p.stem not in KILLED]
        if errors:
            raise RuntimeError(f"{errors[0].name}:\n{errors[0].read_text()}")
        for n in names:
            code = procs[n].poll()
            if code not in (None, 0):
                raise RuntimeError(f"node {n} exited with {code}; see {RUN_DIR}/{n}.log")
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s}s for {suffix} of {names}")
        time.sleep(0.05)


def run(args: argparse.Namespace, endpoint: str, bound_s: float) -> dict[str, Any]:
    shutil.rmtree(RUN_DIR, ignore_errors=True)
    RUN_DIR.mkdir(parents=True)
    shutil.rmtree(args.cache_root, ignore_errors=True)
    names = [f"n{i}" for i in range(1, NODES + 1)]
    early = [n for n in names if n != LATE]
    survivors = [n for n in names if n not in KILLED]
    procs = {n: start_node(n, early, args, endpoint) for n in early}
    events: list[tuple[float, str]] = []
    try:
        wait_files(procs, early, ".ready", 60)
        tx0 = origin_tx_bytes()
        start_at = time.time() + 0.5
        (RUN_DIR / "go.tmp").write_text(repr(start_at))
        (RUN_DIR / "go.tmp").replace(RUN_DIR / "go")
        kill_at, join_at = start_at + args.kill_at * bound_s, start_at + args.join_at * bound_s
        for when, what in sorted([(kill_at, "kill"), (join_at, "join")]):
            time.sleep(max(0.0, when - time.time()))
            if what == "kill":
                for n in KILLED:
                    procs[n].send_signal(signal.SIGKILL)
                    procs[n].wait(timeout=10)
            else:
                procs[LATE] = start_node(LATE, names, args, endpoint)
            events.append((round(time.time() - start_at, 2), what))
        wait_files(procs, survivors, ".json", args.timeout)
        tx1 = origin_tx_bytes()
        (RUN_DIR / "done").touch()
        wait_files(procs, survivors, ".verified.json", args.timeout)
        for n in survivors:
            procs[n].wait(timeout=30)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
        shutil.rmtree(args.cache_root, ignore_errors=True)
    nodes = {n: json.loads((RUN_DIR / f"{n}.json").read_text()) for n in survivors}
    bad = {n: json.loads((RUN_DIR / f"{n}.verified.json").read_text())["bad_files"] for n in nodes}
    return {
        "events": events,
        "nodes": nodes,
        "bad_files": {n: b for n, b in bad.items() if b},
        "origin_tx_bytes": tx1 - tx0,
        "peer_verification_failures": sum(n["peer_verification_failures"] for n in nodes.values()),
        "demotions": sum(n["demotions"] for n in nodes.values()),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rate-mbit", type=int, default=200, help="B: every link's cap, each way")
    p.add_argument("--size-mib", type=int, default=512, help="S: model size")
    p.add_argument("--chunk-mib", type=int, help="default 4 (1 with --quick)")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--kill-at", type=float, default=0.4, help="kill 2 nodes at this x S/B")
    p.add_argument("--join-at", type=float, default=0.6, help="the 8th joins at this x S/B")
    p.add_argument("--quick", action="store_true", help="64 MiB model, 1 MiB chunks")
    args = p.parse_args(argv)
    if args.quick:
        args.size_mib = 64
    args.chunk_mib = args.chunk_mib or (1 if args.quick else 4)
    if os.geteuid() != 0:
        raise SystemExit("bench_churn needs root (network namespaces, tc)")
    size = args.size_mib * MiB
    rate = args.rate_mbit * 1e6 / 8
    bound_s = size / rate
    args.cache_root = str(default_cache_root(size, NODES))
    args.timeout = 120 + 6 * size / rate
    model = make_model(size)
    args.model = str(model)
    manifest = manifest_for(model, args.chunk_mib * MiB)
    args.manifest_file = manifest_path(model, args.chunk_mib * MiB)
    cleanup()
    try:
        with local_origin(model):
            pass  # uploaded once (the piece layer too); the origin namespace serves the dir
        setup_network(NODES, args.rate_mbit)
        with versitygw(ORIGIN_IP, ORIGIN_PORT, netns=ORIGIN_NS) as endpoint:
            result = run(args, endpoint, bound_s)
    finally:
        cleanup()
    result.update(size_bytes=size, bound_seconds=bound_s, digest=manifest.digest)
    result.update(nodes_total=NODES, killed=list(KILLED), late=LATE)
    (WORK / "churn-results.json").write_text(json.dumps(result, indent=1))
    report(result, args)
    return result


def report(r: dict[str, Any], args: argparse.Namespace) -> None:
    size, bound = r["size_bytes"], r["bound_seconds"]
    print(
        f"\n## Churn: {NODES} nodes, S = {size / MiB:.0f} MiB, B = {args.rate_mbit} Mbit/s, "
        f"{args.chunk_mib} MiB chunks; {', '.join(KILLED)} killed at {args.kill_at:.1f}·S/B, "
        f"{LATE} joins at {args.join_at:.1f}·S/B (bound S/B = {bound:.1f} s)\n"
    )
    print("events (s after start): " + ", ".join(f"{w} at {t}" for t, w in r["events"]))
    rows = [
        [
            n,
            f"{d['seconds']:.1f}",
            f"{d['seconds'] / bound:.2f}",
            f"{d['from_origin'] / MiB:.0f}",
            f"{d['from_peers'] / MiB:.0f}",
            "yes" if d["staged"] and d["digest"] == r["digest"] else "NO",
            "yes" if d.get("piece_verified") else "no",
        ]
        for n, d in sorted(r["nodes"].items())
    ]
    header = ["node", "done s", "x S/B", "origin MiB", "peer MiB", "staged", "pieces verified"]
    print()
    print(table(header, rows))
    staged = sum(1 for d in r["nodes"].values() if d["staged"] and d["digest"] == r["digest"])
    slowest = max(d["seconds"] for d in r["nodes"].values())
    print(
        f"\nchurn: {staged}/{len(r['nodes'])} surviving nodes staged, "
        f"{len(r['bad_files'])} with files not matching the manifest, "
        f"{r['peer_verification_failures']:.0f} bad bytes from peers, "
        f"origin egress {r['origin_tx_bytes'] / size:.3f}x S, slowest {slowest / bound:.2f}x S/B"
    )


if __name__ == "__main__":
    main()
