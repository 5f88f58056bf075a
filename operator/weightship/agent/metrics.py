"""The agent's Prometheus metrics: the data plane's chunk counters plus cache and status
gauges. Served on WEIGHTSHIP_METRICS_PORT (default 9101) at /metrics, so pods can be
scraped by annotation (prometheus.io/scrape, prometheus.io/port)."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from weightship.data.metrics import DataPlaneMetrics

STATES = ("Staging", "Staged", "Failed", "Evicting")


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
        )
