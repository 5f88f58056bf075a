"""One node: stage() from a local S3 server (versitygw on loopback) against s5cmd.

Both read the same objects from the same server. Ours verifies every byte (version 2:
BLAKE3 of each 1 MiB piece as it lands, against the manifest's piece layer; version 1:
the chunk's sha256 once it is in), writes it once at its offset into the preallocated
file (starting its writeback at once), and fsyncs each file once; s5cmd only downloads,
so it is shown alone and with a separate sha256 pass over what it wrote (verified
against verified). Ours runs two ways, rounds interleaved: "pwrite" (the default: into
a buffer reused from chunk to chunk, then ``pwrite``) and "mapped" (the socket's bytes
land in the file's shared mapping), to A/B the copy the mapping saves against the fresh
pages it faults in; ``--versions 2,1`` adds the sha256
manifest to the same rounds.

    sudo .venv/bin/python bench/bench_stage_single.py            # 512 MiB
    .venv/bin/python bench/bench_stage_single.py --quick         # 128 MiB, fewer configs
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import os
import resource
import shutil
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import blake3
from prometheus_client import CollectorRegistry

from benchlib import (
    ACCESS_KEY,
    REGION,
    SECRET_KEY,
    SERVER_PIDS,
    WORK,
    MiB,
    gbps,
    local_origin,
    make_model,
    manifest_for,
    median_of,
    model_location,
    process_cpu_seconds,
    table,
    verify_files,
)
from weightship.data.chunkstore import ChunkStore
from weightship.data.metrics import DataPlaneMetrics
from weightship.data.modelstaging import ModelStaging
from weightship.data.s3 import S3Origin
from weightship.data.stage import stage
from weightship.weightformat.build import DEFAULT_CHUNK_SIZE
from weightship.weightformat.manifest import Manifest

OUT = WORK / "single-out"


def s5cmd_path() -> Path:
    found = Path(sys.executable).parent / "s5cmd"
    if found.is_file():
        return found
    which = shutil.which("s5cmd")
    if not which:
        raise FileNotFoundError("s5cmd not found: make venv (the dev lock has it)")
    return Path(which)


def fresh_out() -> Path:
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir(parents=True)
    os.sync()  # earlier runs' dirty pages must not be flushed inside this one's timing
    return OUT


@dataclass(frozen=True)
class Run:
    """One timed run: wall seconds and the CPU seconds it cost on this machine."""

    seconds: float
    client_cpu: float  # the downloader: this process (threads included) or its children
    server_cpu: float  # versitygw

    @property
    def cpu(self) -> float:
        return self.client_cpu + self.server_cpu


def measured(fn: Callable[[], object], server_pid: int) -> Run:
    def client() -> float:
        ru = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
        return sum(r.ru_utime + r.ru_stime for r in ru)

    client0, server0, started = client(), process_cpu_seconds(server_pid), time.perf_counter()
    fn()
    seconds = time.perf_counter() - started
    return Run(seconds, client() - client0, process_cpu_seconds(server_pid) - server0)


def run_s5cmd(endpoint: str, model: Path, manifest: Manifest) -> tuple[Run, Run]:
    """The download, and the sha256 pass over what it wrote (checked against the manifest)."""
    out = fresh_out()
    env = {
        **os.environ,
        "AWS_ACCESS_KEY_ID": ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        "AWS_REGION": REGION,
    }
    src = f"{model_location(model)}*"
    cmd = [str(s5cmd_path()), "--endpoint-url", endpoint, "cp", "--exclude", "*.json", src]
    server = SERVER_PIDS[endpoint]
    download = measured(
        lambda: subprocess.run(
            [*cmd, f"{out}/"], env=env, check=True, capture_output=True, timeout=600
        ),
        server,
    )
    bad: list[str] = []
    hashing = measured(lambda: bad.extend(verify_files(out, manifest)), server)
    assert not bad, f"s5cmd wrote files that do not match the manifest: {bad}"
    return download, hashing


DEFAULT_WORKERS: int = inspect.signature(stage).parameters["workers"].default


def spread(runs: list[Run]) -> tuple[float, float]:
    """The fastest and the slowest of the repeats, seconds."""
    return min(r.seconds for r in runs), max(r.seconds for r in runs)


PATHS = ("mapped", "pwrite")


DEFAULT_PATH = "mapped" if ModelStaging.map_partial_files else "pwrite"


def run_ours(origin: S3Origin, manifest: Manifest, workers: int, path: str = DEFAULT_PATH) -> Run:
    if path != DEFAULT_PATH:
        with patched(ModelStaging, "map_partial_files", path == "mapped"):
            return run_ours(origin, manifest, workers, DEFAULT_PATH)
    store = ChunkStore(fresh_out())
    metrics = DataPlaneMetrics.create(CollectorRegistry())
    results = []

    def staging() -> None:
        results.append(
            stage(manifest, store, origin, [], node="bench", metrics=metrics, workers=workers)
        )

    run = measured(staging, SERVER_PIDS[origin_endpoint(origin)])
    assert results[0].digest == manifest.digest and store.is_staged(manifest.digest)
    assert results[0].from_origin == manifest.total_size, results[0]
    return run


def origin_endpoint(origin: S3Origin) -> str:
    return str(origin.client.meta.endpoint_url)


class Timers:
    """Thread-seconds spent per phase, summed over worker threads."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._lock = threading.Lock()
        self.local = threading.local()

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                with self._lock:
                    self.seconds[name] += time.perf_counter() - started

        return timed


