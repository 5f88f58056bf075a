"""bench/bench_inplace.py's arithmetic, without a cluster: the out-of-traffic window from
the pod samples, and the summary line from the figures (the bench itself: `pytest bench -m
bench -k inplace`, on the local cluster)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from weightship_dev.loadgen import Answer

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "bench_inplace.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_inplace", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_out_of_traffic_sums_each_pods_unready_samples_in_the_window(bench: ModuleType) -> None:
    watch = bench.PodWatch(core=None, namespace="ns", name="inplace")
    watch.samples = [
        (9.0, {"a": False, "b": True}),  # before the window
        (10.0, {"a": True, "b": True}),
        (10.5, {"a": False, "b": True}),
        (11.5, {"a": False, "b": True}),
        (12.0, {"a": True, "b": False}),
        (13.0, {"a": True, "b": True}),
        (20.0, {"a": True, "b": False}),  # after the window
    ]
    assert watch.out_of_traffic(10.0, 13.0) == {"a": 1.5, "b": 1.0}
    assert watch.out_of_traffic(30.0, 40.0) == {}


def test_summary_line_is_the_ratio_of_medians_with_paused_and_failed(
    bench: ModuleType,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(bench, "RESULTS", tmp_path / "results.json")

    def run(mode: str, seconds: list[float], paused: list[float], failed: int) -> object:
        changes = [
            bench.Change(mode, "v2", s, s + 1, "InPlace" if mode == "inplace" else "Replace")
            for s in seconds
        ]
        for change, value in zip(changes, paused, strict=False):
            change.paused = {"p0": value, "p1": value + 0.2}
            change.out_of_traffic = {"p0": 4.0, "p1": 5.0}
        bad = [Answer(0.0, 1.0, "10.0.0.1", None, error="ReadTimeoutError")] * failed
        return bench.ModeRun(mode, 80.0, changes, 100, bad, [], 0, [])

    runs = {
        "inplace": run("inplace", [8.0, 10.0, 9.0], [0.5, 0.7, 0.6], 0),
        "replace": run("replace", [200.0, 180.0, 190.0], [], 1),
    }
    result = bench.report(runs, 3, 4.0, (1.0, 1.0, 1.0), (2.0, 2.0, 2.0))
    assert result["ratio"] == pytest.approx(9.0 / 190.0)
    assert result["failed"] == 1
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == "in-place/replace time to 100% = 0.05x, paused per pod 0.70 s, failed requests 1"
    assert (tmp_path / "results.json").is_file()
