"""A byte-level tokenizer over 7-bit ASCII: token id = byte value.

Two control bytes mark text boundaries: STX (2) begins the context (the model reads a few
of them before the prompt, so every position has a full window of earlier tokens) and ETX
(3) ends a completion. Anything that is not printable ASCII, a newline or a tab becomes '?'.
"""

from __future__ import annotations

VOCAB_SIZE = 128
BOS = 2  # STX, "start of text"
EOS = 3  # ETX, "end of text"
UNKNOWN = ord("?")
_KEPT_CONTROLS = {ord("\n"), ord("\t")}


def _is_text(byte: int) -> bool:
    return 32 <= byte < 127 or byte in _KEPT_CONTROLS


def encode(text: str) -> list[int]:
    return [ord(ch) if ord(ch) < VOCAB_SIZE and _is_text(ord(ch)) else UNKNOWN for ch in text]


def decode(ids: list[int]) -> str:
    """Text tokens only: boundary markers and other control bytes are dropped."""
    return "".join(chr(i) for i in ids if 0 <= i < VOCAB_SIZE and _is_text(i))
