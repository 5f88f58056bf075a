"""`pytest bench/test_bench_loader.py -m bench -s`: the loader benchmark in quick mode.

Nothing here asserts on speed (the machine is shared and noisy): the run must load
exactly safetensors' tensors, verified (BLAKE3 chunks of a version 2 manifest and sha256
chunks of a version 1 one), and print its figures.
"""

from __future__ import annotations

import pytest

import bench_loader

pytestmark = pytest.mark.bench


def test_loader_quick() -> None:
    r = bench_loader.main(["--quick"])
    assert r["correct"], "load_model's tensors differ from safetensors' own"
    assert r["tensors"] > 0 and all(s > 0 for s in r["seconds"].values())
    print(
        f"\nverified: ours/baseline {r['ratio_verified']:.2f}x "
        f"(vs 2 hash threads {r['ratio_verified_2threads']:.2f}x); "
        f"unverified {r['ratio_unverified']:.2f}x"
    )
    print(
        f"P4 blake3 verified / naive verified {r['ratio_verified']:.2f}x (target >= 2.5x); "
        f"sha256 chunks {r['ratio_verified_sha256_chunks']:.2f}x; "
        f"verified/unverified {r['verified_over_unverified']:.2f}"
    )
