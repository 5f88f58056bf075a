"""GPU check for seeding, one prepared script: prints figures, asserts correctness only.

    python bench/gpu_check_nccl.py                 # on a machine with an NVIDIA GPU
    python bench/gpu_check_nccl.py --cpu --quick   # the same code paths on CPU with gloo

1. checksum: ``checksum_tensor`` on the device against ``checksum_bytes`` (numpy) on the
   same bytes: equal, and GB/s of each.
2. pack: ``pack_bucket`` throughput on the device (what the root does per bucket).
3. seeding: a root process holding the model on the device, k receiver processes calling
   ``receive(device=...)`` with NCCL, then one raw NCCL broadcast of a flat buffer of the
   same size for the ratio. NCCL refuses two ranks on one GPU ("Duplicate GPU detected"),
   so with fewer GPUs than ranks this step says so and runs with gloo over CUDA tensors
   instead (staged through host memory: a correctness check, not a speed figure).

Every child process is bounded (--timeout); the script never waits longer.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import tempfile
import time
from datetime import timedelta
from multiprocessing.queues import Queue
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from weightship.core.seedtoken import mint
from weightship.loader.load import load_model
from weightship.seeding import SeedRoot, receive, serve, transport
from weightship.seeding.buckets import TensorSpec, pack_bucket, plan_buckets
from weightship.weightformat.build import LocalFolder, build_manifest
from weightship.weightformat.checksum import checksum_bytes, checksum_tensor
from weightship.weightformat.manifest import Manifest

MiB = 1 << 20
HOST = "127.0.0.1"
SEED_KEY = bytes(32)  # the rollout seeding key a root checks join tokens with


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Any, device: torch.device, repeat: int = 3) -> float:
    """Best of ``repeat`` runs, after one warm-up run."""
    fn()
    sync(device)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def check_checksum(device: torch.device, size: int) -> None:
    t = torch.randint(-(2**31), 2**31 - 1, (size // 4,), dtype=torch.int32, device=device)
    t = t.view(torch.bfloat16)
    host = t.cpu().view(torch.uint8).numpy()
    on_device, on_cpu = checksum_tensor(t), checksum_bytes(host)
    assert on_device == on_cpu, (on_device, on_cpu)
    s_dev = timed(lambda: checksum_tensor(t), device)
    s_cpu = timed(lambda: checksum_bytes(host), torch.device("cpu"), repeat=1)
    print(
        f"checksum of {size / MiB:.0f} MiB: {device} {size / s_dev / 1e9:.1f} GB/s, "
        f"numpy {size / s_cpu / 1e9:.2f} GB/s, equal: True"
    )


def check_pack(device: torch.device, size: int, bucket: int) -> None:
    n = 64
    tensors = {f"t{i}": torch.randn(size // n // 2, device=device).bfloat16() for i in range(n)}
    plan = plan_buckets([TensorSpec.of(k, v) for k, v in tensors.items()], bucket)
    out = torch.empty(bucket, dtype=torch.uint8, device=device)

    def pack_all() -> None:
        for i in range(len(plan.buckets)):
            pack_bucket(plan, i, tensors, out)

    s = timed(pack_all, device)
    print(
        f"pack {plan.payload_bytes / MiB:.0f} MiB in {len(plan.buckets)} buckets on {device}: "
        f"{plan.payload_bytes / s / 1e9:.1f} GB/s"
    )


def make_model(folder: Path, size: int) -> Manifest:
    g = torch.Generator().manual_seed(0)
    per_file = size // 4
    for f in range(4):
        tensors = {
            f"f{f}.w{i}": torch.randn(per_file // 8 // 2048, 1024, generator=g).bfloat16()
            for i in range(8)
        }
        tensors[f"f{f}.norm"] = torch.randn(1024, generator=g)
        save_file(tensors, str(folder / f"model-{f:05d}.safetensors"))
    return build_manifest(LocalFolder(folder), chunk_size=16 * MiB, workers=4)


def device_of(base: str, index: int) -> torch.device:
    if base == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", index % torch.cuda.device_count())


def _root(folder: str, doc: bytes, base: str, backend: str, out: Queue[Any]) -> None:
    manifest = Manifest.parse(doc)
    tensors = load_model(Path(folder), manifest, device=device_of(base, 0), verify=False).tensors
    root = SeedRoot(
        tensors,
        manifest,
        host=HOST,
        name="root",
        backend=backend,
        join_window_s=60,
        key=SEED_KEY,
        rollout_uid="bench",
    )
    out.put(f"http://{HOST}:{serve(root, HOST).server_address[1]}")
    time.sleep(3600)  # terminated by the parent


def _receiver(url: str, doc: bytes, k: int, i: int, base: str, out: Queue[Any]) -> None:
    manifest = Manifest.parse(doc)
    try:
        got = receive(
            url,
            "gpu",
            k + 1,
            manifest,
            member=f"r{i}",
            device=device_of(base, i + 1),
            timeout_s=120,
            token=mint(SEED_KEY, "bench", manifest.digest, "gpu", time.time()),
        )
        out.put(("ok", i, got.seconds, got.transfer_seconds, got.verify_seconds))
    except Exception as exc:  # reported, not raised: the parent prints every outcome
        out.put(("error", i, f"{type(exc).__name__}: {exc}"[:400]))


def _raw(
    rank: int, world: int, port: int, nbytes: int, base: str, backend: str, out: Queue[Any]
) -> None:
    device = device_of(base, rank)
    store = transport.TCPStore(
        HOST, port, is_master=rank == 0, wait_for_workers=False, timeout=timedelta(seconds=60)
    )
    try:
        pg = transport.new_group(
            backend, store, rank, world, bind_address=HOST, timeout_s=60, device=device
        )
        flat = torch.ones(nbytes, dtype=torch.uint8, device=device) * (rank == 0)
        transport.wait(transport.start_broadcast(pg, flat[:MiB]), 60)  # warm-up: connect
        sync(device)
        t0 = time.perf_counter()
        transport.wait(transport.start_broadcast(pg, flat), 60)
        sync(device)
        seconds = time.perf_counter() - t0
        ok = bool(flat.min().item() == 1)
        out.put(("ok", rank, seconds, ok))
    except Exception as exc:
        out.put(("error", rank, f"{type(exc).__name__}: {exc}"[:400]))


def collect(procs: list[Any], out: Queue[Any], timeout: float) -> list[Any]:
    results = []
    deadline = time.monotonic() + timeout
    try:
        for _ in procs:
            results.append(out.get(timeout=max(1.0, deadline - time.monotonic())))
    except Exception:
        results.append(("error", -1, f"timed out after {timeout:.0f}s"))
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
    return results


def check_seeding(base: str, k: int, size: int, timeout: float) -> None:
    ctx = mp.get_context("spawn")
    ranks = k + 1
    if base == "cpu":
        backend = "gloo"
    elif torch.cuda.device_count() >= ranks:
        backend = "nccl"
    else:
        backend = "gloo"
        print(
            f"{torch.cuda.device_count()} GPU(s) for {ranks} ranks: NCCL allows one rank per "
            "GPU, so seeding runs with gloo over CUDA tensors (correctness, not speed)"
        )
    with tempfile.TemporaryDirectory() as tmp:
        manifest = make_model(Path(tmp), size)
        doc = manifest.canonical_bytes()
        out: Queue[Any] = ctx.Queue()
        root = ctx.Process(target=_root, args=(tmp, doc, base, backend, out))
        root.start()
        try:
            url = out.get(timeout=timeout)
            procs = [
                ctx.Process(target=_receiver, args=(url, doc, k, i, base, out)) for i in range(k)
            ]
            for p in procs:
                p.start()
            results = collect(procs, out, timeout)
        finally:
            root.kill()
    print(f"seeding {manifest.total_size / MiB:.0f} MiB to {k} receivers with {backend}:")
    for r in results:
        if r[0] == "ok":
            _, i, s, transfer, verify = r
            print(
                f"  r{i}: verified in {s:.2f}s (transfer {transfer:.2f}s, "
                f"{manifest.total_size / transfer / 1e9:.1f} GB/s; checksums {verify:.2f}s)"
            )
        else:
            print(f"  FAILED {r}")

    port = transport_port()
    procs = [
        ctx.Process(target=_raw, args=(r, ranks, port, manifest.total_size, base, backend, out))
        for r in range(ranks)
    ]
    for p in procs:
        p.start()
    raw = collect(procs, out, timeout)
    for r in sorted(raw, key=lambda x: x[1]):
        if r[0] == "ok":
            print(
                f"  raw flat {backend} broadcast, rank {r[1]}: {r[2]:.3f}s "
                f"({manifest.total_size / r[2] / 1e9:.1f} GB/s), bytes right: {r[3]}"
            )
        else:
            print(f"  raw FAILED {r}")


def transport_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", action="store_true", help="run every step on CPU with gloo")
    ap.add_argument("--quick", action="store_true", help="64 MiB instead of 1 GiB")
    ap.add_argument("--receivers", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=240, help="bound on each step's children")
    args = ap.parse_args(argv)
    size = (64 if args.quick else 1024) * MiB
    if not args.cpu and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --cpu to exercise the same code on CPU")
    base = "cpu" if args.cpu else "cuda"
    device = device_of(base, 0)
    name = torch.cuda.get_device_name(device) if base == "cuda" else "cpu"
    nccl = torch.cuda.nccl.version() if base == "cuda" else "-"
    print(
        f"torch {torch.__version__}, device {name}, NCCL {nccl}, "
        f"{torch.cuda.device_count() if base == 'cuda' else 0} GPU(s)"
    )
    check_checksum(device, size)
    check_pack(device, size, 64 * MiB if not args.quick else 8 * MiB)
    check_seeding(base, args.receivers, size, args.timeout)


if __name__ == "__main__":
    main(sys.argv[1:])
