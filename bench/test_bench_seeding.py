"""`pytest bench -m bench -s -k seeding`: the seeding benchmarks in quick mode, figures printed.

Nothing here asserts on speed. The checks are that the runs were correct: receivers of
both broadcasts hold the root's tensors, and every replica of every mode ended with all
of the model's tensors.
"""

from __future__ import annotations

import pytest

import bench_broadcast
import bench_time_to_loaded
from benchlib import versitygw_path

pytestmark = pytest.mark.bench


def test_broadcast_quick() -> None:
    r = bench_broadcast.main(["--quick"])
    assert r["correct"]
    assert r["buckets"] > 1
    assert all(len(ts) == 2 for ts in r["times"].values())


@pytest.mark.skipif(not versitygw_path().is_file(), reason="versitygw not built (hack/deps.sh)")
def test_time_to_loaded_quick() -> None:
    r = bench_time_to_loaded.main(["--quick"])
    modes = {x["mode"] for x in r["results"]}
    assert modes == set(bench_time_to_loaded.MODES)
    for x in r["results"]:
        assert len(x["replicas"]) == x["k"]
        for replica in x["replicas"]:
            assert replica["tensors"] == r["tensors"], (x["mode"], replica)
            assert replica["bytes"] > 0
