import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from weightship.weightformat.layout import LayoutError, parse_header, read_layout, tensor_nbytes


def sample_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(7, 5, generator=g).to(torch.bfloat16),
        "norm.weight": torch.randn(5, generator=g),
        "step": torch.tensor(3, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "empty": torch.empty(0, 4, dtype=torch.float16),
        "codes": torch.arange(11, dtype=torch.int8),
    }


def safetensors_bytes(header: object, data: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def test_offsets_are_file_relative_and_match_safetensors(tmp_path: Path) -> None:
    tensors = sample_tensors()
    path = tmp_path / "m.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    raw = path.read_bytes()

    layout = read_layout(path)

    assert layout.file_size == len(raw)
    assert layout.metadata == {"format": "pt"}
    assert layout.data_start == 8 + struct.unpack("<Q", raw[:8])[0]
    assert layout == parse_header(raw)  # the whole file, or header + size, parse alike
    assert layout == parse_header(raw[: layout.data_start], len(raw))
    loaded = load_file(str(path))
    assert set(layout.by_name()) == set(tensors)
    for info in layout.tensors:
        want = loaded[info.name]
        assert info.shape == tuple(want.shape)
        assert info.size == want.numel() * want.element_size()
        assert raw[info.start : info.end] == want.reshape(-1).view(torch.uint8).numpy().tobytes()
    assert [t.start for t in layout.tensors] == sorted(t.start for t in layout.tensors)


def test_dtype_names_and_sizes() -> None:
    assert tensor_nbytes("BF16", (3, 4)) == 24
    assert tensor_nbytes("F4", (2, 3)) == 3
    assert tensor_nbytes("I64", ()) == 8
    with pytest.raises(LayoutError, match="whole number of bytes"):
        tensor_nbytes("F4", (3,))


def entry(dtype: str, shape: list[int], begin: int, end: int) -> dict[str, object]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


@pytest.mark.parametrize(
    ("header", "data_len", "message"),
    [
        ({"a": entry("F32", [2], 0, 8), "b": entry("F32", [2], 4, 12)}, 12, "overlaps"),
        ({"a": entry("F32", [2], 0, 8)}, 4, "past the end"),
        ({"a": entry("F32", [2], 0, 8)}, 12, r"after the last tensor belong to none"),
        ({"a": entry("F32", [1], 4, 8)}, 8, "belong to none"),
        ({"a": entry("Q7", [2], 0, 8)}, 8, "unknown dtype 'Q7'"),
        ({"a": entry("F32", [3], 0, 8)}, 8, "needs 12 bytes"),
        ({"a": entry("F32", [2], 8, 0)}, 8, "before begin"),
        ({"a": entry("F32", [-2], 0, 8)}, 8, "shape"),
        ({"a": {"dtype": "F32", "shape": [2]}}, 8, "data_offsets"),
        ({"__metadata__": {"k": 1}}, 0, "__metadata__"),
        ([1, 2], 0, "not a JSON object"),
    ],
)
def test_malformed_headers_rejected(header: object, data_len: int, message: str) -> None:
    with pytest.raises(LayoutError, match=message):
        parse_header(safetensors_bytes(header, bytes(data_len)))


def test_malformed_length_and_json_rejected(tmp_path: Path) -> None:
    with pytest.raises(LayoutError, match="too short"):
        parse_header(b"\x01\x00")
    with pytest.raises(LayoutError, match="runs past the end"):
        parse_header(struct.pack("<Q", 100) + b"{}")
    with pytest.raises(LayoutError, match="exceeds"):
        parse_header(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(LayoutError, match="JSON"):
        parse_header(struct.pack("<Q", 3) + b"{x}")
    with pytest.raises(LayoutError, match="duplicate key 'a'"):
        raw = b'{"a":{"dtype":"U8","shape":[0],"data_offsets":[0,0]},"a":{}}'
        parse_header(struct.pack("<Q", len(raw)) + raw)

    random_bytes = tmp_path / "not.safetensors"  # a huge "length" from random bytes
    random_bytes.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(LayoutError, match=str(random_bytes)):
        read_layout(random_bytes)
