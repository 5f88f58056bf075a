"""What the operator injects into a new replica to have it seeded, read from its env."""

from __future__ import annotations

import socket
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from weightship.data.manifest import Manifest
from weightship.seeding.receiver import Received, receive
from weightship.seeding.transport import BACKENDS

ROOT_ENV = "WEIGHTSHIP_SEED_ROOT"
GROUP_ENV = "WEIGHTSHIP_SEED_GROUP"
WORLD_SIZE_ENV = "WEIGHTSHIP_SEED_WORLD_SIZE"
BACKEND_ENV = "WEIGHTSHIP_SEED_BACKEND"
TIMEOUT_ENV = "WEIGHTSHIP_SEED_TIMEOUT_SECONDS"
MEMBER_ENV = "WEIGHTSHIP_POD_NAME"  # injected by the operator (downward API)
FALLBACK_MEMBER_ENV = "POD_NAME"
DEFAULT_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class SeedConfig:
    root_url: str  # http://ip:port of the root replica's server
    group: str
    world_size: int  # the root included
    member: str
    backend: str = "auto"
    timeout_s: float = DEFAULT_TIMEOUT_S

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> SeedConfig | None:
        """The config, or None when ``WEIGHTSHIP_SEED_ROOT`` is unset or empty (no seeding:
        load from the node cache). Raises ValueError on a malformed value."""
        root_url = env.get(ROOT_ENV, "").strip()
        if not root_url:
            return None
        group = env.get(GROUP_ENV, "").strip()
        if not group:
            raise ValueError(f"{ROOT_ENV} is set but {GROUP_ENV} is not")
        backend = env.get(BACKEND_ENV, "auto").strip() or "auto"
        if backend not in BACKENDS:
            raise ValueError(f"{BACKEND_ENV} must be one of {BACKENDS}, got {backend!r}")
        try:
            world_size = int(env.get(WORLD_SIZE_ENV, "2"))
            timeout_s = float(env.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))
        except ValueError as exc:
            raise ValueError(f"{WORLD_SIZE_ENV} / {TIMEOUT_ENV}: {exc}") from exc
        if world_size < 2 or timeout_s <= 0:
            raise ValueError(f"{WORLD_SIZE_ENV} must be >= 2 and {TIMEOUT_ENV} > 0")
        member = (
            env.get(MEMBER_ENV, "").strip()
            or env.get(FALLBACK_MEMBER_ENV, "").strip()
            or socket.gethostname()
        )
        return cls(root_url, group, world_size, member, backend, timeout_s)

    def receive(self, manifest: Manifest, *, device: str | torch.device = "cpu") -> Received:
        """``receive`` with this config; see it for the errors and what they mean."""
        return receive(
            self.root_url,
            self.group,
            self.world_size,
            manifest,
            member=self.member,
            device=device,
            timeout_s=self.timeout_s,
            backend=self.backend,
        )
