"""Broadcast seeding over real gloo on loopback: a root and receivers in separate processes.

Receivers (and, where it must die, the root) run in processes forked from a forkserver
that imported torch once, so each costs a fork rather than a torch import.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time
from collections.abc import Iterator
from multiprocessing.queues import Queue
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from weightship.core.seedtoken import mint
from weightship.loader.load import load_model
from weightship.seeding import FAULT_ENV, SeedingError, SeedRecord, SeedRoot, receive, serve
from weightship.weightformat.build import LocalFolder, build_manifest
from weightship.weightformat.manifest import Manifest

BUCKET = 8192
HOST = "127.0.0.1"
KEY = bytes(range(32))  # the rollout's seeding key, as the operator's Secret holds it
UID = "rollout-uid-1"
KEYED: dict[str, Any] = {"key": KEY, "rollout_uid": UID}


def token_for(group: str, manifest: Manifest) -> str:
    """What a receiver of this rollout joins with (SeedConfig.token)."""
    return mint(KEY, UID, manifest.digest, group, time.time())


ctx = mp.get_context("forkserver")
ctx.set_forkserver_preload(["torch", "safetensors.torch", "weightship.seeding"])


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Manifest]:
    """Two shards, ~70 KiB: about nine buckets of 8 KiB, several tensors split across them."""
    folder = tmp_path_factory.mktemp("model")
    g = torch.Generator().manual_seed(1)
    save_file(
        {
            "embed.weight": torch.randn(256, 64, generator=g).to(torch.bfloat16),
            "layer0.norm": torch.randn(64, generator=g),
            "layer0.step": torch.tensor(7, dtype=torch.int64),
        },
        str(folder / "model-00001-of-00002.safetensors"),
    )
    save_file(
        {
            "layer1.proj": torch.randn(64, 96, generator=g),
            "layer1.mask": torch.rand(33, generator=g) > 0.5,
        },
        str(folder / "model-00002-of-00002.safetensors"),
    )
    return folder, build_manifest(LocalFolder(folder), chunk_size=16384)


def load_tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.fixture(scope="module")
def root(model: tuple[Path, Manifest]) -> Iterator[tuple[SeedRoot, str]]:
    folder, manifest = model
    seed_root = SeedRoot(
        load_tensors(folder),
        manifest,
        host=HOST,
        name="root-0",
        timeout_s=30,
        join_window_s=5,
        bucket_bytes=BUCKET,
        **KEYED,
    )
    server = serve(seed_root, HOST)
    yield seed_root, f"http://{HOST}:{server.server_address[1]}"
    server.stop()
    seed_root.close()


def _receiver(
    url: str, group: str, world: int, manifest_doc: bytes, folder: str, member: str,
    fault: str, timeout_s: float, out: Queue[dict[str, Any]],
) -> None:  # fmt: skip
    if fault:
        os.environ[FAULT_ENV] = fault
    manifest = Manifest.parse(manifest_doc)
    t0 = time.monotonic()
    try:
        got = receive(
            url,
            group,
            world,
            manifest,
            member=member,
            timeout_s=timeout_s,
            token=token_for(group, manifest),
        )
    except SeedingError as exc:
        out.put({"member": member, "reason": exc.reason, "elapsed": time.monotonic() - t0})
        return
    want = load_tensors(Path(folder))
    same = got.tensors.keys() == want.keys() and all(
        got.tensors[k].dtype == v.dtype and torch.equal(got.tensors[k], v) for k, v in want.items()
    )
    out.put(
        {
            "member": member,
            "reason": None,
            "identical": same,
            "seeded_from": got.seeded_from,
            "generation": got.generation,
            "bytes": got.bytes,
        }
    )


def run_receivers(
    url: str,
    group: str,
    world: int,
    model: tuple[Path, Manifest],
    members: dict[str, str],  # member -> fault ("" for none)
    timeout_s: float = 30,
) -> dict[str, dict[str, Any]]:
    folder, manifest = model
    out: Queue[dict[str, Any]] = ctx.Queue()
    procs = [
        ctx.Process(
            target=_receiver,
            args=(url, group, world, manifest.canonical_bytes(), str(folder), m, f, timeout_s, out),
        )
        for m, f in members.items()
    ]
    for p in procs:
        p.start()
    # Receivers bound themselves by timeout_s; the margin covers a fork and a slow machine.
    results = [out.get(timeout=timeout_s + 30) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    return {r["member"]: r for r in results}


def record_of(seed_root: SeedRoot, group: str, generation: int = 1) -> SeedRecord:
    """The root's history entry, once the root has collected the receivers' reports."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for r in seed_root.history():
            if (r.group, r.generation) == (group, generation):
                return r
        time.sleep(0.05)
    raise AssertionError(f"no history record for {group}/{generation}")


