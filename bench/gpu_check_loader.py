"""Disk (page cache) -> GPU loading on a real GPU, and wsum64 computed on the GPU.

Run on a GPU machine from the repository root (about 2-4 minutes for the default 4 GiB):

    python bench/gpu_check_loader.py                       # 4 GiB in 8 shards to cuda:0
    python bench/gpu_check_loader.py --size-mib 512        # a shorter check
    python bench/gpu_check_loader.py --device cpu --size-mib 64   # dry run without a GPU

It checks, then measures (best of --repeats, same run):
- load_model(device=cuda) verified and unverified: every tensor on the GPU must have the
  manifest's wsum64, computed there by checksum_tensor (so the GPU path's bytes and the
  GPU checksum are both checked against the CPU-built manifest);
- the baseline: sha256 of every file (on --workers threads), then
  safetensors.torch.load_file(device=cuda); and load_file(device=cuda) alone;
- wsum64 over every loaded tensor on the GPU, in GB/s.
Figures go to stdout and, as JSON, to $OUT/gpu_check_loader.json when $OUT is set.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from bench_loader import make_safetensors_model, manifest_of, shard_paths, warm_page_cache
from benchlib import MiB, gbps, sha256_file, table
from weightship.loader.load import load_model
from weightship.weightformat.checksum import checksum_tensor
from weightship.weightformat.manifest import Manifest


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def best_of(repeats: int, device: torch.device, run: Callable[[], object]) -> float:
    times = []
    for _ in range(repeats):
        release(device)
        start = time.perf_counter()
        result = run()
        sync(device)
        times.append(time.perf_counter() - start)
        del result
    release(device)
    return min(times)


def baseline(
    paths: list[Path], manifest: Manifest, device: torch.device, workers: int, verify: bool
) -> dict[str, torch.Tensor]:
    if verify:
        want = {f.path: f.sha256 for f in manifest.files}
        with ThreadPoolExecutor(workers) as pool:
            got = list(pool.map(sha256_file, paths))
        if [want[p.name] for p in paths] != got:
            raise RuntimeError("a file does not match the manifest")
    out: dict[str, torch.Tensor] = {}
    for p in paths:
        out.update(load_file(str(p), device=str(device)))
    return out


def check_on_device(loaded: dict[str, torch.Tensor], manifest: Manifest) -> tuple[int, float]:
    """(mismatches, GB/s) of wsum64 computed where the tensors are, against the manifest."""
    want = {t.name: t.checksum for t in manifest.tensors}
    if set(want) != set(loaded):
        raise RuntimeError("loaded tensors differ from the manifest's list")
    total = sum(t.numel() * t.element_size() for t in loaded.values())
    start = time.perf_counter()
    got = {name: checksum_tensor(t) for name, t in loaded.items()}
    seconds = time.perf_counter() - start
    return sum(got[n] != want[n] for n in want), gbps(total, seconds)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--size-mib", type=int, default=4096)
    p.add_argument("--shards", type=int, default=8)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 4))
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("CUDA is not available (use --device cpu for a dry run)")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"

    started = time.perf_counter()
    model = make_safetensors_model(args.size_mib * MiB, args.shards)
    manifest = manifest_of(model)
    paths = shard_paths(model, manifest)
    warm_page_cache(paths)
    size = manifest.total_size
    print(f"model ready in {time.perf_counter() - started:.1f}s: {size / MiB:.0f} MiB, {name}")
    torch.zeros(1, device=device)  # the CUDA context is not part of any timing

    loaded = load_model(model, manifest, device=device, workers=args.workers)
    placed = all(t.device == device for t in loaded.tensors.values())
    mismatches, checksum_gbps = check_on_device(loaded.tensors, manifest)
    del loaded
    print(f"verified load: tensors on {device}: {placed}; wsum64 mismatches: {mismatches}")

    def ours(verify: bool) -> Callable[[], object]:
        return lambda: load_model(
            model, manifest, device=device, verify=verify, workers=args.workers
        )

    def theirs(verify: bool) -> Callable[[], object]:
        return lambda: baseline(paths, manifest, device, args.workers, verify)

    seconds = {
        "ours verified": best_of(args.repeats, device, ours(True)),
        "baseline verified (sha256 on workers, load_file)": best_of(
            args.repeats, device, theirs(True)
        ),
        "ours unverified": best_of(args.repeats, device, ours(False)),
        "baseline unverified (load_file)": best_of(args.repeats, device, theirs(False)),
    }
    rates = {k: gbps(size, s) for k, s in seconds.items()}
    names = list(rates)
    rows = [
        [names[0], f"{rates[names[0]]:.2f}", "1.00x"],
        [names[1], f"{rates[names[1]]:.2f}", f"{rates[names[0]] / rates[names[1]]:.2f}x"],
        [names[2], f"{rates[names[2]]:.2f}", "1.00x"],
        [names[3], f"{rates[names[3]]:.2f}", f"{rates[names[2]] / rates[names[3]]:.2f}x"],
    ]
    print(
        f"\ndisk (page cache) -> {device} ({name}), {size / MiB:.0f} MiB in {args.shards} "
        f"shards, workers={args.workers}, best of {args.repeats}, {os.cpu_count()} CPUs"
    )
    print(table(["path", "GB/s", "ours / this"], rows))
    print(f"wsum64 on {device} over every tensor: {checksum_gbps:.2f} GB/s")
    result: dict[str, Any] = {
        "device": name,
        "size_bytes": size,
        "workers": args.workers,
        "tensors_on_device": placed,
        "checksum_mismatches": mismatches,
        "checksum_gbps": checksum_gbps,
        "gbps": rates,
    }
    if out := os.environ.get("OUT"):
        Path(out, "gpu_check_loader.json").write_text(json.dumps(result, indent=2))
    if mismatches or not placed:
        sys.exit("FAILED: tensors not on the device, or checksums differ from the manifest")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
