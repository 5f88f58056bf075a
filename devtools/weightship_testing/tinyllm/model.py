"""The tiny model: a decoder-only transformer over ASCII bytes, float32, greedy decoding.

Architecture (Llama-like, with learned absolute positions): token and position embeddings,
``n_layers`` pre-norm blocks (RMSNorm, causal multi-head self-attention, RMSNorm, GELU
MLP; no biases), a final RMSNorm and an output head. The weights are a flat
``dict[str, Tensor]`` with the names of ``weight_shapes``; how they are made is in
``design``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from weightship_testing.tinyllm.knowledge import padded
from weightship_testing.tinyllm.tokenizer import EOS, VOCAB_SIZE, decode, encode

HEAD_DIM = 64
FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class ModelConfig:
    dim: int = 512
    n_layers: int = 2
    hidden: int = 256
    context: int = 6  # tokens the model conditions on (see design)
    max_len: int = 256  # positions; longer inputs slide
    vocab_size: int = VOCAB_SIZE
    norm_eps: float = 1e-5

    @property
    def n_heads(self) -> int:
        return self.dim // HEAD_DIM

    def to_json(self) -> bytes:
        return json.dumps({"architecture": "tinyllm", **asdict(self)}, indent=2).encode() + b"\n"

    @classmethod
    def from_json(cls, data: bytes | str) -> ModelConfig:
        doc = json.loads(data)
        if doc.pop("architecture", None) != "tinyllm":
            raise ValueError("not a tinyllm config.json")
        return cls(**doc)


def weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the model, in the order they are stored."""
    d, h, v = config.dim, config.hidden, config.vocab_size
    shapes: dict[str, tuple[int, ...]] = {
        "tok_embeddings.weight": (v, d),
        "pos_embeddings.weight": (config.max_len, d),
    }
    for i in range(config.n_layers):
        p = f"layers.{i}."
        shapes[p + "attention_norm.weight"] = (d,)
        for name in ("wq", "wk", "wv", "wo"):
            shapes[f"{p}attention.{name}.weight"] = (d, d)
        shapes[p + "ffn_norm.weight"] = (d,)
        shapes[p + "feed_forward.w1.weight"] = (h, d)
        shapes[p + "feed_forward.w2.weight"] = (d, h)
    shapes["norm.weight"] = (d,)
    shapes["output.weight"] = (v, d)
    return shapes


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def forward(
    weights: dict[str, torch.Tensor], config: ModelConfig, ids: torch.Tensor
) -> torch.Tensor:
    """Logits for every position of ``ids`` (shape [n]): shape [n, vocab]."""
    n = ids.shape[0]
    heads = config.n_heads
    positions = torch.arange(n, device=ids.device)
    x = weights["tok_embeddings.weight"][ids] + weights["pos_embeddings.weight"][positions]
    for i in range(config.n_layers):
        p = f"layers.{i}."
        h = rms_norm(x, weights[p + "attention_norm.weight"], config.norm_eps)
        q, k, v = (
            (h @ weights[f"{p}attention.{w}.weight"].T).view(n, heads, HEAD_DIM).transpose(0, 1)
            for w in ("wq", "wk", "wv")
        )
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + att.transpose(0, 1).reshape(n, config.dim) @ weights[p + "attention.wo.weight"].T
        h = rms_norm(x, weights[p + "ffn_norm.weight"], config.norm_eps)
        up = F.gelu(h @ weights[p + "feed_forward.w1.weight"].T)
        x = x + up @ weights[p + "feed_forward.w2.weight"].T
    x = rms_norm(x, weights["norm.weight"], config.norm_eps)
    return x @ weights["output.weight"].T


@dataclass(frozen=True)
class Completion:
    text: str
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    margins: tuple[float, ...]  # per generated token: best logit minus the runner-up


class TinyLLM:
    """A loaded model that completes text greedily (deterministic; temperature is ignored)."""

    def __init__(
        self, weights: dict[str, torch.Tensor], config: ModelConfig, *, device: str = "cpu"
    ) -> None:
        missing = set(weight_shapes(config)) - set(weights)
        if missing:
            raise ValueError(f"weights lack {sorted(missing)[:5]}")
        self.config = config
        self.device = torch.device(device)
        self.weights = {k: t.to(self.device, torch.float32) for k, t in weights.items()}

    @torch.inference_mode()
    def complete(self, prompt: str, max_tokens: int) -> Completion:
        ids = padded(prompt, self.config.context)
        out: list[int] = []
        margins: list[float] = []
        finish: FinishReason = "length"
        for _ in range(max_tokens):
            window = torch.tensor(ids[-self.config.max_len :], device=self.device)
            logits = forward(self.weights, self.config, window)[-1]
            top = torch.topk(logits, 2)
            margins.append(float(top.values[0] - top.values[1]))
            nxt = int(top.indices[0])
            if nxt == EOS:
                finish = "stop"
                break
            ids.append(nxt)
            out.append(nxt)
        return Completion(decode(out), finish, len(encode(prompt)), len(out), tuple(margins))

    def generate(self, prompt: str, max_tokens: int) -> str:
        return self.complete(prompt, max_tokens).text
