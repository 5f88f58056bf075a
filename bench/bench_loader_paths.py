"""Ways to bring a cached model into process memory, verified or not, on the benchmark's
model (`bench_loader.py` makes it): what the loader's CPU path was chosen from.

Each path runs in a fresh process (a pod loads once), ``--repeats`` times, interleaved;
the median counts. Every path loads the 4 shards with 4 threads, 16 MiB chunks, each
chunk in 512 KiB pieces hashed with BLAKE3 as they land (``-v``) or not (``-u``):

- plain: safetensors ``load_file`` + a clone of every tensor (the P4 baseline);
- read: ``os.preadv`` into fresh anonymous memory (4 KiB pages); ``read-huge`` into memory
  advised ``MADV_HUGEPAGE``; ``read-populated``: ``MADV_POPULATE_WRITE`` on each chunk first;
- direct: ``O_DIRECT`` reads (the disk, not the page cache);
- private: a private (copy-on-write) mapping of the file, each piece populated with
  ``MADV_POPULATE_WRITE`` before it is hashed (the loader since 2026-12-05);
  ``private-chunk``: each chunk populated whole, then hashed; ``private-gil``: populated
  with Python's ``mmap.madvise``, which holds the GIL.

    .venv/bin/python bench/bench_loader_paths.py              # every path, 3 repeats (~2 min)
    .venv/bin/python bench/bench_loader_paths.py --paths plain,private-v --repeats 5
    .venv/bin/python bench/bench_loader_paths.py --first-touch   # huge against 4 KiB pages

``--first-touch``: GB/s of a ``memset`` over 1 GiB of fresh anonymous memory, advised
huge or not, twice in each of 3 fresh processes: on a VM whose free memory is reported
to the host (virtio_balloon free page reporting), a process's first huge pages are the
host's faults too.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import blake3
from safetensors.torch import load_file  # imported before any path is timed

from bench_loader import measure_once
from benchlib import WORK, MiB, gbps, table
from weightship.linux import populate_write

CHUNK = 16 * MiB
PIECE = 512 * 1024
WORKERS = 4
MADV_POPULATE_WRITE = 23


def shards(model: Path) -> list[Path]:
    return sorted(model.glob("*.safetensors"))


def plain(model: Path) -> object:
    out = {}
    for p in shards(model):
        out.update({k: v.clone() for k, v in load_file(str(p)).items()})
    return out


Fill = Callable[[int, mmap.mmap, int, int], None]


def load(model: Path, verify: bool, buffer: Callable[[int, int], mmap.mmap], fill: Fill) -> object:
    """Every chunk of every shard into its file's buffer by ``WORKERS`` threads, ``fill``
    bringing in each piece (fd, buffer, offset, length), then hashed if ``verify``."""
    jobs, kept = [], []
    for path in shards(model):
        size = path.stat().st_size
        fd = os.open(path, os.O_RDONLY)
        dest = buffer(fd, size)
        kept.append((fd, dest))
        jobs += [(fd, dest, off, min(CHUNK, size - off)) for off in range(0, size, CHUNK)]

    def work(job: tuple[int, mmap.mmap, int, int]) -> bytes | None:
        fd, dest, off, n = job
        hasher = blake3.blake3() if verify else None
        view = memoryview(dest)
        for at in range(off, off + n, PIECE):
            piece = min(PIECE, off + n - at)
            fill(fd, dest, at, piece)
            if hasher is not None:
                hasher.update(view[at : at + piece])
        return hasher.digest() if hasher is not None else None

    with ThreadPoolExecutor(WORKERS) as pool:
        list(pool.map(work, jobs))
    return kept


def anonymous(huge: bool) -> Callable[[int, int], mmap.mmap]:
    def make(fd: int, size: int) -> mmap.mmap:
        buffer = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if huge:
            buffer.madvise(mmap.MADV_HUGEPAGE)
        return buffer

    return make


def private(fd: int, size: int) -> mmap.mmap:
    return mmap.mmap(fd, size, access=mmap.ACCESS_COPY)


def address(buffer: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))


def read(fd: int, dest: mmap.mmap, at: int, n: int) -> None:
    view = memoryview(dest)[at : at + n]
    got = 0
    while got < n:
        got += os.preadv(fd, [view[got:]], at + got)


def populated_then_read(fd: int, dest: mmap.mmap, at: int, n: int) -> None:
    if at % CHUNK == 0:
        populate_write(address(dest) + at, min(CHUNK, len(dest) - at))
    read(fd, dest, at, n)


def direct(model: Path, verify: bool) -> object:
    """O_DIRECT reads (a tail not a whole number of blocks is read through the cache)."""
    uncached: dict[int, int] = {}

    def make(fd: int, size: int) -> mmap.mmap:
        uncached[fd] = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_DIRECT)
        return anonymous(False)(fd, size)

    def fill(fd: int, dest: mmap.mmap, at: int, n: int) -> None:
        read(fd if n % 4096 else uncached[fd], dest, at, n)

    return load(model, verify, make, fill)


def populate_piece(fd: int, dest: mmap.mmap, at: int, n: int) -> None:
    if not populate_write(address(dest) + at, n):
        read(fd, dest, at, n)


def populate_chunk(fd: int, dest: mmap.mmap, at: int, n: int) -> None:
    if at % CHUNK == 0:
        populate_piece(fd, dest, at, min(CHUNK, len(dest) - at))


def populate_holding_the_gil(fd: int, dest: mmap.mmap, at: int, n: int) -> None:
    dest.madvise(MADV_POPULATE_WRITE, at, n)


def touch_rates() -> list[str]:
    """GB/s of two 1 GiB memsets into fresh memory, huge then 4 KiB pages, twice each."""
    out = []
    for huge in (True, True, False, False):
        buffer = anonymous(huge)(-1, 1 << 30)
        started = time.perf_counter()
        ctypes.memset(address(buffer), 1, len(buffer))
        rate = len(buffer) / (time.perf_counter() - started) / 1e9
        out.append(f"{'huge' if huge else '4 KiB'} {rate:.2f}")
        buffer.close()
    return out


def paths(model: Path) -> dict[str, Callable[[], object]]:
    out: dict[str, Callable[[], object]] = {"plain": lambda: plain(model)}
    for flag, verify in (("v", True), ("u", False)):
        out |= {
            f"read-{flag}": lambda v=verify: load(model, v, anonymous(False), read),
            f"read-huge-{flag}": lambda v=verify: load(model, v, anonymous(True), read),
            f"read-populated-{flag}": lambda v=verify: load(
                model, v, anonymous(False), populated_then_read
            ),
            f"direct-{flag}": lambda v=verify: direct(model, v),
            f"private-{flag}": lambda v=verify: load(model, v, private, populate_piece),
            f"private-chunk-{flag}": lambda v=verify: load(model, v, private, populate_chunk),
            f"private-gil-{flag}": lambda v=verify: load(
                model, v, private, populate_holding_the_gil
            ),
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", type=Path, default=WORK / "st-model-1073741824-4")
    p.add_argument("--paths", help="comma-separated; default: all")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--first-touch", action="store_true", help="huge against 4 KiB pages")
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.first_touch:
        for _ in range(3):
            cmd = [sys.executable, "-c", "import bench_loader_paths as b; print(b.touch_rates())"]
            env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent)}
            out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
            print("fresh process, GB/s in order:", out.stdout.strip())
        return
    if not shards(args.model):
        sys.exit(f"no shards in {args.model}: run bench/bench_loader.py once first")
    if args.one:
        print(json.dumps(measure_once(paths(args.model)[args.one])))
        return
    names = args.paths.split(",") if args.paths else list(paths(args.model))
    for path in shards(args.model):  # into the page cache
        path.read_bytes()
    size = sum(p.stat().st_size for p in shards(args.model))
    runs: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
    before = os.getloadavg()[0]
    for _ in range(args.repeats):
        for name in names:
            cmd = [sys.executable, __file__, "--model", str(args.model), "--one", name]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True)
            wall, cpu = json.loads(out.stdout.strip().splitlines()[-1])
            runs[name].append((wall, cpu))
    print(
        f"{size / MiB:.0f} MiB; median of {args.repeats} fresh processes; load average "
        f"{before:.2f} before, {os.getloadavg()[0]:.2f} after"
    )
    rates, rows = {}, []
    for name, r in runs.items():
        walls = sorted(w for w, _ in r)
        rates[name] = gbps(size, statistics.median(walls))
        cpu = statistics.median(c for _, c in r) / (size / 1e9)
        spread = f"{gbps(size, walls[-1]):.2f}-{gbps(size, walls[0]):.2f}"
        rows.append([name, f"{rates[name]:.2f} ({spread})", f"{cpu:.2f}"])
    print(table(["path", "GB/s (slowest-fastest)", "CPU s per GB"], rows))
    if "plain" in rates and "private-v" in rates:
        print(f"loader paths: private-v / plain = {rates['private-v'] / rates['plain']:.2f}x")


if __name__ == "__main__":
    main()
