"""Agent settings, from the environment the DaemonSet sets (downward API) or CLI flags."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from weightship.api.base import LABEL_VALUE_PATTERN, matches
from weightship.api.env import (
    CACHE_DIR_ENV,
    METRICS_PORT_ENV,
    PEER_PORT_ENV,
    WATCH_NAMESPACES_ENV,
)

DEFAULT_CACHE_DIR = Path("/var/cache/weightship")
DEFAULT_PEER_PORT = 8479
DEFAULT_METRICS_PORT = 9101
CREDENTIALS_ENV = "WEIGHTSHIP_S3_CREDENTIALS_DIR"
PEER_GROUP_ENV = "WEIGHTSHIP_PEER_GROUP"  # a label value: the WeightCache carries it
WRITE_BUDGET_ENV = "WEIGHTSHIP_STATUS_WRITE_BUDGET"
WRITE_SPREAD_ENV = "WEIGHTSHIP_STATUS_WRITE_SPREAD_S"
# All agents' WeightCache writes of one kind (state changes; progress), a second: half of
# what 5,000 nodes' Lease renewals cost (500/s), and about 2 of the API server's default
# 200 mutating requests in flight at 20 ms a write.
DEFAULT_WRITE_BUDGET_PER_S = 100.0
# The longest a state change waits for its turn: 5,000 nodes fit the budget (50 s), and a
# staged model reaches the operator within a minute on any fleet.
DEFAULT_MAX_WRITE_SPREAD_S = 60.0


class ConfigError(ValueError):
    """A required setting is missing or malformed."""


@dataclass(frozen=True)
class AgentConfig:
    node_name: str
    pod_ip: str
    cache_dir: Path = DEFAULT_CACHE_DIR
    # The agents' own S3 credential, mounted from a Secret (weightship.agent.credentials).
    s3_credentials_dir: Path | None = None
    peer_port: int = DEFAULT_PEER_PORT
    metrics_port: int = DEFAULT_METRICS_PORT  # 0 = no metrics server
    # Only rollouts in namespaces matching these globs count; empty = the whole cluster.
    namespaces: tuple[str, ...] = ()
    # Agents trade chunks only with agents of the same group (a zone, a node pool); "" =
    # every agent in the cluster (weightship.agent.kube, PEER_GROUP_LABEL).
    peer_group: str = ""
    capacity_bytes: int | None = None  # cap on what the cache may use; None = the disk
    reserve_bytes: int = 1 << 30  # always left free on the node's disk
    workers: int = 4  # parallel chunk fetches while staging
    resync_s: float = 30.0  # full re-evaluation even when no watch event arrives
    # How long a starting agent waits for the API server before it stages what it last
    # knew (weightship.agent.lastknown); it keeps asking after that.
    api_wait_s: float = 10.0
    # WeightCache status writes: see weightship.agent.status. State changes are spread
    # over up to max_write_spread_s so that the fleet writes at most
    # cluster_write_budget_per_s of them; progress while staging at most once per 10 s
    # per node (every write wakes the operator's cache watch).
    min_progress_interval_s: float = 10.0
    cluster_write_budget_per_s: float = DEFAULT_WRITE_BUDGET_PER_S
    max_write_spread_s: float = DEFAULT_MAX_WRITE_SPREAD_S
    heartbeat_s: float = 60.0
    # File operations (hard links, checks, deletions) per pass over the per-rollout views.
    view_budget: int = 4096

    @property
    def peer_endpoint(self) -> str:
        return f"{self.pod_ip}:{self.peer_port}"

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> AgentConfig:
        """Read NODE_NAME, POD_IP, WEIGHTSHIP_CACHE_DIR, WEIGHTSHIP_PEER_PORT, ..."""
        node = env.get("NODE_NAME", "").strip()
        pod_ip = env.get("POD_IP", "").strip()
        missing = [n for n, v in (("NODE_NAME", node), ("POD_IP", pod_ip)) if not v]
        if missing:
            raise ConfigError(
                f"{' and '.join(missing)} not set: the DaemonSet passes them from the downward "
                "API (fieldRef spec.nodeName and status.podIP)"
            )
        namespaces = tuple(
            n.strip() for n in env.get(WATCH_NAMESPACES_ENV, "").split(",") if n.strip()
        )
        capacity = env.get("WEIGHTSHIP_CACHE_CAPACITY_BYTES", "").strip()
        peer_group = env.get(PEER_GROUP_ENV, "").strip()
        if not matches(LABEL_VALUE_PATTERN, peer_group):
            raise ConfigError(
                f"{PEER_GROUP_ENV}={peer_group[:80]!r} is not a label value: at most 63 "
                "letters, digits, '-', '_' or '.', starting and ending with a letter or digit"
            )
        return cls(
            node_name=node,
            pod_ip=pod_ip,
            cache_dir=Path(env.get(CACHE_DIR_ENV) or DEFAULT_CACHE_DIR),
            s3_credentials_dir=Path(creds) if (creds := env.get(CREDENTIALS_ENV)) else None,
            peer_port=_int(env, PEER_PORT_ENV, DEFAULT_PEER_PORT),
            metrics_port=_int(env, METRICS_PORT_ENV, DEFAULT_METRICS_PORT),
            namespaces=namespaces,
            capacity_bytes=int(capacity) if capacity else None,
            reserve_bytes=_int(env, "WEIGHTSHIP_CACHE_RESERVE_BYTES", 1 << 30),
            workers=_int(env, "WEIGHTSHIP_STAGE_WORKERS", 4),
            peer_group=peer_group,
            cluster_write_budget_per_s=_positive(env, WRITE_BUDGET_ENV, DEFAULT_WRITE_BUDGET_PER_S),
            max_write_spread_s=_positive(env, WRITE_SPREAD_ENV, DEFAULT_MAX_WRITE_SPREAD_S),
        )


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer") from None
    if value < 0:
        raise ConfigError(f"{name}={raw!r} must not be negative")
    return value


def _positive(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number") from None
    if not value > 0 or value == float("inf"):
        raise ConfigError(f"{name}={raw!r} must be a positive number")
    return value
