"""Bucketed seeding broadcast against one raw broadcast of a flat buffer of the same size.

gloo over loopback, 1 root + 3 receivers (4 processes) by default. Both run in the same
process group, interleaved repeat by repeat so they share the machine's noise:

- raw:  one ``broadcast`` of a flat uint8 buffer holding every tensor's bytes, already
        packed on the root (the best case: no packing, one call);
- ours: ``weightship.seeding.stream``, one broadcast per 64 MiB bucket; receivers receive
        into their arena (the tensors' final memory);

- ours, packing: the same, from a root whose tensors are separate allocations (not a
        loader's per-file buffers), so every bucket is packed into two staging buffers
        while the previous one is on the wire.

"ours" is the usual root: it loaded with ``weightship.loader``, whose per-file buffers
already hold each bucket contiguously, so it broadcasts views of them with no copy.

Each timing runs from a barrier to a barrier (an allreduce), so it ends when every receiver
has every byte. Verification is not timed here (bench_time_to_loaded.py shows it).

    python bench/bench_broadcast.py [--quick] [--size-mib 512] [--receivers 3]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from datetime import timedelta
from multiprocessing.queues import Queue
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from benchlib import WORK, MiB, free_port, gbps, table
from weightship.loader.load import load_model
from weightship.seeding import transport
from weightship.seeding.buckets import BucketPlan, new_arena, pack_all, region_views, unpack
from weightship.seeding.specs import plan_for
from weightship.seeding.stream import receive_buckets, send_buckets
from weightship.weightformat.build import LocalFolder, build_manifest
from weightship.weightformat.manifest import Manifest

HOST = "127.0.0.1"
MODES = ("raw", "ours", "ours, packing")
TIMEOUT_S = 300.0


def make_tensor_model(total_bytes: int, files: int = 2) -> tuple[Path, Manifest]:
    """A safetensors model of bf16 matrices and fp32 norms (``total_bytes`` roughly), with
    its manifest; made once under WSBENCH_DIR."""
    folder = WORK / f"seed-model-{total_bytes}"
    cached = WORK / f"seed-model-{total_bytes}.manifest.json"
    if cached.exists():
        return folder, Manifest.parse(cached.read_bytes())
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(total_bytes)
    layer_bytes = 24 * MiB
    layers = max(files, total_bytes // layer_bytes)
    row = 1024 * 2  # a bf16 row of 1024
    per_file = -(-layers // files)
    for f in range(files):
        tensors = {}
        for i in range(f * per_file, min(layers, (f + 1) * per_file)):
            for name, share in (("w1", 0.45), ("w2", 0.45), ("w3", 0.1)):
                rows = max(1, int(layer_bytes * share) // row)
                tensors[f"layers.{i}.{name}"] = torch.randn(rows, 1024, generator=g).bfloat16()
            tensors[f"layers.{i}.norm"] = torch.randn(1024, generator=g)
        save_file(tensors, str(folder / f"model-{f + 1:05d}-of-{files:05d}.safetensors"))
    manifest = build_manifest(LocalFolder(folder), chunk_size=16 * MiB, workers=2)
    tmp = cached.with_suffix(".tmp")
    tmp.write_bytes(manifest.canonical_bytes())
    tmp.replace(cached)
    return folder, manifest


def _allreduce_barrier(pg: Any) -> None:
    """Every rank has arrived (a broadcast would let the root run ahead)."""
    from torch._C._distributed_c10d import AllreduceOptions

    pg.allreduce([torch.zeros(1)], AllreduceOptions()).wait(timedelta(seconds=TIMEOUT_S))


def _worker(
    rank: int, world: int, port: int, folder: str, manifest_doc: bytes, bucket_bytes: int,
    repeat: int, out: Queue[dict[str, Any]],
) -> None:  # fmt: skip
    torch.set_num_threads(1)
    store = transport.TCPStore(
        HOST, port, is_master=rank == 0, wait_for_workers=False, timeout=timedelta(seconds=60)
    )
    cpu = torch.device("cpu")
    pg = transport.new_group(
        "gloo", store, rank, world, bind_address=HOST, timeout_s=TIMEOUT_S, device=cpu
    )
    manifest = Manifest.parse(manifest_doc)
    plan = plan_for(manifest, bucket_bytes)
    sources: dict[int, torch.Tensor] = {}
    if rank == 0:
        tensors = load_model(Path(folder), manifest, verify=False).tensors
        sources = region_views(plan, tensors)
        assert len(sources) == len(plan.regions)  # the loader's buffers are the files
        separate = {name: t.clone() for name, t in tensors.items()}
        assert not region_views(plan, separate)
        flat = pack_all(plan, tensors)
    else:
        tensors, separate, flat = {}, {}, new_arena(plan)
    arena = new_arena(plan)
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(repeat):
        for mode in MODES:
            _allreduce_barrier(pg)
            t0 = time.perf_counter()
            if mode == "raw":
                transport.wait(transport.start_broadcast(pg, flat), TIMEOUT_S)
            elif rank == 0 and mode == "ours":
                send_buckets(pg, plan, tensors, device=cpu, timeout_s=TIMEOUT_S, sources=sources)
            elif rank == 0:
                send_buckets(pg, plan, separate, device=cpu, timeout_s=TIMEOUT_S)
            else:
                receive_buckets(pg, plan, arena, lambda: TIMEOUT_S)
            _allreduce_barrier(pg)
            times[mode].append(time.perf_counter() - t0)
    correct = rank == 0 or _same_tensors(plan, arena, flat)
    out.put({"rank": rank, "times": times, "correct": correct})
    transport.close_group(pg)


def _same_tensors(plan: BucketPlan, got: torch.Tensor, want: torch.Tensor) -> bool:
    a, b = unpack(plan, got), unpack(plan, want)
    return all(torch.equal(a[k], b[k]) for k in a)


def run(size_bytes: int, receivers: int, bucket_bytes: int, repeat: int) -> dict[str, Any]:
    folder, manifest = make_tensor_model(size_bytes)
    plan = plan_for(manifest, bucket_bytes)
    ctx = mp.get_context("spawn")
    out: Queue[dict[str, Any]] = ctx.Queue()
    world, port = receivers + 1, free_port()
    doc = manifest.canonical_bytes()
    procs = [
        ctx.Process(
            target=_worker, args=(r, world, port, str(folder), doc, bucket_bytes, repeat, out)
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results = [out.get(timeout=TIMEOUT_S * 2) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    by_rank = {r["rank"]: r for r in results}
    times = by_rank[0]["times"]
    raw = times["raw"]
    return {
        "size_bytes": plan.total_bytes,
        "receivers": receivers,
        "bucket_bytes": bucket_bytes,
        "buckets": len(plan.buckets),
        "times": times,
        "ratio_best": {m: min(raw) / min(times[m]) for m in MODES[1:]},
        "ratio_median": {
            m: statistics.median(raw) / statistics.median(times[m]) for m in MODES[1:]
        },
        # Runs are interleaved, so each repeat compares like with like on a noisy machine.
        "ratio_paired": {
            m: statistics.median(a / b for a, b in zip(raw, times[m], strict=True))
            for m in MODES[1:]
        },
        "correct": all(r["correct"] for r in results),
    }


def report(r: dict[str, Any]) -> str:
    size, k = r["size_bytes"], r["receivers"]
    rows = [
        [
            name,
            f"{min(ts):.3f}",
            f"{statistics.median(ts):.3f}",
            f"{gbps(size, min(ts)):.2f}",
            f"{gbps(size * k, min(ts)):.2f}",
        ]
        for name, ts in r["times"].items()
    ]
    head = (
        f"{size / MiB:.0f} MiB to {k} receivers over gloo/loopback, "
        f"{r['buckets']} buckets of {r['bucket_bytes'] / MiB:.0f} MiB, "
        f"{len(r['times']['raw'])} repeats"
    )
    body = table(["", "best s", "median s", "GB/s per receiver", "GB/s delivered"], rows)
    tail = "\n".join(
        f"{m} vs raw: {r['ratio_best'][m]:.2f}x (best), {r['ratio_median'][m]:.2f}x (median), "
        f"{r['ratio_paired'][m]:.2f}x (median of per-repeat ratios)"
        for m in MODES[1:]
    )
    tail += f"\ntarget >= 0.9x; receivers' tensors identical to the root's: {r['correct']}"
    return f"{head}\n{body}\n{tail}"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="96 MiB, 16 MiB buckets, 2 repeats")
    ap.add_argument("--size-mib", type=int, default=512)
    ap.add_argument("--bucket-mib", type=int, default=64)
    ap.add_argument("--receivers", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args(argv)
    if args.quick:
        args.size_mib, args.bucket_mib, args.repeat = 96, 16, 2
    r = run(args.size_mib * MiB, args.receivers, args.bucket_mib * MiB, args.repeat)
    print(report(r))
    if args.json:
        args.json.write_text(json.dumps(r, indent=2))
    return r


if __name__ == "__main__":
    main(sys.argv[1:])
