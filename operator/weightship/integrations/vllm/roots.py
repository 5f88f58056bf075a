"""Rank 0 of a one-rank replica as a seed root: it keeps the verified raw tensors of what it
serves (one host copy of the checkpoint) and serves joins on loopback, where the API
server's endpoint forwards them (``SEED_PORT_FILE`` in the run directory names the port).

A swap changes what the replica serves: its root stops before the parameters change, and
after a successful swap a new root serves the new revision's tensors, so a root never
hands out tensors of another digest than the one the replica reports. No vLLM imports.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from pathlib import Path

import torch

from weightship.httpserver import Server
from weightship.seeding.endpoints import serve
from weightship.seeding.root import SeedRoot
from weightship.weightformat.manifest import Manifest

from .settings import PluginSettings

log = logging.getLogger("vllm.weightship")
SEED_PORT_FILE = "seed-port"

_ROOTS: list[tuple[SeedRoot, Server]] = []  # alive as long as the worker


def become_root(
    settings: PluginSettings, tensors: Mapping[str, torch.Tensor], manifest: Manifest
) -> bool:
    """Seed ``manifest``'s tensors from now on, if this pod may seed; True if it does."""
    if not settings.seed_root or settings.root.host is None:
        return False
    try:
        root = SeedRoot.from_settings(tensors, manifest, settings.root)
    except Exception as exc:  # e.g. a manifest without tensor checksums
        log.warning("this replica cannot seed others: %s", exc)
        return False
    server = serve(root, "127.0.0.1", 0)
    _ROOTS.append((root, server))
    (settings.run_dir / SEED_PORT_FILE).write_text(str(server.server_address[1]))
    log.info("seed root for %s on loopback port %d", manifest.digest, server.server_port)
    return True


def stop_roots(run_dir: Path) -> int:
    """No more joins to the roots this worker runs (broadcasts under way finish); the
    endpoint answers joins "not a root" until a new root starts. Returns how many."""
    (run_dir / SEED_PORT_FILE).unlink(missing_ok=True)
    stopped = 0
    while _ROOTS:
        root, server = _ROOTS.pop()
        root.close()  # refuses joins from now on
        # stop() waits for the serving loop's next poll (up to half a second): not
        # inside a swap, whose paused window it would lengthen.
        threading.Thread(target=server.stop, name="root-shutdown", daemon=True).start()
        stopped += 1
    return stopped


def root_digests() -> list[str]:
    return [root.digest for root, _ in _ROOTS]
