"""The ``weightship`` weight-transfer engine: vLLM's own path for changing weights in a
running engine (``--weight-transfer-config '{"backend": "weightship"}'``), fed from the
node cache instead of a trainer. It runs in every worker; the API server drives it
through the engine client (``start_weight_update``, ``update_weights``,
``finish_weight_update``), one collective step at a time (see ``staging``).

It never raises out of ``update_weights``: vLLM's multiprocess executor reads the ranks'
answers in order and stops at the first error, leaving the others' answers queued for
the next call. Each rank writes its outcome to its file in the run directory instead.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from .loader import worker_ranks
from .settings import PluginSettings
from .staging import Reload, SwapSession

log = logging.getLogger("vllm.weightship")
BACKEND = "weightship"


@dataclass
class WeightshipInitInfo(WeightTransferInitInfo):  # type: ignore[misc]
    """Nothing to set up: the weights come from the node cache."""


@dataclass
class WeightshipUpdateInfo(WeightTransferUpdateInfo):  # type: ignore[misc]
    op: str = ""
    swapId: str = ""  # the wire names (camelCase)
    manifestDigest: str = ""
    revision: str = ""
    deadline: float = 0.0
    message: str = ""


def _layerwise() -> Reload:
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )

    return Reload(initialize_layerwise_reload, finalize_layerwise_reload)


class WeightshipTransferEngine(WeightTransferEngine[WeightshipInitInfo, WeightshipUpdateInfo]):  # type: ignore[misc]
    init_info_cls = WeightshipInitInfo
    update_info_cls = WeightshipUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: Any) -> None:
        super().__init__(config, vllm_config, device, model)
        extra = vllm_config.load_config.model_loader_extra_config
        extra = dict(extra) if isinstance(extra, dict) else {}
        rank, world = worker_ranks()
        self.session = SwapSession(
            settings=lambda: PluginSettings.from_env(os.environ, extra),
            rank=rank,
            world=world,
            reload=_layerwise(),
        )
        log.info("rank %d/%d: in-place weight swaps enabled (weightship)", rank, world)

    def init_transfer_engine(self, init_info: WeightshipInitInfo) -> None:
        """Nothing to connect to."""

    def start_weight_update(self) -> None:
        self.session.start()

    def update_weights(self, update_info: Any) -> None:
        """vLLM's default parses, receives, then synchronizes the accelerator (which a
        CPU build may lack); the session never raises, see the module docstring."""
        info = update_info if isinstance(update_info, dict) else {}
        self.session.handle(info, self.model, self.model_config)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def receive_weights(self, update_info: WeightshipUpdateInfo) -> None:
        self.session.handle(vars(update_info), self.model, self.model_config)

    def finish_weight_update(self) -> None:
        self.session.finish()

    def shutdown(self) -> None:
        self.session.finish()
