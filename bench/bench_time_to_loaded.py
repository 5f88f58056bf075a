"""Time until k new replicas hold verified weights: broadcast seeding against each replica
loading from its node cache, and against each staging from S3 and then loading.

All k replicas are processes started together (after their imports, on a barrier); the
figure is from that start to the last replica done. The modes:

- broadcast: a root process already holds the loaded model (``SeedRoot`` on its HTTP
  server); each replica calls ``receive()`` (join, rendezvous, transfer, wsum64 check of
  every tensor).
- node cache: each replica runs ``load_model(verify=True)`` over the model's files on local
  disk (page cache warm), checking every chunk's sha256.
- S3: each replica runs ``stage()`` from a local versitygw into its own empty node cache
  (sha256 checked as bytes stream in), then ``load_model(verify=False)``: the bytes were
  just checked.

On this 2-core machine the k replicas (and the root) share two cores and one loopback,
where real replicas would each have their own node: read the ratios, not the absolutes.

    python bench/bench_time_to_loaded.py [--quick] [--size-mib 256] [--k 2 3] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import shutil
import sys
import time
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from bench_broadcast import HOST, make_tensor_model
from benchlib import WORK, MiB, gbps, local_origin, model_location, settings, table
from weightship.core.seedtoken import mint
from weightship.data.chunkstore import ChunkStore
from weightship.data.metrics import DataPlaneMetrics
from weightship.data.s3 import S3Origin, make_client
from weightship.data.stage import stage
from weightship.loader.load import load_model
from weightship.seeding import SeedRoot, receive, serve
from weightship.weightformat.manifest import Manifest

MODES = ("broadcast", "node cache", "S3")
OUT = WORK / "ttl-out"
SEED_KEY = bytes(32)  # the rollout seeding key a root checks join tokens with


def _replica(
    mode: str, index: int, target: str, folder: str, manifest_doc: bytes, world: int,
    group: str, start: Barrier, out: Queue[dict[str, Any]],
) -> None:  # fmt: skip
    """One new replica: wait for the others, then get verified tensors the ``mode`` way."""
    import torch

    torch.set_num_threads(1)
    manifest = Manifest.parse(manifest_doc)
    start.wait()
    t0 = time.time()
    if mode == "broadcast":
        token = mint(SEED_KEY, "bench", manifest.digest, group, time.time())
        got = receive(
            target, group, world, manifest, member=f"r{index}", timeout_s=600, token=token
        )
        tensors, extra = (
            got.tensors,
            {
                "transfer_s": got.transfer_seconds,
                "verify_s": got.verify_seconds,
            },
        )
    elif mode == "node cache":
        tensors, extra = load_model(Path(folder), manifest, verify=True).tensors, {}
    else:
        cache = ChunkStore(OUT / f"r{index}")
        origin = S3Origin(make_client(settings(target)), model_location(Path(folder)))
        metrics = DataPlaneMetrics.create(CollectorRegistry())
        stage(manifest, cache, origin, [], node=f"r{index}", metrics=metrics, workers=4)
        files = cache.files_dir(manifest.digest)
        tensors, extra = load_model(files, manifest, verify=False).tensors, {}
    out.put(
        {
            "index": index,
            "start": t0,
            "end": time.time(),
            "tensors": len(tensors),
            "bytes": sum(t.nbytes for t in tensors.values()),
            **extra,
        }
    )


def _root(folder: str, manifest_doc: bytes, ready: Queue[str]) -> None:
    manifest = Manifest.parse(manifest_doc)
    loaded = load_model(Path(folder), manifest, verify=True)
    root = SeedRoot(
        loaded.tensors,
        manifest,
        host=HOST,
        name="root",
        join_window_s=60,
        key=SEED_KEY,
        rollout_uid="bench",
    )
    server = serve(root, HOST)
    ready.put(f"http://{HOST}:{server.server_address[1]}")
    time.sleep(3600)  # until the benchmark terminates it


def run_mode(
    mode: str, k: int, folder: Path, manifest: Manifest, target: str, repeat: int
) -> dict[str, Any]:
    """``repeat`` runs of k replicas; the median run is the figure."""
    runs = [_run_once(mode, k, folder, manifest, target, f"bench-{k}-{i}") for i in range(repeat)]
    runs.sort(key=lambda r: r["seconds"])
    median = runs[len(runs) // 2]
    return {**median, "all_seconds": [r["seconds"] for r in runs]}


def _run_once(
    mode: str, k: int, folder: Path, manifest: Manifest, target: str, group: str
) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    out: Queue[dict[str, Any]] = ctx.Queue()
    start = ctx.Barrier(k)
    shutil.rmtree(OUT, ignore_errors=True)
    procs = [
        ctx.Process(
            target=_replica,
            args=(
                mode,
                i,
                target,
                str(folder),
                manifest.canonical_bytes(),
                k + 1,
                group,
                start,
                out,
            ),
        )
        for i in range(k)
    ]
    for p in procs:
        p.start()
    replicas = sorted((out.get(timeout=900) for _ in procs), key=lambda r: r["index"])
    for p in procs:
        p.join(timeout=60)
    shutil.rmtree(OUT, ignore_errors=True)
    seconds = max(r["end"] for r in replicas) - min(r["start"] for r in replicas)
    return {"mode": mode, "k": k, "seconds": seconds, "replicas": replicas}


def run(size_bytes: int, ks: list[int], repeat: int) -> dict[str, Any]:
    folder, manifest = make_tensor_model(size_bytes)
    ctx = mp.get_context("spawn")
    results: list[dict[str, Any]] = []
    with local_origin(folder) as (endpoint, _client):
        for k in ks:
            ready: Queue[str] = ctx.Queue()
            root = ctx.Process(target=_root, args=(str(folder), manifest.canonical_bytes(), ready))
            root.start()
            try:
                url = ready.get(timeout=300)
                results.append(run_mode("broadcast", k, folder, manifest, url, repeat))
            finally:
                root.terminate()
                root.join(timeout=30)
            results.append(run_mode("node cache", k, folder, manifest, "", repeat))
            results.append(run_mode("S3", k, folder, manifest, endpoint, repeat))
    return {
        "size_bytes": manifest.total_size,
        "tensors": len(manifest.tensors),
        "repeat": repeat,
        "results": results,
    }


def report(r: dict[str, Any]) -> str:
    size = r["size_bytes"]
    rows = []
    for k in sorted({x["k"] for x in r["results"]}):
        by_mode = {x["mode"]: x for x in r["results"] if x["k"] == k}
        bcast = by_mode["broadcast"]["seconds"]
        for mode in MODES:
            s = by_mode[mode]["seconds"]
            rows.append(
                [
                    str(k),
                    mode,
                    f"{s:.2f}",
                    f"{gbps(size * k, s):.2f}",
                    f"{s / bcast:.2f}x" if mode != "broadcast" else "1.00x",
                ]
            )
    head = (
        f"{size / MiB:.0f} MiB model, {r['tensors']} tensors; k new replicas at once; "
        f"median of {r['repeat']} runs"
    )
    body = table(["k", "mode", "seconds", "GB/s delivered", "broadcast speedup"], rows)
    return f"{head}\n{body}"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="64 MiB, k = 2 only")
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--k", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args(argv)
    if args.quick:
        args.size_mib, args.k, args.repeat = 64, [2], 1
    r = run(args.size_mib * MiB, args.k, args.repeat)
    print(report(r))
    if args.json:
        args.json.write_text(json.dumps(r, indent=2))
    return r


if __name__ == "__main__":
    main(sys.argv[1:])
