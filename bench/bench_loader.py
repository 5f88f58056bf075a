"""Verified loading: weightship.loader.load_model against safetensors, in the same run.

The model is N safetensors shards of bf16 tensors shaped like a transformer's, in the
page cache (read once before timing). Each path is timed ``--repeats`` times, each time
in a fresh process, as a pod loads once: in one long process, repeats would reuse memory
that malloc kept from the run before and skip the page faults a real load pays (that
favours the many small allocations of the baseline). Runs of the paths are interleaved
and the median counts, printed with the spread of the repeats (issue 21: a figure must
be what a newcomer gets, not the luckiest run).

- ours, verified (P4 of issue 15): load_model(verify=True) with a version 2 manifest:
  each file mapped privately, its chunks' pages made the process's own copies in the
  kernel (MADV_POPULATE_WRITE) in parallel, every byte hashed with BLAKE3 piece by piece
  as it lands, tensors materialized (views into that private memory).
- ours, verified with a version 1 manifest: the same with sha256 chunks (old manifests).
- baseline, verified: sha256 of each file, then safetensors.torch.load_file and a clone
  of every tensor. load_file maps the file lazily, so without the clone it touches no
  data at all; the clone is what makes the bytes real, as a load to a device would.
- the same baseline with the files hashed on 2 threads, a stronger baseline.
- unverified, beside them: load_model(verify=False) and load_file + clone.

It ends with the P4 line: ours verified / baseline verified (target >= 2.5x), with the
unverified figure beside it and the CPU bound (read floor + hash cost per core).

    .venv/bin/python bench/bench_loader.py            # 1 GiB in 4 shards
    .venv/bin/python bench/bench_loader.py --quick    # 128 MiB in 2 shards
    .venv/bin/python bench/bench_loader.py --sweep    # + load_model workers x hash threads
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import blake3
import torch
from safetensors.torch import load_file, save_file

import weightship.loader.load
from benchlib import WORK, MiB, gbps, median_of, sha256_file, table, verify_files
from weightship.loader.load import READ_PIECE, load_model
from weightship.weightformat.build import LocalFolder, build_manifest
from weightship.weightformat.checksum import checksum_bytes
from weightship.weightformat.manifest import Manifest

HIDDEN = 2048
# One layer's matrices as (rows, name): attention q, k, v, o and the MLP's three.
LAYER = [(HIDDEN, n) for n in ("q", "k", "v", "o")] + [(5504, n) for n in ("gate", "up", "down")]
ROW_BYTES = HIDDEN * 2  # bf16


def make_safetensors_model(total_bytes: int, shards: int) -> Path:
    """``shards`` files of random bf16 tensors totalling about ``total_bytes``, made once."""
    folder = WORK / f"st-model-{total_bytes}-{shards}"
    done = WORK / f"st-model-{total_bytes}-{shards}.complete"
    if done.exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(total_bytes)
    layer = 0
    for shard in range(1, shards + 1):
        budget, tensors = total_bytes // shards, {}
        while budget >= ROW_BYTES:
            prefix = f"model.layers.{layer}"
            tensors[f"{prefix}.input_norm.weight"] = _random_bf16((HIDDEN,), gen)
            budget -= ROW_BYTES
            for rows, name in LAYER:
                rows = min(rows, budget // ROW_BYTES)
                if rows:
                    tensors[f"{prefix}.{name}.weight"] = _random_bf16((rows, HIDDEN), gen)
                    budget -= rows * ROW_BYTES
            layer += 1
        save_file(tensors, str(folder / f"model-{shard:05d}-of-{shards:05d}.safetensors"))
    done.touch()
    return folder


def _random_bf16(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    # Random 16-bit patterns: realistic for hashing and copying (values are irrelevant).
    bits = torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=gen)
    return bits.view(torch.bfloat16)


def manifest_of(model: Path, version: Literal[1, 2] = 2) -> Manifest:
    """The model's manifest: version 2 (BLAKE3 chunks) or 1 (sha256 chunks), made once."""
    cached = model.with_suffix(f".manifest-v{version}.json")
    if cached.exists():
        return Manifest.parse(cached.read_bytes())
    manifest = build_manifest(LocalFolder(model), workers=2, version=version)
    cached.write_bytes(manifest.canonical_bytes())
    return manifest


