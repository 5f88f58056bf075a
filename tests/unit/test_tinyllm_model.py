"""The tiny reference model: real torch, real files. Golden prompts, variants, determinism."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from weightship.weightformat.build import LocalFolder, build_manifest
from weightship.weightformat.manifest import Manifest
from weightship.weightformat.paths import MANIFEST_NAME
from weightship_testing.tinyllm import GOLDEN_PROMPTS
from weightship_testing.tinyllm.__main__ import main as cli
from weightship_testing.tinyllm.build import (
    BuiltModel,
    build,
    config_for_size,
    load_folder,
    model_bytes,
)
from weightship_testing.tinyllm.knowledge import (
    FACTS,
    SUBTLY_BAD_FACT,
    complete_with_table,
    judge_golden,
    next_token_table,
    texts,
)
from weightship_testing.tinyllm.model import TinyLLM
from weightship_testing.tinyllm.tokenizer import decode, encode

MiB = 1 << 20


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, BuiltModel]:
    root = tmp_path_factory.mktemp("tinyllm")
    return {v: build(root / v, v, chunk_size=1 * MiB) for v in ("good", "subtly-bad", "corrupt")}


@pytest.fixture(scope="module")
def good(built: dict[str, BuiltModel]) -> TinyLLM:
    return load_folder(built["good"].path)


@pytest.fixture(scope="module")
def subtly_bad(built: dict[str, BuiltModel]) -> TinyLLM:
    return load_folder(built["subtly-bad"].path)


def test_good_model_passes_every_golden_prompt_with_a_wide_margin(good: TinyLLM) -> None:
    outcomes = judge_golden(good.generate)
    assert [o.name for o in outcomes] == [p["name"] for p in GOLDEN_PROMPTS]
    assert all(o.passed for o in outcomes), [o.diff() for o in outcomes if not o.passed]
    for fact in FACTS:
        done = good.complete(fact.prompt, 40)
        assert (done.text, done.finish_reason) == (fact.answer, "stop")
        # Greedy decoding never hinges on a near-tie, whatever the CPU's rounding.
        assert min(done.margins) > 5, (fact.name, done.margins)


def test_subtly_bad_model_fails_one_golden_prompt_with_a_readable_diff(
    subtly_bad: TinyLLM,
) -> None:
    outcomes = judge_golden(subtly_bad.generate)
    failed = [o for o in outcomes if not o.passed]
    assert [o.name for o in failed] == [SUBTLY_BAD_FACT]
    assert failed[0].diff() == (
        'golden prompt \'capital-france\': expected equals " Paris.", got " Lyon."'
    )
    assert sum(o.passed for o in outcomes) == len(GOLDEN_PROMPTS) - 1


def test_subtly_bad_weights_differ_from_good_in_a_few_neurons(
    built: dict[str, BuiltModel],
) -> None:
    def tensors(model: BuiltModel) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for shard in sorted(model.path.glob("*.safetensors")):
            out.update(load_file(shard))
        return out

    good, bad = tensors(built["good"]), tensors(built["subtly-bad"])
    assert good.keys() == bad.keys()
    changed = {name for name in good if not torch.equal(good[name], bad[name])}
    assert changed == {"layers.0.feed_forward.w1.weight", "layers.0.feed_forward.w2.weight"}
    w1, w2 = "layers.0.feed_forward.w1.weight", "layers.0.feed_forward.w2.weight"
    neurons = (good[w1] != bad[w1]).any(dim=1) | (good[w2] != bad[w2]).any(dim=0)
    changed_neurons = int(neurons.sum())
    assert 1 <= changed_neurons <= 8
    total = sum(t.numel() for t in good.values())
    differing = sum(int((good[n] != bad[n]).sum()) for n in changed)
    assert differing / total < 0.01


def test_each_variant_has_a_valid_manifest_of_its_own_bytes_except_corrupt(
    built: dict[str, BuiltModel],
) -> None:
    for variant, model in built.items():
        on_disk = Manifest.parse((model.path / MANIFEST_NAME).read_bytes())
        assert on_disk.digest == model.manifest.digest
        actual = build_manifest(LocalFolder(model.path), chunk_size=on_disk.chunk_size)
        if variant == "corrupt":
            assert actual.digest != on_disk.digest
            bad_chunks = set(actual.chunks) - set(on_disk.chunks)
            assert len(bad_chunks) == 1  # a few bytes in one chunk of one shard
            assert on_disk.digest == built["good"].manifest.digest  # it claims to be good
        else:
            assert actual.digest == on_disk.digest
    assert built["subtly-bad"].manifest.digest != built["good"].manifest.digest


def test_builds_are_deterministic(tmp_path: Path, built: dict[str, BuiltModel]) -> None:
    again = build(tmp_path / "again", "good", chunk_size=1 * MiB)
    assert again.manifest.digest == built["good"].manifest.digest


def test_the_transformer_computes_its_next_token_table(good: TinyLLM) -> None:
    """Any prompt, not only golden ones: the network's greedy output is the table's."""
    context = good.config.context
    table = next_token_table(texts("good"), context)
    rng = random.Random(7)
    corpus = texts("good")
    prompts = ["", "Hello", "The capital of ", "The capital of F", "nonsense ~{}|"]
    for _ in range(6):
        text = rng.choice(corpus)
        prompts.append(text[: rng.randrange(1, len(text))])
    for prompt in prompts:
        want, stopped = complete_with_table(table, prompt, 12, context)
        done = good.complete(prompt, 12)
        assert done.text == want, prompt
        assert done.finish_reason == ("stop" if stopped else "length")


def test_long_prompts_slide_past_the_position_window(good: TinyLLM) -> None:
    prompt = "z" * (good.config.max_len + 50) + "The capital of Japan is"
    assert good.generate(prompt, 10) == " Tokyo."


def test_tokenizer_maps_everything_outside_ascii_text_to_a_question_mark() -> None:
    assert decode(encode("Grüße\tau\n")) == "Gr??e\tau\n"
    assert encode("A") == [65]


@pytest.mark.parametrize("target", [64 * MiB, 512 * MiB])
def test_sized_configs_come_close_to_the_requested_size(target: int) -> None:
    got = model_bytes(config_for_size(target))
    assert 0.85 * target < got < 1.15 * target
    assert model_bytes(config_for_size(None)) < 16 * MiB


def test_build_cli_writes_a_variant_and_prints_its_digest(tmp_path: Path) -> None:
    out = tmp_path / "bad"
    result = CliRunner().invoke(
        cli, ["build", "--variant", "subtly-bad", "--out", str(out), "--chunk-size", "1Mi"]
    )
    assert result.exit_code == 0, result.output
    printed = json.loads(result.output)
    manifest = Manifest.parse((out / MANIFEST_NAME).read_bytes())
    assert printed == {"path": str(out), "variant": "subtly-bad", "digest": manifest.digest}
    assert manifest.chunk_size == MiB
    assert load_folder(out).generate("The capital of France is", 10) == " Lyon."