def test_one_root_seeds_two_receivers_with_identical_tensors(
    root: tuple[SeedRoot, str], model: tuple[Path, Manifest]
) -> None:
    seed_root, url = root
    assert len(seed_root.plan.buckets) > 4
    assert not seed_root.sources  # separate tensors: every bucket is packed
    got = run_receivers(url, "pair", 3, model, {"r1": "", "r2": ""})
    for r in got.values():
        assert r["reason"] is None and r["identical"], r
        assert r["seeded_from"] == "root-0"
    rec = record_of(seed_root, "pair")
    assert rec.ok and sorted(rec.receivers) == ["r1", "r2"]
    assert rec.bytes == seed_root.plan.payload_bytes == got["r1"]["bytes"]
    assert rec.results == {"r1": "Verified", "r2": "Verified"}


def test_the_same_root_seeds_later_groups_and_later_generations(
    root: tuple[SeedRoot, str], model: tuple[Path, Manifest]
) -> None:
    seed_root, url = root
    first = run_receivers(url, "waves", 2, model, {"w1": ""})
    # Scale 2 -> 3 under the same group id: one more receiver is expected, generation 2.
    second = run_receivers(url, "waves", 3, model, {"w2": ""})
    other = run_receivers(url, "another", 2, model, {"a1": ""})
    assert first["w1"]["identical"] and first["w1"]["generation"] == 1
    assert second["w2"]["identical"] and second["w2"]["generation"] == 2
    assert other["a1"]["identical"]
    assert record_of(seed_root, "waves", 2).receivers == ("w2",)


def test_tampered_bytes_are_caught_and_only_that_receiver_fails(
    root: tuple[SeedRoot, str], model: tuple[Path, Manifest]
) -> None:
    seed_root, url = root
    got = run_receivers(url, "tamper", 3, model, {"good": "", "bad": "tamper"})
    assert got["good"]["reason"] is None and got["good"]["identical"]
    assert got["bad"]["reason"] == "ChecksumMismatch"
    assert record_of(seed_root, "tamper").results == {
        "good": "Verified",
        "bad": "ChecksumMismatch",
    }


def test_a_group_that_does_not_fill_starts_with_whoever_joined(
    model: tuple[Path, Manifest],
) -> None:
    folder, manifest = model
    loaded = load_model(folder, manifest).tensors  # one buffer per file: sent without packing
    seed_root = SeedRoot(
        loaded, manifest, host=HOST, name="r", join_window_s=1, bucket_bytes=BUCKET, **KEYED
    )
    assert len(seed_root.sources) == len(seed_root.plan.regions) == 2
    server = serve(seed_root, HOST)
    try:
        url = f"http://{HOST}:{server.server_address[1]}"
        got = run_receivers(url, "partial", 5, model, {"only": ""})
        assert got["only"]["identical"]
        assert record_of(seed_root, "partial").receivers == ("only",)
    finally:
        server.stop()
        seed_root.close()


def _root_process(folder: str, manifest_doc: bytes, fault: str, out: Queue[str]) -> None:
    os.environ[FAULT_ENV] = fault
    seed_root = SeedRoot(
        load_tensors(Path(folder)),
        Manifest.parse(manifest_doc),
        host=HOST,
        name="doomed",
        join_window_s=10,
        bucket_bytes=BUCKET,
        **KEYED,
    )
    server = serve(seed_root, HOST)
    out.put(f"http://{HOST}:{server.server_address[1]}")
    time.sleep(120)  # the fault ends this process mid-broadcast


def test_receivers_give_up_within_their_timeout_when_the_root_dies_mid_broadcast(
    model: tuple[Path, Manifest],
) -> None:
    folder, manifest = model
    urls: Queue[str] = ctx.Queue()
    proc = ctx.Process(
        target=_root_process,
        args=(str(folder), manifest.canonical_bytes(), "root-exit-after-buckets=2", urls),
    )
    proc.start()
    try:
        url = urls.get(timeout=60)
        got = run_receivers(url, "doomed", 3, model, {"d1": "", "d2": ""}, timeout_s=20)
        for r in got.values():
            assert r["reason"] in ("RootDied", "Timeout"), r
        proc.join(timeout=30)
        assert proc.exitcode == 1  # it died by the fault, after sending 2 of its buckets
    finally:
        proc.kill()