def shard_paths(model: Path, manifest: Manifest) -> list[Path]:
    return [model / f.path for f in manifest.files]


def warm_page_cache(paths: list[Path]) -> None:
    for p in paths:
        with open(p, "rb") as f:
            while f.read(64 * MiB):
                pass


def load_and_clone(paths: list[Path]) -> dict[str, torch.Tensor]:
    out = {}
    for p in paths:
        out.update({k: v.clone() for k, v in load_file(str(p)).items()})
    return out


def baseline_verified(paths: list[Path], manifest: Manifest) -> dict[str, torch.Tensor]:
    want = {f.path: f.sha256 for f in manifest.files}
    for p in paths:
        if sha256_file(p) != want[p.name]:
            raise RuntimeError(f"{p} does not match the manifest")
    return load_and_clone(paths)


def baseline_verified_2threads(
    model: Path, paths: list[Path], manifest: Manifest
) -> dict[str, torch.Tensor]:
    if bad := verify_files(model, manifest, threads=2):
        raise RuntimeError(f"{bad} do not match the manifest")
    return load_and_clone(paths)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bits (random bf16 holds NaNs, which never compare equal)."""
    same_type = a.dtype == b.dtype and a.shape == b.shape
    return same_type and torch.equal(
        a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)
    )


def measure_once(run: Callable[[], object]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of one run."""
    wall, cpu = time.perf_counter(), time.process_time()
    run()
    return time.perf_counter() - wall, time.process_time() - cpu


OURS = "ours verified"
OURS_V1 = "ours verified, sha256 chunks (v1 manifest)"
OURS_UNVERIFIED = "ours unverified"
# load_model (workers, hash_threads, read piece KiB) tried by --sweep: threads per chunk
# against blake3's own threads inside one chunk, and both; then the read piece's size.
SWEEP = [(1, 1, 512), (2, 1, 512), (4, 1, 512), (1, 2, 512), (2, 2, 512), (4, 2, 512)]
SWEEP += [(4, 1, kib) for kib in (128, 256, 1024, 2048, 16384)]


def sweep_name(workers: int, hash_threads: int, piece_kib: int) -> str:
    return f"ours verified, workers={workers} hash_threads={hash_threads} piece={piece_kib}K"


def load_with_piece(piece_kib: int, *args: Any, **kwargs: Any) -> object:
    """load_model reading (and hashing) ``piece_kib`` KiB at a time; only in a child."""
    weightship.loader.load.READ_PIECE = piece_kib * 1024
    return load_model(*args, **kwargs)


def path_runners(args: argparse.Namespace) -> dict[str, Callable[[], object]]:
    model = make_safetensors_model(args.size_mib * MiB, args.shards)
    manifest = manifest_of(model)
    v1 = manifest_of(model, version=1)
    paths = shard_paths(model, manifest)
    threads = args.hash_threads
    runners: dict[str, Callable[[], object]] = {
        OURS: lambda: load_model(model, manifest, workers=args.workers, hash_threads=threads),
        OURS_V1: lambda: load_model(model, v1, workers=args.workers),
        "baseline verified": lambda: baseline_verified(paths, manifest),
        "baseline verified, 2 hash threads": lambda: baseline_verified_2threads(
            model, paths, manifest
        ),
        OURS_UNVERIFIED: lambda: load_model(model, manifest, verify=False, workers=args.workers),
        "baseline unverified": lambda: load_and_clone(paths),
    }
    for workers, hash_threads, kib in SWEEP:
        runners[sweep_name(workers, hash_threads, kib)] = functools.partial(
            load_with_piece, kib, model, manifest, workers=workers, hash_threads=hash_threads
        )
    return runners


def median_run(runs: list[tuple[float, float]]) -> tuple[float, float]:
    """The (wall, CPU) of the run with the median wall time."""
    return median_of(runs, lambda r: r[0])


def runs_in_fresh_processes(
    args: argparse.Namespace, names: list[str]
) -> dict[str, list[tuple[float, float]]]:
    """Per path, (wall, CPU) seconds of each of ``args.repeats`` child runs."""
    here = Path(__file__).resolve().parent
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(here.parent / "operator"), str(here), env.get("PYTHONPATH", "")]
    )
    common = [f"--size-mib={args.size_mib}", f"--shards={args.shards}"]
    common += [f"--workers={args.workers}", f"--hash-threads={args.hash_threads}"]
    runs: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
    for _ in range(args.repeats):
        for name in names:  # interleaved, so drift in the machine's load hits all paths
            cmd = [sys.executable, __file__, *common, "--one", name]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            wall, cpu = json.loads(out.stdout.strip().splitlines()[-1])
            runs[name].append((wall, cpu))
    return runs


