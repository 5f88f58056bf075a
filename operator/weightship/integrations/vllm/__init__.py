"""weightship inside vLLM (`pip install weightship[vllm]`), registered by entry points:

- ``vllm.general_plugins: weightship = weightship.integrations.vllm:register`` registers
  the load format ``weightship`` (``loader``) and the weight-transfer engine
  ``weightship`` (``engine``: in-place swaps, with
  ``--weight-transfer-config '{"backend": "weightship"}'``) in every vLLM process;
- ``vllm.endpoint_plugins: weightship = weightship.integrations.vllm.endpoint:endpoint_plugin``
  adds GET /weightship/v1/loaded, the seed-root routes, the swap routes and the response
  stamping to vLLM's API server.

Both load with ``VLLM_PLUGINS=weightship`` (endpoint plugins load only when named there).
See docs/integrations.md.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

_registered = False


def claim_run_dir(env: dict[str, str] | os._Environ[str]) -> Path:
    """The first vLLM process (the API server) makes a fresh run directory and hands it
    to the processes it starts through the environment; they find it set."""
    # Here, not at the top: settings imports weightship.seeding (torch), which the plugin's
    # torch-free modules (stamp, swap) must not pull in when imported on their own.
    from .settings import RUN_DIR_ENV, RUN_OWNER_ENV

    if not env.get(RUN_OWNER_ENV):
        folder = env.get(RUN_DIR_ENV)
        if folder:
            path = Path(folder)
            path.mkdir(parents=True, exist_ok=True)
            for stale in path.glob("*"):  # an earlier run's reports say nothing now
                if stale.is_file():
                    stale.unlink()
        else:
            path = Path(tempfile.mkdtemp(prefix="weightship-vllm-"))
        env[RUN_DIR_ENV] = str(path)
        env[RUN_OWNER_ENV] = str(os.getpid())
    return Path(env[RUN_DIR_ENV])


def register() -> None:
    """vLLM calls this in every process; only the first call in each does anything."""
    global _registered
    if _registered:
        return
    _registered = True
    claim_run_dir(os.environ)
    from vllm.model_executor.model_loader import register_model_loader

    from .loader import LOAD_FORMAT, WeightshipModelLoader

    register_model_loader(LOAD_FORMAT)(WeightshipModelLoader)
    register_weight_transfer_engine()


WEIGHT_TRANSFER_BACKEND = "weightship"


def register_weight_transfer_engine() -> None:
    """``--weight-transfer-config '{"backend": "weightship"}'``; lazily imported (the
    factory loads the module in the workers only). vLLM's factory refuses a name twice."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if WEIGHT_TRANSFER_BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            WEIGHT_TRANSFER_BACKEND,
            "weightship.integrations.vllm.engine",
            "WeightshipTransferEngine",
        )
