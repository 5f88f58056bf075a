"""Model versions for tests and demos: good, subtly bad and corrupt, on disk or in S3.

- good: answers every golden prompt.
- subtly-bad: a correct manifest of its own bytes, but it learned one fact wrongly
  ("The capital of France is" -> " Lyon."); a handful of MLP neurons differ from good.
- corrupt: the manifest describes the good bytes, but a few bytes of one shard are flipped,
  so every verified load refuses it.

Builds are deterministic: the same variant, size and seed give the same bytes, hence the
same manifest digest.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file, save_file

from weightship.data.s3 import S3Location, S3Origin, publish
from weightship.weightformat.build import DEFAULT_CHUNK_SIZE, LocalFolder, build_manifest
from weightship.weightformat.manifest import Manifest
from weightship.weightformat.paths import MANIFEST_NAME
from weightship_testing.tinyllm.design import design_weights, neuron_order
from weightship_testing.tinyllm.knowledge import Variant, next_token_table, texts
from weightship_testing.tinyllm.model import ModelConfig, TinyLLM, weight_shapes

if TYPE_CHECKING:
    from mypy_boto3_s3.client import S3Client

CONFIG_NAME = "config.json"
SHARD_BYTES = 128 * 2**20
MIN_SHARDS = 2  # so that "one shard" of a corrupt model is never the whole model
FLIPPED_BYTES = 4
_BYTES_PER_PARAM = 4  # float32


@dataclass(frozen=True)
class BuiltModel:
    path: Path
    variant: Variant
    config: ModelConfig
    manifest: Manifest  # for corrupt: the manifest of the good bytes


def model_bytes(config: ModelConfig) -> int:
    return _BYTES_PER_PARAM * sum(math.prod(s) for s in weight_shapes(config).values())


def config_for_size(size: int | None) -> ModelConfig:
    """The smallest model (about 12 MB) or one of about ``size`` bytes: 4x-wide MLPs,
    512 wide below 128 MiB and 1024 above, and as many blocks as it takes."""
    small = ModelConfig()
    if size is None or size <= model_bytes(small):
        return small
    dim = 512 if size < 128 * 2**20 else 1024
    one = ModelConfig(dim=dim, n_layers=1, hidden=4 * dim)
    two = ModelConfig(dim=dim, n_layers=2, hidden=4 * dim)
    per_block = model_bytes(two) - model_bytes(one)
    layers = max(2, round((size - (model_bytes(one) - per_block)) / per_block))
    return ModelConfig(dim=dim, n_layers=layers, hidden=4 * dim)


def model_weights(
    variant: Variant, config: ModelConfig, *, seed: int = 0
) -> dict[str, torch.Tensor]:
    good = next_token_table(texts("good"), config.context)
    neurons = neuron_order(good, None, config.hidden)
    if variant != "subtly-bad":
        return design_weights(config, good, neurons, seed=seed)
    bad = next_token_table(texts(variant), config.context)
    return design_weights(config, bad, neuron_order(bad, neurons, config.hidden), seed=seed)


def shard_name(index: int, count: int) -> str:
    return f"model-{index:05d}-of-{count:05d}.safetensors"


def write_model(weights: dict[str, torch.Tensor], config: ModelConfig, out: Path) -> list[str]:
    """config.json and the weights in safetensors shards of about equal size; the names."""
    total = sum(t.numel() * t.element_size() for t in weights.values())
    count = max(MIN_SHARDS, math.ceil(total / SHARD_BYTES))
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(count)]
    done = 0
    for name, tensor in weights.items():  # in weight_shapes order: consecutive layers together
        shards[min(count - 1, done * count // total)][name] = tensor
        done += tensor.numel() * tensor.element_size()
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG_NAME).write_bytes(config.to_json())
    names = [shard_name(i, count) for i in range(1, count + 1)]
    for name, shard in zip(names, shards, strict=True):
        save_file(shard, out / name, metadata={"format": "pt"})
    return names


def corrupt_one_shard(folder: Path) -> Path:
    """Flip a few bytes in the middle of the last shard's tensor data (the header stays
    valid, so only a checksum can tell)."""
    shard = sorted(folder.glob("model-*.safetensors"))[-1]
    data = bytearray(shard.read_bytes())
    data_start = 8 + int.from_bytes(data[:8], "little")
    middle = data_start + (len(data) - data_start) // 2
    for i in range(middle, middle + FLIPPED_BYTES):
        data[i] ^= 0xFF
    shard.write_bytes(bytes(data))
    return shard


def build(
    out: Path,
    variant: Variant = "good",
    *,
    size: int | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    seed: int = 0,
) -> BuiltModel:
    """Write ``variant`` into ``out`` with its manifest (weightship-manifest.json)."""
    config = config_for_size(size)
    write_model(model_weights(variant, config, seed=seed), config, out)
    manifest = build_manifest(LocalFolder(out), chunk_size=chunk_size)
    (out / MANIFEST_NAME).write_bytes(manifest.canonical_bytes())
    if variant == "corrupt":
        corrupt_one_shard(out)
    return BuiltModel(out, variant, config, manifest)


def publish_variant(
    variant: Variant,
    origin: S3Origin,
    *,
    size: int | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    seed: int = 0,
    workers: int = 4,
) -> Manifest:
    """Upload ``variant`` and its manifest to ``origin``. A corrupt model is published
    good (so its manifest describes the good bytes), then one shard is replaced."""
    with tempfile.TemporaryDirectory(prefix="tinyllm-") as tmp:
        folder = Path(tmp)
        config = config_for_size(size)
        write_model(model_weights(variant, config, seed=seed), config, folder)
        manifest = publish(folder, origin, chunk_size=chunk_size, workers=workers)
        if variant == "corrupt":
            shard = corrupt_one_shard(folder)
            origin.upload_file(shard, shard.name, part_size=chunk_size, workers=workers)
        return manifest


def publish_versions(
    s3: S3Client,
    bucket: str,
    prefix: str,
    versions: Iterable[tuple[str, Variant, int]],
    *,
    chunk_size: int = 1 << 20,
) -> dict[str, str]:
    """Publish named versions (name, variant, seed) under s3://bucket/prefix/<name>/;
    return {name: uri}. The same variant and seed give the same manifest digest."""
    uris = {}
    for name, variant, seed in versions:
        uri = f"s3://{bucket}/{prefix}/{name}/"
        publish_variant(
            variant, S3Origin(s3, S3Location.parse(uri)), seed=seed, chunk_size=chunk_size
        )
        uris[name] = uri
    return uris


def load_folder(folder: Path, *, device: str = "cpu") -> TinyLLM:
    """Load a built model without verifying anything (tests, local experiments)."""
    config = ModelConfig.from_json((folder / CONFIG_NAME).read_bytes())
    weights: dict[str, torch.Tensor] = {}
    for shard in sorted(folder.glob("model-*.safetensors")):
        weights.update(load_file(shard))
    return TinyLLM(weights, config, device=device)