def in_memory_hash_rates(path: Path) -> dict[str, float]:
    """GB/s of sha256, BLAKE3 and wsum64 (numpy) on one thread over bytes already in
    memory (best of 3), BLAKE3 with its own 2 threads, and BLAKE3 over one READ_PIECE
    piece again and again (in cache, as load_model hashes a piece it has just read)."""
    data = path.read_bytes()[: 256 * MiB]
    piece = memoryview(data)[:READ_PIECE]

    def hot_pieces() -> None:
        for _ in range(len(data) // READ_PIECE):
            blake3.blake3(piece).digest()

    hashes: dict[str, Callable[[], object]] = {
        "sha256": lambda: hashlib.sha256(data).hexdigest(),
        "blake3": lambda: blake3.blake3(data).hexdigest(),
        "blake3, 2 threads": lambda: blake3.blake3(data, max_threads=2).hexdigest(),
        "blake3, cache-hot piece": hot_pieces,
        "wsum64": lambda: checksum_bytes(data),
    }
    rates = {}
    for name, run in hashes.items():
        best = min(measure_once(run)[0] for _ in range(3))
        rates[name] = gbps(len(data), best)
    return rates


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--size-mib", type=int, default=1024)
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--workers", type=int, default=4, help="load_model threads")
    p.add_argument("--hash-threads", type=int, default=1, help="load_model blake3 threads")
    p.add_argument("--sweep", action="store_true", help="also time workers x hash threads")
    p.add_argument("--repeats", type=int, default=3, help="runs per path; the median counts")
    p.add_argument("--quick", action="store_true", help="128 MiB in 2 shards, 2 repeats")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--one", help=argparse.SUPPRESS)  # a child: time this path once
    args = p.parse_args(argv)
    if args.quick:
        args.size_mib, args.shards, args.repeats = 128, 2, 2
    if args.one:
        print(json.dumps(measure_once(path_runners(args)[args.one])))
        return {}

    model = make_safetensors_model(args.size_mib * MiB, args.shards)
    manifest = manifest_of(model)
    paths = shard_paths(model, manifest)
    size = manifest.total_size
    warm_page_cache(paths)

    # Correctness first: ours, verified (both manifest versions), gives exactly
    # safetensors' tensors.
    reference = load_and_clone(paths)
    same = True
    for m in (manifest, manifest_of(model, version=1)):
        ours = load_model(model, m, workers=args.workers, hash_threads=args.hash_threads)
        same = same and ours.verified and ours.digest == m.digest
        same = same and set(ours.tensors) == set(reference)
        same = same and all(same_bytes(ours.tensors[k], v) for k, v in reference.items())
        del ours
    tensor_count = len(reference)
    del reference

    table_paths = [OURS, OURS_V1, "baseline verified", "baseline verified, 2 hash threads"]
    table_paths += [OURS_UNVERIFIED, "baseline unverified"]
    swept = [sweep_name(*config) for config in SWEEP] if args.sweep else []
    load_before = os.getloadavg()
    runs = runs_in_fresh_processes(args, table_paths + swept)
    measured = {n: median_run(r) for n, r in runs.items()}
    spread = {
        n: (gbps(size, max(w for w, _ in r)), gbps(size, min(w for w, _ in r)))
        for n, r in runs.items()
    }
    seconds = {k: wall for k, (wall, _) in measured.items()}
    cpu_per_gb = {k: cpu / (size / 1e9) for k, (_, cpu) in measured.items()}
    rates = {k: gbps(size, s) for k, s in seconds.items()}
    result: dict[str, Any] = {
        "size_bytes": size,
        "shards": args.shards,
        "tensors": tensor_count,
        "workers": args.workers,
        "repeats": args.repeats,
        "cpus": os.cpu_count(),
        "correct": same,
        "seconds": seconds,
        "cpu_seconds_per_gb": cpu_per_gb,
        "gbps": rates,
        "hash_threads": args.hash_threads,
        "ratio_verified": rates[OURS] / rates["baseline verified"],
        "ratio_verified_2threads": rates[OURS] / rates["baseline verified, 2 hash threads"],
        "ratio_verified_sha256_chunks": rates[OURS_V1] / rates["baseline verified"],
        "ratio_unverified": rates[OURS_UNVERIFIED] / rates["baseline unverified"],
        "verified_over_unverified": rates[OURS] / rates[OURS_UNVERIFIED],
        "ratio_verified_over_plain": rates[OURS] / rates["baseline unverified"],
        "hash_gbps_in_memory": in_memory_hash_rates(paths[0]),
        "gbps_spread": spread,
        "loadavg": os.getloadavg(),
        "loadavg_before": load_before,
    }

    def row(name: str, ours: str) -> list[str]:
        return [
            name,
            f"{rates[name]:.2f}",
            f"{rates[ours] / rates[name]:.2f}x",
            f"{cpu_per_gb[name]:.2f}",
        ]

    rows = [row(name, OURS) for name in table_paths[:4]]
    rows += [row(name, OURS_UNVERIFIED) for name in table_paths[4:6]]
    print(
        f"\n{size / MiB:.0f} MiB in {args.shards} shards, {tensor_count} bf16 tensors, page "
        f"cache warm; load_model workers={args.workers}; median of {args.repeats} fresh "
        f"processes; {os.cpu_count()} CPUs; load average {load_before[0]:.2f} before, "
        f"{result['loadavg'][0]:.2f} after"
    )
    print(table(["path", "GB/s", "ours / this (GB/s)", "CPU s per GB"], rows))
    print(
        f"spread, GB/s slowest-fastest of {args.repeats}: "
        + "; ".join(f"{n} {spread[n][0]:.2f}-{spread[n][1]:.2f}" for n in table_paths)
    )
    if swept:
        print(
            table(
                ["load_model, verified (blake3)", "GB/s", "CPU s per GB"],
                [
                    [
                        name.removeprefix("ours verified, "),
                        f"{rates[name]:.2f}",
                        f"{cpu_per_gb[name]:.2f}",
                    ]
                    for name in swept
                ],
            )
        )
    hashes = result["hash_gbps_in_memory"]
    print(
        f"in memory, one thread: sha256 {hashes['sha256']:.2f} GB/s, "
        f"blake3 {hashes['blake3']:.2f} GB/s (2 threads {hashes['blake3, 2 threads']:.2f}, "
        f"a cache-hot {READ_PIECE // 1024} KiB piece {hashes['blake3, cache-hot piece']:.2f}), "
        f"wsum64 (numpy) {hashes['wsum64']:.2f} GB/s"
    )
    # Where verified time goes: the unverified load's CPU (read from the page cache into
    # fresh memory, its page faults, the tensors) plus hashing every byte once at the
    # cache-hot BLAKE3 rate; on os.cpu_count() cores that is the wall-clock bound.
    floor = cpu_per_gb[OURS_UNVERIFIED]
    hash_cost = 1 / hashes["blake3, cache-hot piece"]
    cores = os.cpu_count() or 1
    result["bound_cpu_s_per_gb"] = floor + hash_cost
    result["bound_gbps"] = cores / (floor + hash_cost)
    print(
        f"bound: read {floor:.2f} + blake3 {hash_cost:.2f} = {floor + hash_cost:.2f} CPU s "
        f"per GB -> {result['bound_gbps']:.2f} GB/s on {cores} cores; ours verified used "
        f"{cpu_per_gb[OURS]:.2f} CPU s per GB at {rates[OURS]:.2f} GB/s"
    )
    print(f"tensors identical to safetensors': {same}")
    print(
        f"P4 verified load (blake3 chunks, every byte hashed, tensors materialized) / naive "
        f"verified (sha256 of the file, then load_file + clone): {result['ratio_verified']:.2f}x "
        f"(target >= 2.5x; {rates[OURS]:.2f} vs {rates['baseline verified']:.2f} GB/s); "
        f"unverified: ours {rates[OURS_UNVERIFIED]:.2f} GB/s, verified/unverified "
        f"{result['verified_over_unverified']:.2f}; verified / plain load_file + clone "
        f"{result['ratio_verified_over_plain']:.2f}x (target >= 1.0x)"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
