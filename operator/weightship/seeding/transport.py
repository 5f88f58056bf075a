"""torch.distributed plumbing: the rendezvous store and one process group per broadcast.

Process groups are built with the backend constructors (``ProcessGroupGloo(store, ...)``,
``ProcessGroupNCCL(store, ...)``) and never with ``init_process_group``: a root may run
several broadcasts, one after another or at once, and the default group allows one per
process. Nothing here touches global torch.distributed state, so an inference server that
uses torch.distributed for itself keeps its own default group.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any, Literal

import torch
from torch._C._distributed_c10d import (
    Backend as Group,  # what the backend constructors return
)
from torch._C._distributed_c10d import (
    BroadcastOptions,
    PrefixStore,
    ProcessGroupGloo,
    ProcessGroupNCCL,
    Store,
    TCPStore,
    Work,
)

__all__ = [
    "Group",
    "Store",
    "TCPStore",
    "Work",
    "client_store",
    "close_group",
    "local_address_towards",
    "looks_like_timeout",
    "master_store",
    "new_group",
    "prefixed",
    "resolve_backend",
    "start_broadcast",
    "wait",
]

Backend = Literal["gloo", "nccl"]
BACKENDS = ("auto", "gloo", "nccl")


def resolve_backend(requested: str, device: torch.device) -> Backend:
    """``auto`` is NCCL for tensors on CUDA and gloo otherwise."""
    if requested not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {requested!r}")
    if requested == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if requested == "nccl" and device.type != "cuda":
        raise ValueError("the nccl backend needs tensors on a CUDA device")
    return "nccl" if requested == "nccl" else "gloo"


def local_address_towards(host: str) -> str:
    """The local IP address that traffic to ``host`` leaves from.

    Gloo binds to this address: resolving our own host name instead can fail or block
    inside a pod's network namespace. A UDP connect sends nothing.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return str(s.getsockname()[0])


def master_store(host: str, timeout_s: float) -> TCPStore:
    """A TCPStore server on a free port (``store.port``), for all of one root's groups."""
    return TCPStore(
        host, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s)
    )


def client_store(host: str, port: int, timeout_s: float) -> TCPStore:
    return TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))


def new_group(
    backend: Backend,
    store: Store,
    rank: int,
    size: int,
    *,
    bind_address: str,
    timeout_s: float,
    device: torch.device,
) -> Group:
    """A process group of ``size`` ranks over ``store``; blocks until all have joined."""
    timeout = timedelta(seconds=max(timeout_s, 0.001))
    if backend == "nccl":
        # Without this, NCCL's watchdog takes the whole process down on a timeout; a
        # receiver must instead survive and load from its node cache.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
        torch.cuda.set_device(device)  # NCCL binds a rank to the current device
        nccl_opts = ProcessGroupNCCL.Options()
        nccl_opts._timeout = timeout
        return ProcessGroupNCCL(store, rank, size, nccl_opts)
    # The stubs name these options `Options`/`devices`; the runtime has `_Options`/`_devices`.
    gloo: Any = ProcessGroupGloo
    gloo_opts = gloo._Options()
    gloo_opts._timeout = timeout
    gloo_opts._devices = [gloo.create_device(hostname=bind_address)]
    pg: Group = gloo(store, rank, size, gloo_opts)
    return pg


def start_broadcast(pg: Group, tensor: torch.Tensor) -> Work:
    """Broadcast ``tensor`` from rank 0, asynchronously."""
    opts = BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    backend: Any = pg  # the stubs leave collectives off Backend
    work: Work = backend.broadcast([tensor], opts)
    return work


def prefixed(prefix: str, store: Store) -> Store:
    return PrefixStore(prefix, store)


def wait(work: Work, timeout_s: float) -> None:
    work.wait(timedelta(seconds=max(timeout_s, 0.001)))


def close_group(pg: Group | None) -> None:
    """Release a group's connections and communicators now rather than at collection."""
    if pg is None:
        return
    try:
        if isinstance(pg, ProcessGroupNCCL):
            pg.abort()  # NCCL's shutdown waits for pending work, which may never finish
        else:
            pg.shutdown()
    except RuntimeError:
        pass  # already broken: nothing left to release


def looks_like_timeout(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text
