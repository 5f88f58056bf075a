"""Broadcast seeding: new replicas take their weights from a loaded, verified replica over
torch.distributed (NCCL on GPU, gloo on CPU) instead of reading them from the node cache.

Root (a Ready replica's server)::

    root = SeedRoot(loaded.tensors, manifest, host=pod_ip, name=pod_name)
    # POST JOIN_PATH -> handle_join(root, body); GET STATUS_PATH -> handle_status(root)

Receiver (a new replica, at startup)::

    config = SeedConfig.from_env(os.environ)
    try:
        tensors = config.receive(manifest, device=device).tensors if config else None
    except SeedingError as exc:
        if not exc.fall_back:
            raise  # ChecksumMismatch: corrupted bytes; never serve, never turn Ready
        tensors = None
    if tensors is None:
        tensors = load_model(cache_dir, manifest, device=device).tensors

See docs/seeding.md for the protocol, failure handling and the tensor-parallel plan.
"""

from weightship.seeding.buckets import DEFAULT_BUCKET_BYTES, BucketPlan, TensorSpec, plan_buckets
from weightship.seeding.config import SeedConfig
from weightship.seeding.endpoints import handle_join, handle_status, serve
from weightship.seeding.errors import SeedingError
from weightship.seeding.faults import FAULT_ENV, Faults
from weightship.seeding.protocol import JOIN_PATH, STATUS_PATH
from weightship.seeding.receiver import Received, receive
from weightship.seeding.root import SeedRecord, SeedRoot

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "FAULT_ENV",
    "JOIN_PATH",
    "STATUS_PATH",
    "BucketPlan",
    "Faults",
    "Received",
    "SeedConfig",
    "SeedRecord",
    "SeedRoot",
    "SeedingError",
    "TensorSpec",
    "handle_join",
    "handle_status",
    "plan_buckets",
    "receive",
    "serve",
]
