"""`pytest bench -m bench -s -k vllm`: time to ready of a real vLLM replica, quick mode.

Nothing here asserts on speed: both load formats must have answered the golden prompt
right, and the weightship one must have verified what it loaded."""

from __future__ import annotations

import pytest

import bench_vllm_ready
from weightship_testing.tinyvllm.build import CHAT_ANSWER

pytestmark = pytest.mark.bench


def test_vllm_ready_quick() -> None:
    r = bench_vllm_ready.main(["--quick"])
    assert {x["mode"] for x in r["runs"]} == set(bench_vllm_ready.MODES)
    for x in r["runs"]:
        assert x["answer"] == CHAT_ANSWER["good"], x
    assert all(x["verified"] for x in r["runs"] if x["mode"] == "weightship")
