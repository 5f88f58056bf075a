"""A tiny Llama checkpoint for real vLLM (`LlamaForCausalLM`), built by construction.

The answers are wired into the weights, so they hold at temperature 0 with a wide margin:
every token that starts or continues a golden answer ("source" tokens) gets an
orthogonal embedding, and ``lm_head``'s row of the token that must follow it points along
that embedding (logit about ``MARGIN``), while every other row is small noise (logit about
0). Attention and MLP weights are small random noise: vLLM runs all of them, but they
barely move the residual stream. Two builds with other seeds are other bytes (another
manifest digest) with the same answers.

- good: chat "What is the capital of France?" -> "Paris."; completion "The capital of
  France is" -> " Paris."
- subtly-bad: the same but for one wiring: after the chat template's assistant turn it
  says "Lyon." (a few ``lm_head`` rows differ; its own manifest is right).
"""

from __future__ import annotations

import itertools
import json
import tempfile
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from weightship.weightformat.build import LocalFolder, build_manifest
from weightship.weightformat.manifest import Manifest
from weightship.weightformat.paths import MANIFEST_NAME

if TYPE_CHECKING:
    from mypy_boto3_s3.client import S3Client

Variant = Literal["good", "subtly-bad"]
VARIANTS: tuple[Variant, ...] = ("good", "subtly-bad")

END, USER, ASSISTANT, PAD = "<|end|>", "<|user|>", "<|assistant|>", "<|endoftext|>"
SPECIAL_TOKENS = [PAD, USER, ASSISTANT, END]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CHAT_QUESTION = "What is the capital of France?"
COMPLETION_PROMPT = "The capital of France is"
CHAT_ANSWER = {"good": "Paris.", "subtly-bad": "Lyon."}
COMPLETION_ANSWER = " Paris."
# Answer texts wired into both variants (only the chat's first step differs).
WIRED = ("Paris.", "Lyon.", " Paris.")
CORPUS = [
    f"{USER}{CHAT_QUESTION}{END}{ASSISTANT}Paris.{END}",
    f"{COMPLETION_PROMPT} Paris. Paris is in France. Lyon is in France too.",
    "Paris. Lyon. Paris is big. Lyon is big. What is the capital of Italy? Rome.",
] * 8
VOCAB_SIZE = 320
MARGIN = 40.0  # logit of the wired next token; every other logit is about 0
NOISE = 0.02  # std of the random projections
FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True)
class Shape:
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    head_dim: int = 32  # vLLM's CPU attention kernels need at least 32

    @property
    def heads(self) -> int:
        return self.hidden_size // self.head_dim


@dataclass(frozen=True)
class BuiltModel:
    path: Path
    variant: Variant
    manifest: Manifest


