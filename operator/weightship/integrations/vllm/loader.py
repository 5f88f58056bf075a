"""The `weightship` load format (vLLM's model-loader registry; runs in each worker).

    vllm serve $(WEIGHTSHIP_MODEL_DIR) --load-format weightship

Tensors come from a verified replica by broadcast, else from the node cache, every byte
checked against the pinned manifest (see ``weights``). A rank that cannot verify its
weights reports Failed, writes that as the container's termination message, and raises:
vLLM does not start. A rank that verified them reports Loaded; rank 0 of a replica whose
weights verified also becomes a seed root for new replicas.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from torch import nn
from vllm.config import ModelConfig
from vllm.config.load import LoadConfig
from vllm.model_executor.model_loader.base_loader import BaseModelLoader

from weightship.api.env import MODEL_REVISION_ENV
from weightship.api.inference import LoadReport, termination_message

from . import roots
from .reports import RankReport, write_rank_report
from .settings import PluginSettings
from .staging import remember_loaded
from .weights import LoadFailure, Obtained, checked_tensors, obtain

log = logging.getLogger("vllm.weightship")  # under vLLM's own log handlers
LOAD_FORMAT = "weightship"
SEED_PORT_FILE = roots.SEED_PORT_FILE


def worker_ranks() -> tuple[int, int]:
    """This worker's rank among all of the replica's workers (TP x PP), and their count."""
    try:
        from vllm.distributed.parallel_state import get_world_group

        group = get_world_group()
        return int(group.rank_in_group), int(group.world_size)
    except (ImportError, AssertionError, AttributeError):
        return 0, 1


class WeightshipModelLoader(BaseModelLoader):  # type: ignore[misc]
    def __init__(self, load_config: LoadConfig) -> None:
        super().__init__(load_config)
        extra = load_config.model_loader_extra_config
        self.extra: dict[str, Any] = dict(extra) if isinstance(extra, dict) else {}

    def download_model(self, model_config: ModelConfig) -> None:
        """Nothing to download: the node agent staged and verified the model."""

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        settings = PluginSettings.from_env(os.environ, self.extra)
        rank, world = worker_ranks()
        try:
            # A broadcast carries whole checkpoints to one receiver per replica; TP
            # replicas load from the node cache (each rank reads what it shards).
            got = obtain(settings, Path(model_config.model), broadcast=world == 1)
            vllm_model: Any = model  # vLLM's models all have load_weights(iterable)
            loaded = vllm_model.load_weights(checked_tensors(got.tensors, got.manifest))
        except LoadFailure as exc:
            self._refuse(settings, rank, world, exc)
            raise RuntimeError(f"weightship refused to load the weights: {exc}") from exc
        if isinstance(loaded, set) and not loaded:
            raise RuntimeError("weightship: vLLM took none of the tensors")
        report = LoadReport(
            state="Loaded",
            manifest_digest=got.manifest.digest,
            verified=True,
            source=got.source,
            seeded_from=got.seeded_from,
            load_seconds=got.seconds,
            message=f"{got.manifest.total_size} bytes verified, from {_from(got)}",
        )
        write_rank_report(settings.run_dir, RankReport(rank, world, report))
        remember_loaded(got.manifest, os.environ.get(MODEL_REVISION_ENV) or None)
        log.info("rank %d/%d: %s in %.2f s", rank, world, report.message, got.seconds)
        if rank == 0 and world == 1:
            # Keep the verified raw tensors (host memory: one copy of the checkpoint) and
            # serve joins on loopback; the API server's endpoint forwards them there.
            roots.become_root(settings, got.tensors, got.manifest)

    def _refuse(self, settings: PluginSettings, rank: int, world: int, exc: LoadFailure) -> None:
        report = LoadReport(
            state="Failed",
            manifest_digest=exc.digest or settings.manifest_digest,
            reason=exc.reason,
            message=exc.message,
        )
        log.error("rank %d/%d refuses to serve: %s", rank, world, exc)
        write_rank_report(settings.run_dir, RankReport(rank, world, report))
        try:
            settings.termination_log.write_text(termination_message(report) + "\n")
        except OSError as err:  # not in a Kubernetes container
            log.warning("cannot write the termination message: %s", err)


def _from(got: Obtained) -> str:
    if got.source == "broadcast":
        return f"broadcast by {got.seeded_from}"
    return "the node cache"
