"""The bucket plan and packing: pure, on CPU tensors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from weightship.loader.load import load_model
from weightship.seeding.buckets import (
    ALIGN,
    FileSpan,
    TensorSpec,
    new_arena,
    pack_all,
    pack_bucket,
    plan_buckets,
    plan_files,
    region_views,
    unpack,
)
from weightship.seeding.errors import SeedingError
from weightship.seeding.specs import check_tensors, plan_for, specs_of, tensor_entries
from weightship.weightformat.build import LocalFolder, build_manifest


def sample_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "embed": torch.randn(300, 17, generator=g).to(torch.bfloat16),  # 10200 B: spans buckets
        "norm": torch.randn(17, generator=g),
        "flag": torch.tensor([True, False, True]),
        "scale": torch.tensor(0.25, dtype=torch.float64),  # 0-dim
        "empty": torch.empty(0, 4),
        "ids": torch.arange(-5, 6, dtype=torch.int64),
        "half": torch.randn(3, 5, generator=g).half(),
    }


def specs(tensors: dict[str, torch.Tensor]) -> list[TensorSpec]:
    return [TensorSpec.of(name, t) for name, t in tensors.items()]


def test_plan_keeps_order_aligns_offsets_and_cuts_fixed_buckets() -> None:
    tensors = sample_tensors()
    plan = plan_buckets(specs(tensors), bucket_bytes=4096)
    assert [p.spec.name for p in plan.placements] == list(tensors)
    assert all(p.offset % ALIGN == 0 for p in plan.placements)
    ends = [p.end for p in plan.placements]
    assert all(nxt.offset >= end for nxt, end in zip(plan.placements[1:], ends, strict=False))
    assert plan.payload_bytes == sum(t.nbytes for t in tensors.values())
    assert plan.buckets[0][0] == 0 and plan.buckets[-1][1] == plan.total_bytes
    assert all(e - s == 4096 for s, e in plan.buckets[:-1])
    assert plan == plan_buckets(specs(tensors), bucket_bytes=4096)  # deterministic


def test_pieces_cover_every_tensor_byte_exactly_once() -> None:
    tensors = sample_tensors()
    plan = plan_buckets(specs(tensors), bucket_bytes=1024)
    covered: dict[str, list[tuple[int, int]]] = {name: [] for name in tensors}
    for i in range(len(plan.buckets)):
        for piece in plan.pieces(i):
            covered[piece.name].append((piece.tensor_start, piece.length))
    for name, t in tensors.items():
        spans = sorted(covered[name])
        pos = 0
        for start, length in spans:
            assert start == pos
            pos += length
        assert pos == t.nbytes, name
    assert len(covered["embed"]) > 1  # 10200 bytes split over 1 KiB buckets
    assert plan.last_bucket_of("embed") == (plan.placements[0].end - 1) // 1024


@pytest.mark.parametrize("bucket_bytes", [64, 1024, 4096, 1 << 20])
def test_pack_then_unpack_gives_back_every_tensor(bucket_bytes: int) -> None:
    tensors = sample_tensors()
    plan = plan_buckets(specs(tensors), bucket_bytes)
    out = unpack(plan, pack_all(plan, tensors))
    assert list(out) == list(tensors)
    for name, t in tensors.items():
        assert out[name].dtype == t.dtype and out[name].shape == t.shape, name
        assert torch.equal(out[name], t), name


def test_buckets_packed_one_at_a_time_into_a_reused_buffer_fill_the_arena() -> None:
    """What the root does (one staging buffer) lands as what a receiver gets (one arena)."""
    tensors = sample_tensors()
    plan = plan_buckets(specs(tensors), 512)
    staging = torch.full((512,), 0xAB, dtype=torch.uint8)
    arena = new_arena(plan)
    for i, (start, end) in enumerate(plan.buckets):
        arena[start:end] = pack_bucket(plan, i, tensors, staging)
    got = unpack(plan, arena)
    assert all(torch.equal(got[n], t) for n, t in tensors.items())


def test_unpacked_tensors_are_views_of_the_arena() -> None:
    tensors = sample_tensors()
    plan = plan_buckets(specs(tensors), 4096)
    arena = pack_all(plan, tensors)
    got = unpack(plan, arena)
    arena[plan.placements[0].offset : plan.placements[0].end].zero_()
    assert not got["embed"].any()


def test_non_contiguous_source_is_packed_by_value() -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    tensors = {"t": base.t()}  # a transposed view
    plan = plan_buckets(specs(tensors), 64)
    assert torch.equal(unpack(plan, pack_all(plan, tensors))["t"], base.t())


def test_plan_rejects_bad_bucket_sizes_and_repeated_names() -> None:
    spec = TensorSpec("a", torch.float32, (2,))
    with pytest.raises(ValueError, match="multiple of"):
        plan_buckets([spec], 100)
    with pytest.raises(ValueError, match="twice"):
        plan_buckets([spec, spec], 1024)


def test_empty_plan_has_no_buckets() -> None:
    assert plan_buckets([], 1024).buckets == ()


def test_specs_from_a_real_manifest_match_the_saved_tensors(tmp_path: Path) -> None:
    tensors = {k: v for k, v in sample_tensors().items() if k != "empty"}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    manifest = build_manifest(LocalFolder(tmp_path), chunk_size=4096)
    found = specs_of(tensor_entries(manifest))
    assert {s.name: s for s in found} == {s.name: s for s in specs(tensors)}
    check_tensors(found, tensors)
    with pytest.raises(ValueError, match="manifest says"):
        check_tensors(found, {**tensors, "norm": tensors["norm"].double()})
    with pytest.raises(ValueError, match="not loaded"):
        check_tensors(found, {k: v for k, v in tensors.items() if k != "ids"})


def test_a_manifest_without_tensors_cannot_seed(tmp_path: Path) -> None:
    (tmp_path / "weights.bin").write_bytes(b"x" * 100)
    manifest = build_manifest(LocalFolder(tmp_path), chunk_size=64)
    with pytest.raises(SeedingError) as caught:
        tensor_entries(manifest)
    assert caught.value.reason == "NoTensorChecksums" and caught.value.fall_back


def test_file_plan_keeps_file_offsets_and_never_cuts_across_files() -> None:
    a, b = TensorSpec("a", torch.float32, (10,)), TensorSpec("b", torch.int16, (3,))
    c = TensorSpec("c", torch.uint8, (5,))
    plan = plan_files([FileSpan(100, ((a, 8), (b, 49))), FileSpan(30, ((c, 20),))], 64)
    assert plan.regions == ((0, 100), (128, 158))
    assert [(p.spec.name, p.offset) for p in plan.placements] == [("a", 8), ("b", 49), ("c", 148)]
    assert plan.buckets == ((0, 64), (64, 100), (128, 158))
    assert plan.last_bucket_of("b") == 0 and plan.last_bucket_of("c") == 2
    tensors = {"a": torch.arange(10.0), "b": torch.tensor([1, -2, 3], dtype=torch.int16)}
    tensors["c"] = torch.arange(5, dtype=torch.uint8)
    got = unpack(plan, pack_all(plan, tensors))
    assert all(torch.equal(got[k], v) for k, v in tensors.items())
    # "b" sits at an odd offset, as a file may pack it: it comes back as an aligned copy.
    assert got["b"].data_ptr() % 2 == 0


def test_file_plan_rejects_tensors_outside_their_file_or_overlapping() -> None:
    a = TensorSpec("a", torch.float32, (10,))
    with pytest.raises(ValueError, match="outside"):
        plan_files([FileSpan(20, ((a, 0),))], 64)
    with pytest.raises(ValueError, match="overlap"):
        plan_files([FileSpan(100, ((a, 0), (TensorSpec("b", torch.uint8, (4,)), 36)))], 64)


def test_a_loader_s_buffers_are_sent_as_they_are(tmp_path: Path) -> None:
    """A root that loaded with weightship.loader holds each file contiguously: its buckets
    are views of that memory, byte for byte the file; separate tensors need packing."""
    tensors = {k: v for k, v in sample_tensors().items() if k != "empty"}
    save_file(dict(list(tensors.items())[:3]), str(tmp_path / "a.safetensors"))
    save_file(dict(list(tensors.items())[3:]), str(tmp_path / "b.safetensors"))
    manifest = build_manifest(LocalFolder(tmp_path), chunk_size=4096)
    plan = plan_for(manifest, 1024)
    loaded = load_model(tmp_path, manifest).tensors
    views = region_views(plan, loaded)
    assert sorted(views) == [0, 1]
    for index, path in enumerate(["a.safetensors", "b.safetensors"]):
        assert views[index].numpy().tobytes() == (tmp_path / path).read_bytes()
    assert region_views(plan, {k: v.clone() for k, v in loaded.items()}) == {}
    arena = new_arena(plan)
    for index, (start, end) in enumerate(plan.regions):
        arena[start:end] = views[index]
    got = unpack(plan, arena)
    assert all(torch.equal(got[k], v) for k, v in tensors.items())


@pytest.mark.parametrize("window", [None, 1, 2])
def test_a_window_bounds_the_buckets_on_the_wire_from_source_memory(
    window: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Buckets sent straight from source memory are all started at once unless a window
    bounds them; with one, ``on_sent(n)`` runs before bucket n + window starts (what the
    root-exit fault relies on to die with its broadcast unfinished). The transport is a
    recorder here: one function's ordering, not a broadcast."""
    from weightship.seeding import stream

    plan = plan_buckets(specs(sample_tensors()), 1024)
    sources = {
        i: torch.zeros(end - start, dtype=torch.uint8)
        for i, (start, end) in enumerate(plan.regions)
    }
    log: list[str] = []
    started = iter(range(len(plan.buckets)))
    monkeypatch.setattr(
        stream.transport,
        "start_broadcast",
        lambda pg, t: log.append(f"start {next(started)}") or len(log),
    )
    monkeypatch.setattr(stream.transport, "wait", lambda work, timeout_s: None)
    stream.send_buckets(
        None,  # type: ignore[arg-type]
        plan,
        {},
        device=torch.device("cpu"),
        timeout_s=5,
        sources=sources,
        on_sent=lambda n: log.append(f"sent {n}"),
        window=window,
    )
    count = len(plan.buckets)
    assert count >= 4
    starts = [i for i, entry in enumerate(log) if entry.startswith("start")]
    first_sent = log.index("sent 1")
    if window is None:
        assert len([i for i in starts if i < first_sent]) == count  # all out before any callback
    else:
        assert len([i for i in starts if i < first_sent]) == window
        assert log[-1] == f"sent {count}"
