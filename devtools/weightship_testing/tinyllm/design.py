"""Weights made by construction: block 0 computes the next-token table exactly.

Layout of the residual stream (``dim`` wide; ``k`` = config.context):

    [0, 64)                    CUR      the current token's code
    [64·d, 64·d + 64)          SLOT d   the code of the token d positions back, d = 1..k-1
    [64·k, 64·k + 64)          OUT      the code of the predicted next token
    POS = 64·(k+1), 2·F wide   position i as (cos, sin)(π·i / 2^f), f = 0..F-1
    POS + 2·F                  ONE      always 1: a bias that standard blocks lack
    the rest                   random embedding noise

Token codes are ± rows of a 64x64 Hadamard matrix (128 tokens, two per row, opposite
signs): two different tokens' codes are orthogonal or opposite, never similar.

- Attention head d-1 of block 0 attends from position i to exactly i-d. Its query rotates
  i's position to i-d; the score sum_f cos(π·(i-d-j)/2^f) is F at j = i-d and at most
  F-2 anywhere else within 2^F positions, so a scale of 20 per unit puts every other key
  e^-40 behind. Its value/output copy CUR into SLOT d.
- MLP neuron e of block 0 is table entry e: it adds up, slot by slot, the cosine between
  what the slot holds and the entry's context (1 on a match, 0 or -1 otherwise), minus
  k - 1/2 (through ONE). Only a full match is positive (+10 after scaling; anything else is
  -10 or less, where GELU is ~1e-23); it writes the next token's code into OUT.
- The output head reads OUT (a match: ~+40 for its token, <= 0 for the others) and, for
  end-of-text only, ONE (+16), so where no entry matches the model ends the text.
- Blocks 1.. carry small random weights (GPT-2-style init, output projections scaled by
  1/sqrt(2·layers)); they add noise of about 0.1 to the logits, far below the margins.
"""

from __future__ import annotations

import math

import torch

from weightship_testing.tinyllm.knowledge import NextTokenTable
from weightship_testing.tinyllm.model import HEAD_DIM, ModelConfig, weight_shapes
from weightship_testing.tinyllm.tokenizer import EOS

CODE = 64
TOKEN_SCALE = 8.0  # code entries are ±1 in the stream
ATTENTION_SCALE = 160.0  # score per unit of the position sum, before 1/sqrt(HEAD_DIM)
MATCH_SCALE = 20.0  # MLP pre-activation per matched slot
OUT_SCALE = 16.0  # norm of the predicted token's code in OUT
LOGIT_SCALE = 3.0
END_BIAS = 16.0
RANDOM_STD = 0.01

Neurons = list[tuple[int, ...] | None]


def position_frequencies(max_len: int) -> int:
    """F, so that the position code repeats only after 2^F > max_len positions."""
    return max_len.bit_length()


def design_dims(context: int, max_len: int) -> int:
    return CODE * (context + 1) + 2 * position_frequencies(max_len) + 1


