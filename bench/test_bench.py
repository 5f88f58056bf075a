"""`pytest bench -m bench -s`: the data-plane benchmarks in quick mode, figures printed.

Nothing here asserts on speed: this machine is shared and noisy. The tests check that the
runs are correct: every node staged the model under the right digest with files matching
the manifest, and the origin's bytes were counted.
"""

from __future__ import annotations

import os
import shutil

import pytest

import bench_churn
import bench_fleet
import bench_stage_single
from benchlib import versitygw_path

pytestmark = [
    pytest.mark.bench,
    pytest.mark.skipif(not versitygw_path().is_file(), reason="versitygw not built (hack/deps.sh)"),
]


def test_stage_single_quick() -> None:
    r = bench_stage_single.main(["--quick"])
    assert r["s5cmd"] > 0 and r["chosen"]["seconds"] > 0  # run_ours asserts STAGED + digest
    print(f"\nours/s5cmd {r['ratio']:.2f}x, verified vs verified {r['ratio_verified']:.2f}x")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: network namespaces and tc")
@pytest.mark.skipif(not (shutil.which("ip") and shutil.which("tc")), reason="needs ip and tc")
def test_fleet_quick() -> None:
    r = bench_fleet.main(["--quick"])
    for mode in ("p2p", "origin-only"):
        m = r[mode]
        assert len(m["nodes"]) == r["nodes"]
        for node in m["nodes"]:
            assert node["staged"] and node["digest"] == r["digest"], node
        assert not m["bad_files"], m["bad_files"]
        assert m["origin_tx_bytes"] >= r["size_bytes"]  # counted, and at least S left
    assert r["origin-only"]["origin_payload_bytes"] == r["nodes"] * r["size_bytes"]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: network namespaces and tc")
@pytest.mark.skipif(not (shutil.which("ip") and shutil.which("tc")), reason="needs ip and tc")
def test_churn_quick() -> None:
    r = bench_churn.main(["--quick"])
    survivors = r["nodes_total"] - len(r["killed"])
    assert len(r["nodes"]) == survivors and r["late"] in r["nodes"]
    for node in r["nodes"].values():
        assert node["staged"] and node["digest"] == r["digest"], node
        assert node["piece_verified"], node  # pieces were checked as they landed
    assert not r["bad_files"], r["bad_files"]
    assert r["peer_verification_failures"] == 0  # no peer served an unverified byte
    assert r["origin_tx_bytes"] >= r["size_bytes"]
