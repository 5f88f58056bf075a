import random

import numpy as np
import pytest
import torch

from weightship.weightformat.checksum import (
    CHECKSUM_HEX_LEN,
    MODULUS,
    Wsum64,
    checksum_bytes,
    checksum_on_device,
    checksum_tensor,
)


def reference(data: bytes) -> str:
    """The definition, word by word in Python integers."""
    data += b"\0" * (-len(data) % 4)
    words = [int.from_bytes(data[i : i + 4], "little", signed=True) for i in range(0, len(data), 4)]
    s1 = sum(words) % 2**64
    s2 = sum(w * ((i % MODULUS) + 1) for i, w in enumerate(words)) % 2**64
    return f"{s1:016x}{s2:016x}"


def as_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0)


# Sizes around the word size and the weight period, where slot bookkeeping could slip.
SIZES = [0, 1, 3, 4, 5, 4 * MODULUS - 1, 4 * MODULUS, 4 * MODULUS + 6, 8 * MODULUS + 3]


@pytest.mark.parametrize("size", SIZES)
def test_numpy_torch_and_definition_agree(size: int) -> None:
    data = random.Random(size).randbytes(size)
    got = checksum_bytes(data)
    assert len(got) == CHECKSUM_HEX_LEN
    assert got == checksum_tensor(as_tensor(data))
    assert got == checksum_on_device(as_tensor(data))  # torch's kernels, run on the CPU
    assert got == reference(data)


def test_large_values_wrap_the_same_way() -> None:
    # All-ones words are -1 and 0x7fffffff words sum past 2**63 over many weighted terms.
    for word in (b"\xff\xff\xff\xff", b"\xff\xff\xff\x7f", b"\x00\x00\x00\x80"):
        data = word * (3 * MODULUS + 17)
        assert checksum_bytes(data) == checksum_on_device(as_tensor(data)) == reference(data)


def test_streamed_pieces_equal_one_shot() -> None:
    data = random.Random(1).randbytes(3 * 4 * MODULUS + 7)
    h, start = Wsum64(), 0
    for piece_len in [1, 2, 3, 4 * MODULUS + 1, 5, 4 * MODULUS - 2, len(data)]:
        h.update(memoryview(data)[start : start + piece_len])
        start += piece_len
    assert h.hexdigest() == checksum_bytes(data)


def test_any_dtype_is_checksummed_as_its_raw_bytes() -> None:
    g = torch.Generator().manual_seed(2)
    for t in (
        torch.randn(33, 7, generator=g).to(torch.bfloat16),
        torch.randn(5, generator=g, dtype=torch.float64),
        torch.tensor([True, False, True]),
        torch.tensor(7, dtype=torch.int64),
        torch.randn(4, 6, generator=g).t(),  # not contiguous: checksummed as its copy
    ):
        raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        assert checksum_tensor(t) == checksum_on_device(t) == checksum_bytes(raw)
        assert checksum_bytes(raw) == reference(raw)
    arr = np.arange(10, dtype=np.float32)
    assert checksum_bytes(arr) == checksum_bytes(arr.tobytes())


def test_view_at_an_unaligned_offset() -> None:
    data = random.Random(3).randbytes(4 * MODULUS + 11)
    packed = torch.frombuffer(bytearray(b"x" + data), dtype=torch.uint8)[1:]
    assert checksum_on_device(packed) == checksum_tensor(packed) == checksum_bytes(data)


def test_bit_flip_swap_and_truncation_change_it() -> None:
    data = bytearray(random.Random(4).randbytes(4 * 4096))
    base = checksum_bytes(data)
    t = torch.frombuffer(bytearray(data), dtype=torch.bfloat16)
    assert checksum_tensor(t) == checksum_on_device(t) == base

    flipped = bytearray(data)
    flipped[1234] ^= 0x10
    assert checksum_bytes(flipped) != base

    swapped = bytearray(data)
    swapped[8:12], swapped[400:404] = data[400:404], data[8:12]
    assert swapped != data
    assert checksum_bytes(swapped) != base
    # s1 alone cannot see a swap: the position weights in s2 do.
    assert checksum_bytes(swapped)[:16] == base[:16]

    assert checksum_tensor(t[:-1]) != base and checksum_on_device(t[:-1]) != base
    assert checksum_bytes(data[:-1]) != base
