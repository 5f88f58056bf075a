"""wsum64: a checksum of a tensor's bytes that a GPU computes as cheaply as a CPU.

The bytes, zero-padded to a multiple of 4, are read as little-endian int32 words w_i and
widened to int64. Then

    s1 = sum(w_i)                         mod 2**64
    s2 = sum(w_i * ((i mod 65521) + 1))   mod 2**64

and the checksum is s1 then s2, each as 16 hex digits. Both sums are plain integer
reductions: a GPU does them at memory speed with no hashing kernel, and numpy gives the
same answer on a CPU, so the manifest (written on a CPU) can vouch for what a broadcast
receiver holds in GPU memory without copying it back. s1 catches changed words; the
position weights in s2 catch words moved or swapped (less often than 65521 words apart).
It is not a cryptographic hash: the chunks' sha256 in the manifest is what defends
against forged bytes; this catches torn, truncated, misplaced or corrupted transfers.

Both implementations keep one accumulator per weight class (65521 int64, 512 KiB): word
i adds into slot i mod 65521. Then s1 is the sum of the slots and s2 their weighted sum.
Wrapping int64 arithmetic is arithmetic mod 2**64, so overflow anywhere is harmless.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from weightship.weightformat.layout import FileLayout

if TYPE_CHECKING:
    import torch

CHECKSUM_ALGO = "wsum64"
CHECKSUM_HEX_LEN = 32
MODULUS = 65521  # the largest prime below 2**16, as in Adler-32
_MASK = (1 << 64) - 1
# torch reduces this many rows of MODULUS words at a time: 16.8 MB of input, so a huge
# tensor never costs more than ~34 MiB of temporaries (one block widened to int64).
_ROWS_PER_BLOCK = 64
_BLOCK_BYTES = _ROWS_PER_BLOCK * MODULUS * 4

Buffer = bytes | bytearray | memoryview | npt.NDArray[np.generic]


def _encode(s1: int, s2: int) -> str:
    return f"{s1 & _MASK:016x}{s2 & _MASK:016x}"


class Wsum64:
    """Streaming wsum64 on the CPU: ``update`` with consecutive pieces, then ``hexdigest``.

    Pieces need not be word-aligned: up to 3 trailing bytes wait for the next piece.
    """

    def __init__(self) -> None:
        self._slots = np.zeros(MODULUS, dtype=np.int64)
        self._words = 0
        self._pending = b""

    def update(self, data: Buffer) -> Wsum64:
        raw = np.frombuffer(data, dtype=np.uint8)
        if self._pending:
            need = 4 - len(self._pending)
            head, raw = bytes(raw[:need]), raw[need:]
            self._pending += head
            if len(self._pending) < 4:
                return self
            self._add_words(np.frombuffer(self._pending, dtype="<i4"))
            self._pending = b""
        whole = len(raw) // 4 * 4
        self._add_words(raw[:whole].view("<i4"))
        self._pending = bytes(raw[whole:])
        return self

    def _add_words(self, words: npt.NDArray[np.int32]) -> None:
        # Row by row, each row a run of consecutive slots: numpy widens each int32 row
        # into the int64 slots in its inner loop, so there is no widened copy of the data.
        done = 0
        while done < len(words):
            phase = self._words % MODULUS
            take = min(MODULUS - phase, len(words) - done)
            self._slots[phase : phase + take] += words[done : done + take]
            done += take
            self._words += take

    def hexdigest(self) -> str:
        slots = self._slots
        if self._pending:
            slots = slots.copy()
            padded = self._pending.ljust(4, b"\0")
            slots[self._words % MODULUS] += np.frombuffer(padded, dtype="<i4")[0]
        weights = np.arange(1, MODULUS + 1, dtype=np.int64)
        return _encode(int(slots.sum()), int((slots * weights).sum()))


def checksum_bytes(buf: Buffer) -> str:
    """wsum64 of ``buf`` (bytes, a memoryview or a contiguous numpy array), on the CPU."""
    return Wsum64().update(buf).hexdigest()


def checksum_tensor(t: torch.Tensor) -> str:
    """wsum64 of the raw bytes of ``t`` (any dtype, bf16 included), computed on t's device.

    A non-contiguous tensor is checksummed as its contiguous copy would be. On a CPU this
    is numpy's implementation over the tensor's own memory (several times faster than
    torch's CPU kernels here); elsewhere ``checksum_on_device``.
    """
    if t.device.type == "cpu":
        return checksum_bytes(_raw_bytes(t).numpy())
    return checksum_on_device(t)


def checksum_on_device(t: torch.Tensor) -> str:
    """wsum64 of ``t``'s raw bytes with torch operations only, wherever ``t`` lives: the
    GPU path, also run on CPU tensors by the tests. Only 16 bytes leave the device."""
    import torch

    flat = _raw_bytes(t)
    slots = torch.zeros(MODULUS, dtype=torch.int64, device=flat.device)
    whole = flat.numel() // 4 * 4
    # Blocks hold whole rows of MODULUS words, so every block starts at slot 0.
    for start in range(0, whole, _BLOCK_BYTES):
        words = _as_int32(flat[start : min(start + _BLOCK_BYTES, whole)])
        rows = words.numel() // MODULUS
        if rows:
            # Widening first, then summing contiguous int64 rows, is 2x faster on a CPU
            # than sum(dtype=int64) over int32, and as fast on a GPU.
            block = words[: rows * MODULUS].view(rows, MODULUS).to(torch.int64)
            slots += block.sum(dim=0)
        tail = words[rows * MODULUS :]
        slots[: tail.numel()] += tail
    if whole < flat.numel():
        padded = torch.zeros(4, dtype=torch.uint8, device=flat.device)
        padded[: flat.numel() - whole] = flat[whole:]
        slots[(whole // 4) % MODULUS] += padded.view(torch.int32)[0]
    weights = torch.arange(1, MODULUS + 1, dtype=torch.int64, device=flat.device)
    s1, s2 = torch.stack([slots.sum(), (slots * weights).sum()]).tolist()
    return _encode(int(s1), int(s2))


def _raw_bytes(t: torch.Tensor) -> torch.Tensor:
    import torch

    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _as_int32(u8: torch.Tensor) -> torch.Tensor:
    """Bytes as int32 words, copying only when they sit at an address not 4-aligned (a
    view into a packed buffer can), since reinterpreting needs aligned storage."""
    import torch

    if u8.data_ptr() % 4 or u8.storage_offset() % 4:
        u8 = u8.clone()
    return u8.view(torch.int32)


class FileChecksums:
    """wsum64 of every tensor of one safetensors file, fed the file's bytes in order.

    Pieces arrive as (file offset, bytes), in order and without gaps, in whatever sizes
    the reader uses (a manifest builder's chunks); a tensor may span pieces. Only the
    tensor being read holds an accumulator, so memory stays flat however many tensors.
    """

    def __init__(self, layout: FileLayout) -> None:
        self._pending = [t for t in layout.tensors if t.size]
        self._next = 0
        self._current: Wsum64 | None = None
        self._at = 0
        empty = checksum_bytes(b"")
        self._done = {t.name: empty for t in layout.tensors if not t.size}

    def feed(self, offset: int, data: Buffer) -> None:
        if offset != self._at:
            raise ValueError(f"expected bytes from offset {self._at}, got {offset}")
        view = np.frombuffer(data, dtype=np.uint8)
        end = offset + len(view)
        self._at = end
        while self._next < len(self._pending) and self._pending[self._next].start < end:
            t = self._pending[self._next]
            if self._current is None:
                self._current = Wsum64()
            lo, hi = max(t.start, offset), min(t.end, end)
            self._current.update(view[lo - offset : hi - offset])
            if t.end > end:
                return
            self._done[t.name] = self._current.hexdigest()
            self._current = None
            self._next += 1

    def result(self) -> dict[str, str]:
        """Tensor name -> checksum; every tensor must have been fed in full."""
        if self._next < len(self._pending):
            raise ValueError(f"tensor {self._pending[self._next].name!r} was not read in full")
        return dict(self._done)
