"""bench_agent_traffic: its reading of the API server's metrics and its report (pure, no
cluster), and `pytest bench -m bench -s -k agent_traffic`: a quick run of 20 agents on
the local cluster (heavy lock), which checks that every agent staged and that what the
figures stand on was counted. Nothing asserts on speed."""

from __future__ import annotations

from collections import Counter

import pytest

import bench_agent_traffic as bat

METRICS = """\
# HELP apiserver_request_total [STABLE] Counter of apiserver requests
apiserver_request_total{code="200",component="apiserver",dry_run="",group="weightship.io",\
resource="weightcaches",scope="cluster",subresource="",verb="LIST",version="v1alpha1"} 7
apiserver_request_total{code="200",component="apiserver",dry_run="",group="weightship.io",\
resource="weightcaches",scope="resource",subresource="status",verb="PATCH",version="v1alpha1"} 30
apiserver_request_total{code="200",component="apiserver",dry_run="",group="",resource="",\
scope="",subresource="/metrics",verb="GET",version=""} 99
apiserver_watch_events_sizes_sum{group="weightship.io",resource="modelrollouts",\
version="v1alpha1"} 5e+06
apiserver_watch_events_sizes_count{group="weightship.io",resource="modelrollouts",\
version="v1alpha1"} 1000
apiserver_watch_events_sizes_bucket{group="weightship.io",kind="ModelRollout",le="1024",\
version="v1alpha1"} 3
apiserver_response_sizes_sum{component="apiserver",group="weightship.io",resource="weightcaches",\
scope="cluster",subresource="",verb="LIST",version="v1alpha1"} 2.5e+07
apiserver_response_sizes_sum{component="apiserver",group="weightship.io",resource="weightcaches",\
scope="resource",subresource="",verb="GET",version="v1alpha1"} 4000
process_cpu_seconds_total 12.5
process_resident_memory_bytes 4e+08
"""


def test_metrics_are_read_by_verb_resource_and_kind() -> None:
    s = bat.parse_metrics(METRICS, t=3.0)
    # The scrape's own GET /metrics has no resource: not the agents' traffic.
    assert s.requests == {"LIST weightcaches": 7, "PATCH weightcaches/status": 30}
    assert s.watch_bytes == {"modelrollouts": 5_000_000}
    assert s.watch_events == {"modelrollouts": 1000}
    assert s.list_bytes == {"weightcaches": 25_000_000}  # GET responses are not listings
    assert (s.cpu_s, s.rss_bytes) == (12.5, 4e8)


def test_a_phase_is_the_difference_and_its_peaks_the_fastest_interval() -> None:
    def sample(
        t: float, patches: int, watch: int, listed: int, cpu: float, rss: float
    ) -> bat.Sample:
        return bat.Sample(
            t,
            requests=Counter({"PATCH weightcaches/status": patches, "GET nodes": 1}),
            watch_bytes=Counter({"ModelRollout": watch}),
            watch_events=Counter({"ModelRollout": watch // 1000}),
            list_bytes=Counter({"weightcaches": listed}),
            cpu_s=cpu,
            rss_bytes=rss,
        )

    samples = [
        sample(0.0, 10, 0, 0, 100.0, 5e8),
        sample(2.0, 30, 4_000_000, 10_000_000, 101.0, 9e8),  # 10 req/s, 2 MB/s
        sample(4.0, 130, 4_000_000, 10_000_000, 104.0, 6e8),  # 50 req/s, 0 MB/s
    ]
    f = bat.phase_figures(samples)
    assert f["seconds"] == 4.0
    assert f["requests"] == {"PATCH weightcaches/status": 120}  # GET nodes did not move
    assert f["request_total"] == 120
    assert f["peak_req_per_s"] == 50.0
    assert f["peak_watch_mb_per_s"] == 2.0
    assert f["watch_mb"] == 4.0 and f["watch_events"] == 4000
    assert f["list_mb_total"] == 10.0
    assert f["cpu_s"] == 4.0
    assert f["peak_rss_mb"] == 900.0
    with pytest.raises(ValueError):
        bat.phase_figures(samples[:1])


def test_the_summary_line_has_the_issues_shape() -> None:
    old = {
        "peak_req_per_s": 812.4,
        "peak_watch_mb_per_s": 9.5,
        "list_mb_total": 8000.0,
        "cpu_s": 300.0,
    }
    new = {"peak_req_per_s": 120.0, "peak_watch_mb_per_s": 0.1, "list_mb_total": 1.5, "cpu_s": 20.0}
    line = bat.summary_line(500, new, old)
    assert line == (
        "control traffic at 500 agents: 120 req/s peak, 0.10 watch MB/s peak, 1.5 MB listed "
        "per stage, apiserver 20.0 CPU-s (before: 812 req/s peak, 9.50 watch MB/s peak, "
        "8000.0 MB listed per stage, apiserver 300.0 CPU-s)"
    )
    assert bat.summary_line(500, None, old).startswith("control traffic at 500 agents (today")


def test_the_operators_unstaged_list_is_failed_first_and_bounded() -> None:
    states = {f"n{i:03d}": "Staging" for i in range(80)}
    states.update({"n050": "Failed", "n001": "Staged", "zz": "Pending"})
    left = bat.unstaged(states)
    assert len(left) == bat.MAX_UNSTAGED_LISTED
    assert left[0] == "n050" and "n001" not in left and "zz" not in left


@pytest.mark.bench
def test_agent_traffic_quick() -> None:
    r = bat.main(["--agents", "20", "--procs", "2", "--stage-s", "5", "--designs", "old,proposed"])
    for design in ("old", "proposed"):
        d = r[design]
        assert d["stage"]["staged"] == 20, design
        assert d["agents"]["staged"] == 20 and d["agents"]["write_errors"] == 0, design
        assert d["stage"]["requests"].get("PATCH weightcaches/status", 0) >= 40, design
    old, new = r["old"], r["proposed"]
    # Today each agent lists the WeightCaches at its start and at its stage's start, and
    # every rollout status write reaches every agent; the proposal does neither.
    assert old["agents"]["lists"] == 40
    assert old["stage"]["list_mb"].get("weightcaches", 0) > 0
    assert old["stage"]["watch_by_kind_mb"].get("modelrollouts", 0) > 0
    assert new["stage"]["list_mb"].get("weightcaches", 0) == 0
