"""The plugin's configuration: the environment the operator gives inference pods, then
``--model-loader-extra-config`` (JSON) on top. No vLLM imports."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from weightship.api.env import CACHE_DIR_ENV, MANIFEST_DIGEST_ENV, TERMINATION_LOG_ENV
from weightship.api.inference import DEFAULT_TERMINATION_LOG
from weightship.seeding.config import RootSettings, SeedConfig

RUN_DIR_ENV = "WEIGHTSHIP_VLLM_RUN_DIR"
# Set by the API server process (the first to load the plugin) for its children, so a
# restarted server never reads reports of an earlier run.
RUN_OWNER_ENV = "WEIGHTSHIP_VLLM_RUN_OWNER"
SEED_ROOT_ENV = "WEIGHTSHIP_VLLM_SEED_ROOT"
EXTRA_KEYS = frozenset({"cache_dir", "manifest_digest", "seed_root"})


class SettingsError(ValueError):
    pass


@dataclass(frozen=True)
class PluginSettings:
    cache_dir: Path | None  # WEIGHTSHIP_CACHE_DIR: the node cache, mounted read-only
    manifest_digest: str | None  # WEIGHTSHIP_MANIFEST_DIGEST: what the rollout pins
    run_dir: Path  # where ranks leave their reports for the endpoint
    seed: SeedConfig | None = None  # WEIGHTSHIP_SEED_*: receive by broadcast
    seed_root: bool = True  # WEIGHTSHIP_VLLM_SEED_ROOT=0: keep no copy to seed others
    # How this replica seeds others once verified (pod IP and name, backend, key, ...).
    root: RootSettings = field(default_factory=lambda: RootSettings(None, "local"))
    termination_log: Path = Path(DEFAULT_TERMINATION_LOG)

    @classmethod
    def from_env(
        cls, env: Mapping[str, str], extra: Mapping[str, Any] | None = None
    ) -> PluginSettings:
        extra = dict(extra or {})
        unknown = set(extra) - EXTRA_KEYS
        if unknown:
            raise SettingsError(
                f"--model-loader-extra-config: unknown keys {sorted(unknown)}; "
                f"known: {sorted(EXTRA_KEYS)}"
            )

        def opt(name: str) -> str | None:
            return env.get(name) or None

        cache = extra.get("cache_dir") or opt(CACHE_DIR_ENV)
        try:
            seed = SeedConfig.from_env(env)
        except ValueError as exc:
            raise SettingsError(str(exc)) from exc
        seed_root = extra.get("seed_root", env.get(SEED_ROOT_ENV, "1") not in ("0", "false"))
        return cls(
            cache_dir=Path(cache) if cache else None,
            manifest_digest=extra.get("manifest_digest") or opt(MANIFEST_DIGEST_ENV),
            run_dir=Path(env.get(RUN_DIR_ENV) or f"/tmp/weightship-vllm-{os.getpid()}"),
            seed=seed,
            seed_root=bool(seed_root),
            root=RootSettings.from_env(env),
            termination_log=Path(env.get(TERMINATION_LOG_ENV) or DEFAULT_TERMINATION_LOG),
        )
