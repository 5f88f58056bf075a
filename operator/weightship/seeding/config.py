"""What the operator injects into a replica to have it seeded (``SeedConfig``) and to let
it seed others once verified (``RootSettings``), read from its env."""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from weightship.api.env import (
    POD_IP_ENV,
    POD_NAME_ENV,
    ROLLOUT_UID_ENV,
    SEED_BACKEND_ENV,
    SEED_BUCKET_BYTES_ENV,
    SEED_GROUP_ENV,
    SEED_KEY_ENV,
    SEED_ROOT_ENV,
    SEED_TIMEOUT_ENV,
    SEED_WORLD_SIZE_ENV,
)
from weightship.core.seedtoken import mint, parse_key
from weightship.seeding.buckets import DEFAULT_BUCKET_BYTES
from weightship.seeding.receiver import Received, receive
from weightship.seeding.transport import BACKENDS
from weightship.weightformat.manifest import Manifest

log = logging.getLogger(__name__)

FALLBACK_MEMBER_ENV = "POD_NAME"
DEFAULT_TIMEOUT_S = 300.0


def seeding_key(env: Mapping[str, str]) -> bytes | None:
    """The rollout's seeding key, or None (unset or malformed: this pod neither joins
    with a token nor admits anyone as a root; it loads from its node cache)."""
    text = env.get(SEED_KEY_ENV, "").strip()
    if not text:
        return None
    try:
        return parse_key(text)
    except ValueError as exc:  # the message never quotes the key
        log.warning("%s ignored: %s", SEED_KEY_ENV, exc)
        return None


def member_name(env: Mapping[str, str]) -> str:
    return (
        env.get(POD_NAME_ENV, "").strip()
        or env.get(FALLBACK_MEMBER_ENV, "").strip()
        or socket.gethostname()
    )


@dataclass(frozen=True)
class RootSettings:
    """How a verified replica seeds others (``SeedRoot.from_settings``)."""

    host: str | None  # WEIGHTSHIP_POD_IP; None: not in a pod, never a root
    name: str  # WEIGHTSHIP_POD_NAME
    backend: str = "auto"  # WEIGHTSHIP_SEED_BACKEND
    timeout_s: float = DEFAULT_TIMEOUT_S  # WEIGHTSHIP_SEED_TIMEOUT_SECONDS
    bucket_bytes: int = DEFAULT_BUCKET_BYTES  # WEIGHTSHIP_SEED_BUCKET_BYTES
    key: bytes | None = field(default=None, repr=False)  # WEIGHTSHIP_SEED_KEY
    rollout_uid: str = ""  # WEIGHTSHIP_ROLLOUT_UID

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> RootSettings:
        return cls(
            host=env.get(POD_IP_ENV) or None,
            name=env.get(POD_NAME_ENV) or env.get(FALLBACK_MEMBER_ENV) or "local",
            backend=env.get(SEED_BACKEND_ENV) or "auto",
            timeout_s=float(env.get(SEED_TIMEOUT_ENV) or DEFAULT_TIMEOUT_S),
            bucket_bytes=int(env.get(SEED_BUCKET_BYTES_ENV) or DEFAULT_BUCKET_BYTES),
            key=seeding_key(env),
            rollout_uid=env.get(ROLLOUT_UID_ENV, "").strip(),
        )


@dataclass(frozen=True)
class SeedConfig:
    root_url: str  # http://ip:port of the root replica's server
    group: str
    world_size: int  # the root included
    member: str
    backend: str = "auto"
    timeout_s: float = DEFAULT_TIMEOUT_S
    key: bytes | None = field(default=None, repr=False)  # never printed
    rollout_uid: str = ""

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> SeedConfig | None:
        """The config, or None when ``WEIGHTSHIP_SEED_ROOT`` is unset or empty (no seeding:
        load from the node cache). Raises ValueError on a malformed value."""
        root_url = env.get(SEED_ROOT_ENV, "").strip()
        if not root_url:
            return None
        group = env.get(SEED_GROUP_ENV, "").strip()
        if not group:
            raise ValueError(f"{SEED_ROOT_ENV} is set but {SEED_GROUP_ENV} is not")
        backend = env.get(SEED_BACKEND_ENV, "auto").strip() or "auto"
        if backend not in BACKENDS:
            raise ValueError(f"{SEED_BACKEND_ENV} must be one of {BACKENDS}, got {backend!r}")
        try:
            world_size = int(env.get(SEED_WORLD_SIZE_ENV, "2"))
            timeout_s = float(env.get(SEED_TIMEOUT_ENV, DEFAULT_TIMEOUT_S))
        except ValueError as exc:
            raise ValueError(f"{SEED_WORLD_SIZE_ENV} / {SEED_TIMEOUT_ENV}: {exc}") from exc
        if world_size < 2 or timeout_s <= 0:
            raise ValueError(f"{SEED_WORLD_SIZE_ENV} must be >= 2 and {SEED_TIMEOUT_ENV} > 0")
        return cls(
            root_url,
            group,
            world_size,
            member_name(env),
            backend,
            timeout_s,
            key=seeding_key(env),
            rollout_uid=env.get(ROLLOUT_UID_ENV, "").strip(),
        )

    def token(self, digest: str) -> str | None:
        """This replica's join token for ``digest``, made now; None without a key (the
        root refuses the join, and this replica loads from its node cache)."""
        if self.key is None:
            return None
        return mint(self.key, self.rollout_uid, digest, self.group, time.time())

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
            token=self.token(manifest.digest),
        )
