"""Prometheus metrics of the chunk path. Pass a registry so tests stay isolated."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

# Sources a chunk can come from: the S3 origin, a peer agent, or this node's own cache.
SOURCES = ("origin", "peer", "local")


@dataclass(frozen=True)
class DataPlaneMetrics:
    chunk_bytes: Counter
    chunk_seconds: Histogram
    verification_failures: Counter
    peer_demotions: Counter
    chunks_claimed: Counter
    chunk_splits: Counter
    origin_renewals: Counter
    relay_stops: Counter
    origin_requests: Gauge

    @classmethod
    def create(cls, registry: CollectorRegistry | None = None) -> DataPlaneMetrics:
        registry = REGISTRY if registry is None else registry
        return cls(
            chunk_bytes=Counter(
                "weightship_agent_chunk_bytes",
                "Verified chunk bytes staged, by source (origin, peer, local).",
                ["source"],
                registry=registry,
            ),
            chunk_seconds=Histogram(
                "weightship_agent_chunk_fetch_seconds",
                "Time to get one verified chunk, by source.",
                ["source"],
                buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
                registry=registry,
            ),
            verification_failures=Counter(
                "weightship_agent_chunk_verification_failures",
                "Chunks whose bytes did not match their sha256, by source.",
                ["source"],
                registry=registry,
            ),
            peer_demotions=Counter(
                "weightship_agent_peer_demotions",
                "Times a peer was demoted for serving bad bytes.",
                registry=registry,
            ),
            chunks_claimed=Counter(
                "weightship_agent_chunks_claimed",
                "Chunks this node fetched from the origin for a slow owner (tail stealing).",
                registry=registry,
            ),
            chunk_splits=Counter(
                "weightship_agent_chunk_splits",
                "Slow whole-chunk transfers whose last part was asked of a second peer, by "
                "outcome: used (that part finished the chunk) or unused (the first stream "
                "was done first, or no second peer had it to send).",
                ["outcome"],
                registry=registry,
            ),
            origin_renewals=Counter(
                "weightship_agent_origin_connection_renewals",
                "Origin connections closed after the chunk they carried, so the next chunk "
                "starts a new TCP flow (staging with peers; FetchPolicy.renew_origin_connections).",
                registry=registry,
            ),
            relay_stops=Counter(
                "weightship_agent_relay_stops",
                "Times this node stopped relaying chunks for a while: its parents in the relay "
                "trees had held the chunks it asked them for whole for seconds, so its link "
                "lags, and the nodes below it take them from above it (slowrelay.py).",
                registry=registry,
            ),
            origin_requests=Gauge(
                "weightship_agent_origin_requests",
                "Origin requests this node keeps in flight for the chunks it fetches for the "
                "fleet, in its last stage: more where a first byte takes long beside a "
                "chunk's transfer (schedule.origin_requests).",
                registry=registry,
            ),
        )