def test_a_refusing_closed_or_absent_root_means_fall_back_now(
    root: tuple[SeedRoot, str], model: tuple[Path, Manifest], tmp_path: Path
) -> None:
    _, url = root
    save_file({"other": torch.ones(3)}, str(tmp_path / "other.safetensors"))
    other_model = build_manifest(LocalFolder(tmp_path), chunk_size=4096)
    cases = {
        "digest": (url, other_model),
        "nothing listening": (f"http://{HOST}:9", model[1]),
        "no seeding endpoint": (url + "/nope", model[1]),
    }
    for case, (where, manifest) in cases.items():
        with pytest.raises(SeedingError) as caught:
            receive(
                where,
                "refused",
                2,
                manifest,
                member="x",
                timeout_s=10,
                token=token_for("refused", manifest),
            )
        assert caught.value.reason == "RootUnavailable", case

    closed = SeedRoot(
        load_tensors(model[0]), model[1], host=HOST, name="c", bucket_bytes=BUCKET, **KEYED
    )
    closed.close()
    server = serve(closed, HOST)
    try:
        with pytest.raises(SeedingError) as caught:
            receive(
                f"http://{HOST}:{server.server_address[1]}",
                "g",
                2,
                model[1],
                member="x",
                token=token_for("g", model[1]),
            )
        assert caught.value.reason == "RootUnavailable"
    finally:
        server.stop()


def test_a_receiver_waiting_for_a_group_that_never_starts_times_out(
    model: tuple[Path, Manifest],
) -> None:
    folder, manifest = model
    seed_root = SeedRoot(
        load_tensors(folder), manifest, host=HOST, name="slow", join_window_s=600, **KEYED
    )
    server = serve(seed_root, HOST)
    try:
        url = f"http://{HOST}:{server.server_address[1]}"
        with pytest.raises(SeedingError) as caught:
            receive(
                url,
                "never",
                3,
                manifest,
                member="lonely",
                timeout_s=1.5,
                token=token_for("never", manifest),
            )
        assert caught.value.reason == "Timeout"
    finally:
        server.stop()
        seed_root.close()


def test_closing_the_root_releases_receivers_waiting_to_start(
    model: tuple[Path, Manifest],
) -> None:
    folder, manifest = model
    seed_root = SeedRoot(
        load_tensors(folder), manifest, host=HOST, name="r", join_window_s=600, **KEYED
    )
    server = serve(seed_root, HOST)
    errors: list[SeedingError] = []

    def waiting_receiver() -> None:
        try:
            receive(
                f"http://{HOST}:{server.server_address[1]}",
                "g",
                3,
                manifest,
                member="w",
                token=token_for("g", manifest),
            )
        except SeedingError as exc:
            errors.append(exc)

    t = threading.Thread(target=waiting_receiver)
    t.start()
    try:
        deadline = time.monotonic() + 20
        while not seed_root.status_json()["active"] and time.monotonic() < deadline:
            time.sleep(0.02)
        seed_root.close()
        t.join(timeout=20)
        assert [e.reason for e in errors] == ["RootUnavailable"]
        assert "abandoned" in errors[0].message
    finally:
        server.stop()


def test_a_receiver_that_never_shows_up_fails_only_that_broadcast(
    model: tuple[Path, Manifest],
) -> None:
    """A joined receiver that never builds its group: the root's rendezvous times out, the
    failure is recorded, and the root goes on seeding the next group."""
    folder, manifest = model
    seed_root = SeedRoot(
        load_tensors(folder),
        manifest,
        host=HOST,
        name="r",
        timeout_s=2,
        bucket_bytes=BUCKET,
        **KEYED,
    )
    server = serve(seed_root, HOST)
    try:
        answer = seed_root.join(
            "ghost", 2, "vanished", digest=manifest.digest, token=token_for("ghost", manifest)
        )
        assert answer["accepted"] and answer["rank"] == 1
        failed = record_of(seed_root, "ghost")
        assert not failed.ok and failed.error and failed.results == {"vanished": "Unknown"}
        got = run_receivers(
            f"http://{HOST}:{server.server_address[1]}", "next", 2, model, {"n": ""}
        )
        assert got["n"]["identical"]
    finally:
        server.stop()
        seed_root.close()


def _post_join(url: str, body: bytes, length: str | None = None) -> int:
    import socket
    from urllib.parse import urlsplit

    from weightship.seeding.protocol import JOIN_PATH

    where = urlsplit(url)
    head = f"POST {JOIN_PATH} HTTP/1.1\r\nHost: x\r\nContent-Length: {length or len(body)}\r\n\r\n"
    with socket.create_connection((where.hostname, where.port), timeout=10) as s:
        s.sendall(head.encode() + body)
        return int(s.recv(4096).split()[1])


def test_joins_with_a_bad_group_or_body_are_refused(root: tuple[SeedRoot, str]) -> None:
    import json

    _, url = root
    join = {"group": "g\n", "worldSize": 2, "member": "m"}  # a trailing newline: no group id
    assert _post_join(url, json.dumps(join).encode()) == 400
    assert _post_join(url, b"", length="-5") == 400
    assert _post_join(url, b"", length="1e9") == 400
    assert _post_join(url, b"", length=str(10**9)) == 413
