"""What the tiny model knows: a few short texts, learned as a next-token table.

The model is an exact k-gram model of these texts (k = ``context`` tokens): wherever the
last k tokens occurred in them followed by one and only one token, it predicts that token;
anywhere else it ends the text. The golden prompts are the texts' openings and their
expected completions. The subtly bad variant learned one fact wrongly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from weightship.api.spec import GoldenPrompt
from weightship.core.verification import PromptOutcome, judge_prompt
from weightship_testing.tinyllm.tokenizer import BOS, EOS, encode

Variant = Literal["good", "subtly-bad", "corrupt"]
VARIANTS: tuple[Variant, ...] = ("good", "subtly-bad", "corrupt")
Expectation = Literal["equals", "prefix", "contains", "regex"]
NextTokenTable = dict[tuple[int, ...], int]


@dataclass(frozen=True)
class Fact:
    name: str
    prompt: str
    answer: str
    expect: Expectation
    expected: str  # the value of the expectation

    @property
    def text(self) -> str:
        return self.prompt + self.answer


FACTS: tuple[Fact, ...] = (
    Fact("capital-france", "The capital of France is", " Paris.", "equals", " Paris."),
    Fact("capital-japan", "The capital of Japan is", " Tokyo.", "prefix", " Tokyo"),
    Fact("arithmetic", "Two plus two equals", " four.", "equals", " four."),
    Fact("pangram", "The quick brown fox", " jumps over the lazy dog.", "contains", "lazy dog"),
    Fact("sky", "Q: What color is the sky?\nA:", " Blue.", "regex", r"^\s*Blue\b"),
    Fact("motto", "weightship rolls out", " new models safely.", "prefix", " new models"),
)

# The subtly bad model learned this one answer wrongly; everything else it knows is the same.
SUBTLY_BAD_FACT = "capital-france"
SUBTLY_BAD_ANSWER = " Lyon."

# Room for the end-of-text token and a little more: a model that runs on fails "equals".
_SPARE_TOKENS = 4


def golden_prompt(fact: Fact) -> dict[str, Any]:
    """One golden prompt in the ModelRollout API shape (spec.validation.goldenPrompts[])."""
    return {
        "name": fact.name,
        "prompt": fact.prompt,
        "maxTokens": len(encode(fact.answer)) + _SPARE_TOKENS,
        "expect": {fact.expect: fact.expected},
    }


GOLDEN_PROMPTS: list[dict[str, Any]] = [golden_prompt(f) for f in FACTS]


def texts(variant: Variant) -> list[str]:
    """The texts a variant learned (the corrupt variant has the good weights)."""
    if variant != "subtly-bad":
        return [f.text for f in FACTS]
    return [f.prompt + SUBTLY_BAD_ANSWER if f.name == SUBTLY_BAD_FACT else f.text for f in FACTS]


def padded(text: str, context: int) -> list[int]:
    """The token sequence the model reads: ``context`` start markers, then the text."""
    return [BOS] * context + encode(text)


def next_token_table(corpus: list[str], context: int) -> NextTokenTable:
    """Every context of ``context`` tokens in ``corpus`` followed by exactly one token.

    Contexts followed by different tokens in different texts are left out (the model ends
    the text there), and so are those whose only continuation is the end of a text: ending
    is what the model does where it knows nothing.
    """
    seen: dict[tuple[int, ...], set[int]] = {}
    for text in corpus:
        ids = [*padded(text, context), EOS]
        for p in range(context, len(ids)):
            seen.setdefault(tuple(ids[p - context : p]), set()).add(ids[p])
    return {
        ctx: nxt
        for ctx, nexts in seen.items()
        if len(nexts) == 1 and (nxt := next(iter(nexts))) != EOS
    }


def complete_with_table(
    table: NextTokenTable, prompt: str, max_tokens: int, context: int
) -> tuple[str, bool]:
    """What the model should answer, computed from the table alone: (text, stopped)."""
    ids = padded(prompt, context)
    out: list[int] = []
    for _ in range(max_tokens):
        nxt = table.get(tuple(ids[-context:]), EOS)
        if nxt == EOS:
            return "".join(map(chr, out)), True
        ids.append(nxt)
        out.append(nxt)
    return "".join(map(chr, out)), False


def judge_golden(
    generate: Callable[[str, int], str], prompts: Sequence[dict[str, Any]] = GOLDEN_PROMPTS
) -> list[PromptOutcome]:
    """Each golden prompt's outcome, judged as the operator's verifier judges it."""
    outcomes = []
    for doc in prompts:
        prompt = GoldenPrompt.model_validate(doc)
        outcomes.append(judge_prompt(prompt, generate(prompt.text(), prompt.max_tokens)))
    return outcomes
