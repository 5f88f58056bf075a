"""The agent's Prometheus metrics: the data plane's chunk counters plus cache and status
gauges. Served on WEIGHTSHIP_METRICS_PORT (default 9101) at /metrics, so pods can be
scraped by annotation (prometheus.io/scrape, prometheus.io/port)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import get_args

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from weightship.agent.status import Entry
from weightship.api.weightcache import FailureReason
from weightship.data.metrics import DataPlaneMetrics

STATES = ("Staging", "Staged", "Failed", "Evicting")
FAILURE_REASONS: tuple[str, ...] = get_args(FailureReason)


@dataclass(frozen=True)
class AgentMetrics:
    data: DataPlaneMetrics
    cache_capacity: Gauge
    cache_free: Gauge
    cache_used: Gauge
    models: Gauge
    stages: Counter
    stage_failures: Counter
    stage_seconds: Histogram
    evictions: Counter
    status_writes: Counter
    view_models: Gauge
    view_errors: Counter
    failing_models: Gauge
    cache_pinned: Gauge
    last_report: Gauge

    @classmethod
    def create(cls, registry: CollectorRegistry) -> AgentMetrics:
        return cls(
            data=DataPlaneMetrics.create(registry),
            cache_capacity=Gauge(
                "weightship_agent_cache_capacity_bytes",
                "Size of the cache volume (or its configured cap).",
                registry=registry,
            ),
            cache_free=Gauge(
                "weightship_agent_cache_free_bytes",
                "Bytes the cache may still use (free disk less the reserve).",
                registry=registry,
            ),
            cache_used=Gauge(
                "weightship_agent_cache_used_bytes",
                "Bytes the cache uses: chunks, assembled files and temp files.",
                registry=registry,
            ),
            models=Gauge(
                "weightship_agent_models",
                "Manifests in the cache by state.",
                ["state"],
                registry=registry,
            ),
            stages=Counter(
                "weightship_agent_stages",
                "Staging attempts by outcome (staged, failed, cancelled).",
                ["outcome"],
                registry=registry,
            ),
            stage_failures=Counter(
                "weightship_agent_stage_failures",
                "Failed staging attempts by failure reason (OriginMismatch, DiskFull, ...).",
                ["reason"],
                registry=registry,
            ),
            stage_seconds=Histogram(
                "weightship_agent_stage_seconds",
                "Time to stage one model (successful attempts).",
                buckets=(1, 5, 15, 30, 60, 120, 300, 600, 1200, 3600),
                registry=registry,
            ),
            evictions=Counter(
                "weightship_agent_evictions",
                "Models evicted (least recently used, unpinned) to make room.",
                registry=registry,
            ),
            status_writes=Counter(
                "weightship_agent_status_writes",
                "WeightCache status writes, by result (ok, error).",
                ["result"],
                registry=registry,
            ),
            view_models=Gauge(
                "weightship_agent_view_models",
                "Models shown in the per-rollout views, summed over the views.",
                registry=registry,
            ),
            view_errors=Counter(
                "weightship_agent_view_errors",
                "Models a rollout's view could not show, and refused views.",
                registry=registry,
            ),
            failing_models=Gauge(
                "weightship_agent_failing_models",
                "Manifests whose last staging attempt failed, by failure reason (kept while "
                "a retry runs, gone once staged or no longer wanted).",
                ["reason"],
                registry=registry,
            ),
            cache_pinned=Gauge(
                "weightship_agent_cache_pinned_bytes",
                "Bytes of the models rollouts pin (stable and canary): what eviction cannot free.",
                registry=registry,
            ),
            last_report=Gauge(
                "weightship_agent_last_report_timestamp_seconds",
                "When the agent last wrote its WeightCache status (Unix time; its start "
                "time until the first write).",
                registry=registry,
            ),
        )

    def __post_init__(self) -> None:
        self.last_report.set_to_current_time()
        for reason in FAILURE_REASONS:
            self.failing_models.labels(reason).set(0)

    def observe_entries(self, entries: Iterable[Entry]) -> None:
        """The gauges that follow the reported manifests: by state, failing by reason, and
        the bytes rollouts pin."""
        entries = list(entries)
        for state in STATES:
            self.models.labels(state).set(sum(e.state == state for e in entries))
        for reason in FAILURE_REASONS:
            failing = sum(e.failure is not None and e.failure.reason == reason for e in entries)
            self.failing_models.labels(reason).set(failing)
        self.cache_pinned.set(sum(e.bytes_total for e in entries if e.pinned_by))
