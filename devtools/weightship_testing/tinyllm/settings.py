"""The server's configuration, from the environment the operator gives inference pods."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from weightship.data.s3 import S3Settings
from weightship.seeding.config import RootSettings, SeedConfig

DEFAULT_PORT = 8000


@dataclass(frozen=True)
class Settings:
    model_uri: str | None  # WEIGHTSHIP_MODEL_URI, s3://bucket/prefix/
    manifest_digest: str | None  # WEIGHTSHIP_MANIFEST_DIGEST: the weights the rollout wants
    cache_dir: Path | None  # WEIGHTSHIP_CACHE_DIR: the node cache root, read only
    s3: S3Settings
    revision: str = ""  # WEIGHTSHIP_MODEL_REVISION: a label on every metric
    port: int = DEFAULT_PORT
    error_rate: float = 0.0  # TINYLLM_ERROR_RATE: share of completions answered 500
    extra_latency_s: float = 0.0  # TINYLLM_EXTRA_LATENCY_MS
    scratch_dir: Path = Path("/tmp")  # SCRATCH_DIR: where weights are staged without a cache
    device: str = "cpu"  # TINYLLM_DEVICE
    node: str = "local"  # NODE_NAME
    seed: SeedConfig | None = None  # WEIGHTSHIP_SEED_*: receive by broadcast from a root
    # How this replica seeds others once verified (pod IP and name, backend, key, ...).
    root: RootSettings = field(default_factory=lambda: RootSettings(None, "local"))

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Settings:
        def opt(name: str) -> str | None:
            return env.get(name) or None

        cache = opt("WEIGHTSHIP_CACHE_DIR")
        return cls(
            model_uri=opt("WEIGHTSHIP_MODEL_URI"),
            manifest_digest=opt("WEIGHTSHIP_MANIFEST_DIGEST"),
            cache_dir=Path(cache) if cache else None,
            s3=S3Settings(
                endpoint_url=opt("WEIGHTSHIP_S3_ENDPOINT"),
                region=opt("AWS_REGION") or "us-east-1",
                access_key_id=opt("AWS_ACCESS_KEY_ID"),
                secret_access_key=opt("AWS_SECRET_ACCESS_KEY"),
                session_token=opt("AWS_SESSION_TOKEN"),
            ),
            revision=env.get("WEIGHTSHIP_MODEL_REVISION", ""),
            port=int(env.get("PORT") or DEFAULT_PORT),
            error_rate=min(max(float(env.get("TINYLLM_ERROR_RATE") or 0), 0.0), 1.0),
            extra_latency_s=float(env.get("TINYLLM_EXTRA_LATENCY_MS") or 0) / 1000,
            scratch_dir=Path(env.get("SCRATCH_DIR") or "/tmp"),
            device=env.get("TINYLLM_DEVICE") or "cpu",
            node=env.get("NODE_NAME") or "local",
            seed=SeedConfig.from_env(env),
            root=RootSettings.from_env(env),
        )