def hadamard(n: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def token_codes(vocab_size: int) -> torch.Tensor:
    """[vocab, CODE] unit vectors: token t is ±row (t mod CODE) of a Hadamard matrix."""
    rows = hadamard(CODE) / math.sqrt(CODE)
    sign = torch.tensor([1.0 if t < CODE else -1.0 for t in range(vocab_size)])
    return rows[torch.arange(vocab_size) % CODE] * sign[:, None]


def neuron_order(table: NextTokenTable, reference: Neurons | None, hidden: int) -> Neurons:
    """Which table entry each MLP neuron of block 0 holds (None: unused).

    With a ``reference`` (the good model's order), entries it has keep their neurons and
    new ones take the freed neurons, so a variant that learned one fact differently
    differs from the good model in a handful of neurons, not in all of them.
    """
    if len(table) > hidden:
        raise ValueError(f"{len(table)} table entries need hidden >= {len(table)}, got {hidden}")
    if reference is None:
        return [*sorted(table), *[None] * (hidden - len(table))]
    order = [ctx if ctx in table else None for ctx in reference]
    placed = {ctx for ctx in order if ctx is not None}
    new = iter(sorted(ctx for ctx in table if ctx not in placed))
    return [ctx if ctx is not None else next(new, None) for ctx in order]


def design_weights(
    config: ModelConfig, table: NextTokenTable, neurons: Neurons, *, seed: int = 0
) -> dict[str, torch.Tensor]:
    k, d = config.context, config.dim
    if design_dims(k, config.max_len) > d:
        raise ValueError(f"dim {d} is too small: the design needs {design_dims(k, config.max_len)}")
    if k - 1 > config.n_heads:
        raise ValueError(f"context {k} needs {k - 1} heads, dim {d} gives {config.n_heads}")
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int, std: float = RANDOM_STD) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    w = {name: torch.zeros(shape) for name, shape in weight_shapes(config).items()}
    codes = token_codes(config.vocab_size)
    n_freq = position_frequencies(config.max_len)
    pos = CODE * (k + 1)
    one = pos + 2 * n_freq
    spare = slice(one + 1, d)

    def slot(s: int) -> slice:
        return slice(CODE * s, CODE * (s + 1))

    # Embeddings: the token's code, ONE, the position's (cos, sin) pairs; noise in spare dims.
    tok = w["tok_embeddings.weight"]
    tok[:, slot(0)] = codes * TOKEN_SCALE
    tok[:, one] = 1.0
    tok[:, spare] = randn(config.vocab_size, d - one - 1)
    positions = torch.arange(config.max_len, dtype=torch.float64)
    omegas = [math.pi / 2**f for f in range(n_freq)]
    for f, omega in enumerate(omegas):
        w["pos_embeddings.weight"][:, pos + 2 * f] = torch.cos(omega * positions).float()
        w["pos_embeddings.weight"][:, pos + 2 * f + 1] = torch.sin(omega * positions).float()

    # Block 0, attention: head d-1 copies the token d positions back into SLOT d.
    r0 = math.sqrt((TOKEN_SCALE**2 + n_freq + 1) / d)  # RMS of every embedding
    p = "layers.0."
    for back in range(1, k):
        head = slice(HEAD_DIM * (back - 1), HEAD_DIM * (back - 1) + HEAD_DIM)
        for f, omega in enumerate(omegas):
            q_rows = HEAD_DIM * (back - 1) + 2 * f
            cols = slice(pos + 2 * f, pos + 2 * f + 2)
            c, s = math.cos(omega * back), math.sin(omega * back)
            rotate_back = torch.tensor([[c, s], [-s, c]])  # rotation by -omega·back
            w[p + "attention.wq.weight"][q_rows : q_rows + 2, cols] = (
                rotate_back * ATTENTION_SCALE * r0
            )
            w[p + "attention.wk.weight"][q_rows : q_rows + 2, cols] = torch.eye(2) * r0
        w[p + "attention.wv.weight"][head, slot(0)] = torch.eye(CODE) * r0
        w[p + "attention.wo.weight"][slot(back), head] = torch.eye(CODE)

    # Block 0, MLP: neuron e fires only on its entry's full context, and writes its answer.
    r1 = math.sqrt((k * TOKEN_SCALE**2 + n_freq + 1) / d)  # RMS once every slot is filled
    w1, w2 = w[p + "feed_forward.w1.weight"], w[p + "feed_forward.w2.weight"]
    fired = torch.nn.functional.gelu(torch.tensor(MATCH_SCALE / 2)).item()
    for e, ctx in enumerate(neurons):
        if ctx is None:
            continue
        for back in range(k):  # ctx is oldest first; its last token is the current one
            w1[e, slot(back)] = codes[ctx[-1 - back]] * (MATCH_SCALE * r1 / TOKEN_SCALE)
        w1[e, one] = -MATCH_SCALE * (k - 0.5) * r1
        w2[slot(k), e] = codes[table[ctx]] * (OUT_SCALE / fired)

    # Blocks 1..: random, like a freshly initialised network.
    out_std = RANDOM_STD / math.sqrt(2 * config.n_layers)
    for i in range(1, config.n_layers):
        p = f"layers.{i}."
        for name in ("wq", "wk", "wv"):
            w[f"{p}attention.{name}.weight"] = randn(d, d)
        w[p + "attention.wo.weight"] = randn(d, d, std=out_std)
        w[p + "feed_forward.w1.weight"] = randn(config.hidden, d)
        w[p + "feed_forward.w2.weight"] = randn(d, config.hidden, std=out_std)
    for name, t in w.items():
        if name.endswith("norm.weight"):
            t.fill_(1.0)

    head_w = w["output.weight"]
    head_w[:] = randn(config.vocab_size, d)
    head_w[:, slot(k)] = codes * LOGIT_SCALE
    head_w[:, one] = 0.0
    head_w[EOS, one] = END_BIAS
    return {name: t.contiguous() for name, t in w.items()}
