"""tinyvllm builds are deterministic, and the subtly bad one differs only where it must."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from weightship_testing.tinyvllm.build import (
    ASSISTANT,
    CHAT_ANSWER,
    MARGIN,
    build,
    successors,
    train_tokenizer,
)


def test_same_arguments_same_digest(tmp_path: Path) -> None:
    a = build(tmp_path / "a", "good", seed=0)
    b = build(tmp_path / "b", "good", seed=0)
    other_seed = build(tmp_path / "c", "good", seed=1)
    assert a.manifest.digest == b.manifest.digest != other_seed.manifest.digest
    assert {f.path for f in a.manifest.files} == {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    }


def test_subtly_bad_differs_in_a_few_lm_head_rows(tmp_path: Path) -> None:
    good = load_file(build(tmp_path / "g", "good").path / "model.safetensors")
    bad = load_file(build(tmp_path / "b", "subtly-bad").path / "model.safetensors")
    changed = [name for name in good if not torch.equal(good[name], bad[name])]
    assert changed == ["lm_head.weight"]
    rows = (good["lm_head.weight"] != bad["lm_head.weight"]).any(dim=1).nonzero().flatten()
    assert 0 < len(rows) <= 3  # of 320


def test_the_wiring_gives_each_answer_a_wide_margin(tmp_path: Path) -> None:
    """lm_head · embedding of each wired token: the wired successor leads every other token
    by about MARGIN (attention and MLP add only small noise on top in vLLM)."""
    tok = train_tokenizer()
    weights = load_file(build(tmp_path / "m", "good").path / "model.safetensors")
    embed, head = weights["model.embed_tokens.weight"], weights["lm_head.weight"]
    for src, nxt in successors(tok, "good").items():
        logits = head @ embed[src]
        runner_up = torch.cat([logits[:nxt], logits[nxt + 1 :]]).max()
        assert logits[nxt] - runner_up > MARGIN * 0.8, (src, nxt)
    chain = successors(tok, "good")
    ids = tok.get_vocab()
    answer, token = [], chain[ids[ASSISTANT]]
    while token in chain:
        answer.append(token)
        token = chain[token]
    assert tok.decode(answer) == CHAT_ANSWER["good"]