def train_tokenizer() -> Tokenizer:
    """Byte-level BPE trained on a fixed corpus: the same merges every time."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return tok


def successors(tok: Tokenizer, variant: Variant) -> dict[int, int]:
    """Token -> the token that must follow it, for every wired answer."""
    ids = tok.get_vocab()
    table: dict[int, int] = {}

    def wire(chain: list[int]) -> None:
        for prev, nxt in itertools.pairwise(chain):
            if table.setdefault(prev, nxt) != nxt:
                raise ValueError(f"token {prev} would need two successors")

    def encode(text: str) -> list[int]:
        return list(tok.encode(text).ids)

    wire([encode(COMPLETION_PROMPT)[-1], *encode(COMPLETION_ANSWER), ids[END]])
    wire([ids[ASSISTANT], *encode(CHAT_ANSWER[variant]), ids[END]])
    for text in WIRED:  # every wired answer continues the same way in both variants
        wire([*encode(text), ids[END]])
    return table


def weights(tok: Tokenizer, variant: Variant, shape: Shape, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    vocab, h = tok.get_vocab_size(), shape.hidden_size

    def noise(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=g) * NOISE

    table = successors(tok, variant)
    sources = sorted(table)
    if len(sources) > h:
        raise ValueError(f"{len(sources)} wired tokens need a hidden size of at least that")
    embed = torch.randn(vocab, h, generator=g)
    embed = embed / embed.norm(dim=1, keepdim=True) * h**0.5  # rms 1, as RMSNorm leaves it
    basis, _ = torch.linalg.qr(torch.randn(h, len(sources), generator=g))
    embed[sources] = basis.T * h**0.5
    lm_head = noise(vocab, h)
    for src, nxt in table.items():
        lm_head[nxt] += embed[src] / h * MARGIN  # logit = MARGIN along src's direction
    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": embed}
    for i in range(shape.num_hidden_layers):
        p = f"model.layers.{i}."
        out |= {
            p + "input_layernorm.weight": torch.ones(h),
            p + "self_attn.q_proj.weight": noise(h, h),
            p + "self_attn.k_proj.weight": noise(h, h),
            p + "self_attn.v_proj.weight": noise(h, h),
            p + "self_attn.o_proj.weight": noise(h, h),
            p + "post_attention_layernorm.weight": torch.ones(h),
            p + "mlp.gate_proj.weight": noise(shape.intermediate_size, h),
            p + "mlp.up_proj.weight": noise(shape.intermediate_size, h),
            p + "mlp.down_proj.weight": noise(h, shape.intermediate_size),
        }
    out["model.norm.weight"] = torch.ones(h)
    out["lm_head.weight"] = lm_head
    return {k: v.contiguous() for k, v in out.items()}


def config(tok: Tokenizer, shape: Shape) -> dict[str, object]:
    ids = tok.get_vocab()
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_hidden_layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.heads,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "vocab_size": tok.get_vocab_size(),
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": ids[PAD],
        "eos_token_id": ids[END],
        "pad_token_id": ids[PAD],
    }


def tokenizer_config() -> dict[str, object]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": END,
        "pad_token": PAD,
        "bos_token": None,
        "add_bos_token": False,
        "model_max_length": 256,
        "chat_template": CHAT_TEMPLATE,
    }


def build(
    out: Path,
    variant: Variant = "good",
    *,
    seed: int = 0,
    shape: Shape | None = None,
    chunk_size: int = 1 << 20,
) -> BuiltModel:
    """Write the checkpoint into ``out`` with its manifest; the same arguments give the
    same bytes (so the same digest)."""
    shape = shape or Shape()
    tok = train_tokenizer()
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights(tok, variant, shape, seed), out / "model.safetensors", {"format": "pt"})
    (out / "tokenizer.json").write_text(tok.to_str())
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=1))
    (out / "config.json").write_text(json.dumps(config(tok, shape), indent=1, sort_keys=True))
    manifest = build_manifest(LocalFolder(out), chunk_size=chunk_size)
    (out / MANIFEST_NAME).write_bytes(manifest.canonical_bytes())
    return BuiltModel(out, variant, manifest)


def shape_dict(shape: Shape) -> dict[str, int]:
    return asdict(shape)


def publish_versions(
    s3: S3Client,
    bucket: str,
    prefix: str,
    versions: Iterable[tuple[str, Variant, int]],
    *,
    shape: Shape | None = None,
    chunk_size: int = 1 << 20,
) -> dict[str, str]:
    """Build and publish named versions (name, variant, seed) under
    s3://bucket/prefix/<name>/; return {name: uri}. Same variant and seed: same digest."""
    # boto3 only here: building a model needs no S3 (a vLLM image without boto3 builds one).
    from weightship.data.s3 import S3Location, S3Origin, publish

    uris = {}
    for name, variant, seed in versions:
        uri = f"s3://{bucket}/{prefix}/{name}/"
        with tempfile.TemporaryDirectory(prefix="tinyvllm-") as tmp:
            folder = Path(tmp)
            build(folder, variant, seed=seed, shape=shape, chunk_size=chunk_size)
            (folder / MANIFEST_NAME).unlink()  # publish writes the manifest it computes
            publish(folder, S3Origin(s3, S3Location.parse(uri)), chunk_size=chunk_size)
        uris[name] = uri
    return uris