@contextmanager
def patched(obj: Any, attr: str, value: Any) -> Iterator[None]:
    old = getattr(obj, attr)
    setattr(obj, attr, value)
    try:
        yield
    finally:
        setattr(obj, attr, old)


def profile_ours(origin: S3Origin, manifest: Manifest, workers: int, path: str) -> dict[str, float]:
    """One staging run with the library's phases timed (bench-side wrappers, no edits)."""
    t = Timers()
    with (
        patched(origin, "read_range_into", t.wrap("S3 GET + verify", origin.read_range_into)),
        patched(ModelStaging, "receive", t.wrap("store", ModelStaging.receive)),
        patched(os, "fsync", t.wrap("fsync (file)", os.fsync)),
    ):
        wall = run_ours(origin, manifest, workers, path).seconds
    s = t.seconds
    # receive() runs the GET inside it, into the mapping or (pwrite) a buffer
    s["write + journal"] = s["store"] - s["S3 GET + verify"] - s["fsync (file)"]
    s["wall"] = wall
    return dict(s)


def ceilings(origin: S3Origin, manifest: Manifest, workers: int) -> dict[str, float]:
    """Seconds for the same chunks with parts of the path taken away."""
    chunks = manifest.chunks

    def get(c: Any) -> Any:
        return origin.read_range(c.file, c.offset, c.size)

    def timed(fn: Callable[[Any], Any], items: Any) -> float:
        started = time.perf_counter()
        with ThreadPoolExecutor(workers) as pool:
            for _ in pool.map(fn, items):
                pass
        return time.perf_counter() - started

    blob = os.urandom(manifest.chunk_size)
    piece = 1 << 20

    def pieces(data: Any) -> None:
        view = memoryview(data)
        for s in range(0, len(view), piece):
            blake3.blake3(view[s : s + piece]).digest()

    with patched(os, "fsync", lambda fd: None):
        no_fsync = run_ours(origin, manifest, workers).seconds
    return {
        "S3 GET only (bytes dropped)": timed(get, chunks),
        "S3 GET, then blake3 pieces, in memory": timed(lambda c: pieces(get(c)), chunks),
        "blake3 1 MiB pieces only, in memory": timed(lambda _: pieces(blob), chunks),
        "sha256 only, in memory": timed(lambda _: hashlib.sha256(blob).digest(), chunks),
        "stage() with fsync disabled": no_fsync,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--size-mib", type=int, default=512)
    p.add_argument("--workers", default="2,3,4", help="comma-separated stage() worker counts")
    p.add_argument("--chunk-mib", default="4,16", help="comma-separated chunk sizes")
    p.add_argument("--paths", default=",".join(PATHS), help="comma-separated: mapped, pwrite")
    p.add_argument(
        "--versions", default="2", help="manifest versions: 2 (blake3 pieces), 1 (sha256)"
    )
    p.add_argument(
        "--repeats", type=int, default=3, help="rounds (s5cmd, then every config); median counts"
    )
    p.add_argument(
        "--headline",
        default=f"{DEFAULT_CHUNK_SIZE // MiB},{DEFAULT_WORKERS},{DEFAULT_PATH}",
        help="chunk MiB,workers,path: the config the summary line is of (default: stage()'s "
        "own defaults), chosen before the run, never the fastest of the sweep",
    )
    p.add_argument("--quick", action="store_true", help="128 MiB, 3 workers, 16 MiB, 1 repeat")
    p.add_argument("--no-profile", action="store_true", help="skip the breakdown runs")
    args = p.parse_args(argv)
    if args.quick:
        args.size_mib, args.workers, args.chunk_mib, args.repeats = 128, "3", "16", 1
        args.headline = f"16,3,{DEFAULT_PATH}"
    size = args.size_mib * MiB
    workers = [int(w) for w in args.workers.split(",")]
    chunks = [int(c) * MiB for c in args.chunk_mib.split(",")]
    paths = args.paths.split(",")
    versions = [int(v) for v in args.versions.split(",")]
    chunk_mib, headline_workers, headline_path = args.headline.split(",")
    headline = (int(chunk_mib) * MiB, int(headline_workers), headline_path, versions[0])
    if headline[:3] not in {(c, w, path) for c in chunks for w in workers for path in paths}:
        p.error(f"--headline {args.headline} is not among --chunk-mib, --workers and --paths")
    version = subprocess.run(
        [str(s5cmd_path()), "version"], capture_output=True, text=True, check=True, timeout=30
    ).stdout.strip()

    model = make_model(size)
    manifests = {
        (c, v): manifest_for(model, c, version=1 if v == 1 else 2) for c in chunks for v in versions
    }
    result: dict[str, Any] = {"size_bytes": size, "s5cmd_version": version}
    result["loadavg_before"] = os.getloadavg()
    try:
        with local_origin(model) as (endpoint, client):
            origin = S3Origin(client, model_location(model))
            # Rounds interleave the baseline with every config, so a change in the shared
            # machine's load hits both sides alike; each one's median round counts.
            configs = [
                (c, w, path, v) for v in versions for c in chunks for w in workers for path in paths
            ]
            runs: list[tuple[Run, Run]] = []
            mine: dict[tuple[int, int, str, int], list[Run]] = {k: [] for k in configs}
            for _ in range(args.repeats):
                runs.append(run_s5cmd(endpoint, model, manifests[(chunks[0], versions[0])]))
                for c, w, path, v in configs:
                    mine[(c, w, path, v)].append(run_ours(origin, manifests[(c, v)], w, path))
            s5_dl, s5_hash = median_of(runs, lambda r: r[0].seconds)
            result["s5cmd_spread"] = spread([dl for dl, _ in runs])
            ours: list[dict[str, Any]] = []
            for (c, w, path, v), tries in mine.items():
                ours.append(
                    {"chunk_mib": c // MiB, "workers": w, "path": path, "version": v}
                    | asdict(median_of(tries, lambda r: r.seconds))
                    | {"spread": spread(tries), "headline": (c, w, path, v) == headline}
                )
            chosen = next(o for o in ours if o["headline"])
            if not args.no_profile:
                m = manifests[(chosen["chunk_mib"] * MiB, chosen["version"])]
                result["profile"] = profile_ours(origin, m, chosen["workers"], chosen["path"])
                result["ceilings"] = ceilings(origin, m, chosen["workers"])
    finally:
        shutil.rmtree(OUT, ignore_errors=True)
    result["loadavg_after"] = os.getloadavg()

    result.update(s5cmd=s5_dl.seconds, s5cmd_sha256=s5_hash.seconds, ours=ours, chosen=chosen)
    result.update(s5cmd_run=asdict(s5_dl), s5cmd_sha256_run=asdict(s5_hash))
    result.update(repeats=args.repeats)
    result["ratio"] = s5_dl.seconds / chosen["seconds"]  # ours/s5cmd in throughput
    result["ratio_verified"] = (s5_dl.seconds + s5_hash.seconds) / chosen["seconds"]
    (WORK / "single-results.json").write_text(json.dumps(result, indent=1))
    report(result)
    return result


def report(r: dict[str, Any]) -> None:
    size = r["size_bytes"]
    gib = size / 2**30

    def row(name: str, run: dict[str, float], spread: tuple[float, float] | None) -> list[str]:
        cpu = run["client_cpu"] + run["server_cpu"]
        return [
            name,
            f"{run['seconds']:.2f}",
            f"{spread[0]:.2f}-{spread[1]:.2f}" if spread else "",
            f"{gbps(size, run['seconds']):.3f}",
            f"{run['client_cpu']:.2f}",
            f"{run['server_cpu']:.2f}",
            f"{cpu / gib:.2f}",
        ]

    dl, sha = r["s5cmd_run"], r["s5cmd_sha256_run"]
    both = {k: dl[k] + sha[k] for k in dl}
    rows = [
        row(f"s5cmd {r['s5cmd_version']} (download only)", dl, r["s5cmd_spread"]),
        row("s5cmd + sha256 pass (2 threads)", both, None),
    ]
    for o in r["ours"]:
        verify = "blake3 pieces" if o["version"] == 2 else "sha256 chunks"
        name = f"stage() {o['path']}, {o['workers']} workers, {o['chunk_mib']} MiB chunks, {verify}"
        rows.append(row(f"{name}{' (headline)' if o['headline'] else ''}", o, o["spread"]))
    before, after = r["loadavg_before"][0], r["loadavg_after"][0]
    print(f"\n## One node, {size / MiB:.0f} MiB, versitygw on loopback")
    print(
        f"(load average {before:.2f} before, {after:.2f} after; each row the run with the "
        f"median time of {r['repeats']}, its spread the fastest-slowest)\n"
    )
    header = ["path", "median s", "spread s", "GB/s", "client CPU s", "server CPU s"]
    print(table([*header, "core-s / GiB"], rows))
    fastest = min(r["ours"], key=lambda o: o["seconds"])
    print(
        f"\nfastest by median: v{fastest['version']}, {fastest['path']}, "
        f"{fastest['workers']} workers, {fastest['chunk_mib']} MiB, "
        f"ours/s5cmd {r['s5cmd'] / fastest['seconds']:.2f}x (picked after the run)"
    )
    b = r["chosen"]
    print(
        f"ours (v{b['version']}, {b['path']}, {b['workers']} workers, "
        f"{b['chunk_mib']} MiB; median of {r['repeats']}): "
        f"ours/s5cmd = {r['ratio']:.2f}x, verified vs verified = {r['ratio_verified']:.2f}x "
        "(target >= 1.0x)"
    )
    cores = os.cpu_count() or 1
    ours_cpu = b["client_cpu"] + b["server_cpu"]
    s5_cpu = dl["client_cpu"] + dl["server_cpu"]
    print(
        f"CPU floor on {cores} cores (all CPU of the run / cores): ours {ours_cpu / cores:.2f} s, "
        f"s5cmd download {s5_cpu / cores:.2f} s"
    )
    if "profile" in r:
        prof, wall = r["profile"], r["profile"]["wall"]
        print(
            f"\n### Where the time goes (one run, {b['path']}, {b['workers']} workers; "
            "thread-seconds)\n"
        )
        names = ["S3 GET + verify", "write + journal", "fsync (file)"]
        rows = [[n, f"{prof.get(n, 0.0):.2f}", f"{prof.get(n, 0.0) / wall:.2f}"] for n in names]
        print(table(["phase", "thread-s", "per wall-s"], [*rows, ["wall", f"{wall:.2f}", "1"]]))
        print()
        ceilings = [[k, f"{v:.2f}", f"{gbps(size, v):.3f}"] for k, v in r["ceilings"].items()]
        print(table(["ceiling (same chunks)", "seconds", "GB/s"], ceilings))


if __name__ == "__main__":
    main()
