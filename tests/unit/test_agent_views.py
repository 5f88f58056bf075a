"""Per-rollout views of the node cache (weightship.data.views), on a real filesystem: a
view shows exactly the models its rollout pins and the node has staged, as hard links,
STAGED written last; taken out at once when unpinned; never a path from a bad uid."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from weightship.agent.desired import view_pins
from weightship.controller.builders import rollout_view_root
from weightship.data import viewlayout
from weightship.data.chunkstore import ChunkStore
from weightship.data.modelstaging import ModelStaging
from weightship.data.views import KEEP_READY, TRASH_DIR, Views, view_root
from weightship.loader.load import locate_staged
from weightship.weightformat.build import LocalFolder, build_manifest
from weightship.weightformat.manifest import Manifest

CHUNK = 4096
U1 = "0b5d3a52-7c1e-4f0e-9a6b-1d2e3f405162"
U2 = "9f8e7d6c-5b4a-4392-8170-6f5e4d3c2b1a"


def stage(store: ChunkStore, folder: Path, files: dict[str, int]) -> Manifest:
    """Stage a model of random files into the store, as the agent does."""
    for path, size in files.items():
        (folder / path).parent.mkdir(parents=True, exist_ok=True)
        (folder / path).write_bytes(os.urandom(size))
    manifest = build_manifest(LocalFolder(folder), chunk_size=CHUNK)
    with ModelStaging(store, manifest) as s:
        s.prepare()
        for c in manifest.chunks:
            s.put(c.key, LocalFolder(folder).read_range(c.file, c.offset, c.size))
        s.mark_staged()
    return manifest


@pytest.fixture
def store(tmp_path: Path) -> ChunkStore:
    return ChunkStore(tmp_path / "cache")


@pytest.fixture
def models(store: ChunkStore, tmp_path: Path) -> dict[str, Manifest]:
    return {
        name: stage(store, tmp_path / "src" / name, {"model.safetensors": 3 * CHUNK, **extra})
        for name, extra in (
            ("v1", {"config.json": 100, "tokenizer/vocab.json": 200}),
            ("v2", {"config.json": 120}),
            ("other", {}),
        )
    }


def shown(store: ChunkStore, uid: str) -> set[str]:
    return Views(store).contents().get(uid, set())


def test_a_view_links_the_pinned_models_files_and_writes_staged(
    store: ChunkStore, models: dict[str, Manifest]
) -> None:
    v1 = models["v1"]
    report = Views(store).sync({U1: {v1.digest}})
    assert report.linked == [(U1, v1.digest)] and not report.errors and not report.pending
    root = view_root(store.root, U1)
    assert str(root) == rollout_view_root(str(store.root), U1)  # the pods' path: the same
    files = locate_staged(root, v1.digest)
    assert files == root / "models" / v1.digest_hex / "files"
    for f in v1.files:  # hard links: the very files the store staged, no bytes copied
        linked, staged = files / f.path, store.files_dir(v1.digest) / f.path
        assert os.path.samestat(linked.stat(), staged.stat()) and linked.stat().st_nlink == 2
    assert os.path.samestat(
        (files.parent / "manifest.json").stat(),
        (store.model_dir(v1.digest) / "manifest.json").stat(),
    )
    assert (root / "ready" / v1.digest_hex).is_file()  # the pods' start gate
    assert sorted(p.name for p in root.iterdir()) == ["models", "ready"]
    # Nothing of the store that a reader does not need: no journal, lock or partials.
    assert sorted(p.name for p in files.parent.iterdir()) == ["STAGED", "files", "manifest.json"]
    # Idempotent: a second pass changes nothing.
    again = Views(store).sync({U1: {v1.digest}})
    assert again.linked == [] and again.removed == [] and not again.errors
    assert (files / "config.json").stat().st_nlink == 2


def test_staged_is_written_last_and_the_work_is_bounded(
    store: ChunkStore, models: dict[str, Manifest]
) -> None:
    v1 = models["v1"]  # manifest.json and 3 files: 4 links
    views = Views(store)
    root = view_root(store.root, U1)
    passes = 0
    while True:
        report = views.sync({U1: {v1.digest}}, budget=2)
        passes += 1
        if (root / "models" / v1.digest_hex / "STAGED").is_file():
            break
        assert report.pending, "work left, so the agent is told to pass again"
        assert locate_staged(root, v1.digest) is None, "half linked, and not shown"
        assert not (root / "ready" / v1.digest_hex).exists(), "the gate stays shut"
        assert passes < 10
    assert passes == 2  # 4 operations, 2 per pass
    assert locate_staged(root, v1.digest) is not None
    assert (root / "ready" / v1.digest_hex).is_file()


def test_another_rollouts_model_is_never_linked(
    store: ChunkStore, models: dict[str, Manifest]
) -> None:
    v1, other = models["v1"], models["other"]
    Views(store).sync({U1: {v1.digest}, U2: {other.digest}})
    assert shown(store, U1) == {v1.digest}
    assert shown(store, U2) == {other.digest}
    view = view_root(store.root, U1)
    assert locate_staged(view, other.digest) is None
    assert not (view / "models" / other.digest_hex).exists()
    inodes = {p.stat().st_ino for p in view.rglob("*") if p.is_file()}
    theirs = {p.stat().st_ino for p in store.model_dir(other.digest).rglob("*") if p.is_file()}
    assert not inodes & theirs
    # A staged model nobody pins (v2 here) is in no view either.
    assert all(models["v2"].digest not in v for v in Views(store).contents().values())


def test_a_model_no_longer_pinned_leaves_the_view_at_once(
    store: ChunkStore, models: dict[str, Manifest]
) -> None:
    v1, v2 = models["v1"], models["v2"]
    views = Views(store)
    views.sync({U1: {v1.digest}})
    views.sync({U1: {v1.digest, v2.digest}})  # the next revision appears beside it
    assert shown(store, U1) == {v1.digest, v2.digest}
    staged_file = store.files_dir(v1.digest) / "model.safetensors"
    assert staged_file.stat().st_nlink == 2
    report = views.sync({U1: {v2.digest}}, budget=0)  # no budget at all: still taken out
    assert (U1, v1.digest_hex) in report.removed and report.pending
    assert shown(store, U1) == {v2.digest}
    assert locate_staged(view_root(store.root, U1), v1.digest) is None
    views.sync({U1: {v2.digest}})  # the trash is emptied: the store's copy is alone again
    assert staged_file.stat().st_nlink == 1
    assert not any((store.root / "views" / TRASH_DIR).iterdir())
    # The receipt of the revision pods were born on stays (a restart mounts it again).
    assert (view_root(store.root, U1) / "ready" / v1.digest_hex).is_file()


def test_a_rollout_gone_takes_its_view_along(
    store: ChunkStore, models: dict[str, Manifest]
) -> None:
    views = Views(store)
    views.sync({U1: {models["v1"].digest}, U2: {models["other"].digest}})
    report = views.sync({U2: {models["other"].digest}})
    assert report.views_removed == [U1]
    assert not view_root(store.root, U1).exists()
    assert Views(store).uids() == {U2}
    assert (store.files_dir(models["v1"].digest) / "config.json").stat().st_nlink == 1


@pytest.mark.parametrize(
    "uid",
    ["../../etc", "/", "", "..", U1.upper(), U1 + "/x", "not-a-uuid", f" {U1}", TRASH_DIR],
)
def test_a_uid_that_is_not_a_uuid_gets_no_view(
    store: ChunkStore, models: dict[str, Manifest], uid: str
) -> None:
    report = Views(store).sync({uid: {models["v1"].digest}})
    assert report.errors and "not a rollout uid" in report.errors[0]
    found = {p.name for p in (store.root / "views").iterdir()}
    assert found <= {TRASH_DIR} and not any((store.root / "views" / TRASH_DIR).iterdir())
    with pytest.raises(ValueError, match="not a rollout uid"):
        rollout_view_root("/var/cache/weightship", uid)


def test_a_bad_digest_is_never_a_path(store: ChunkStore, models: dict[str, Manifest]) -> None:
    report = Views(store).sync({U1: {"sha256:../../models", models["v1"].digest}})
    assert any("not a sha256 manifest digest" in e for e in report.errors)
    assert shown(store, U1) == {models["v1"].digest}


def test_a_pinned_model_shows_once_staged_and_a_stale_receipt_goes(
    store: ChunkStore, models: dict[str, Manifest], tmp_path: Path
) -> None:
    v1 = models["v1"]
    views = Views(store)
    later = build_manifest(LocalFolder(_folder(tmp_path / "later", 5000)), chunk_size=CHUNK)
    root = view_root(store.root, U1)
    (root / "ready").mkdir(parents=True)
    (root / "ready" / later.digest_hex).touch()  # left from an earlier pin of it
    views.sync({U1: {v1.digest, later.digest}})
    assert shown(store, U1) == {v1.digest}, "not staged here yet: not shown"
    assert not (root / "ready" / later.digest_hex).exists(), "its new pods must wait"
    staged = stage(store, tmp_path / "later", {})
    assert staged.digest == later.digest
    views.sync({U1: {v1.digest, later.digest}})
    assert shown(store, U1) == {v1.digest, later.digest}
    assert (root / "ready" / later.digest_hex).is_file()


def test_a_model_staged_again_is_linked_again(
    store: ChunkStore, models: dict[str, Manifest], tmp_path: Path
) -> None:
    """A link outlives its original: if the store lost a model (evicted while no rollout
    pinned it, staged again since), the view's old links are replaced."""
    v2 = models["v2"]
    views = Views(store)
    views.sync({U1: {v2.digest}})
    assert store.evict(v2.digest)
    report = views.sync({U1: {v2.digest}})
    assert (U1, v2.digest_hex) in report.removed and shown(store, U1) == set()
    restaged = stage(store, tmp_path / "src" / "v2", {})  # the same files: same digest
    assert restaged.digest == v2.digest
    views.sync({U1: {v2.digest}})
    linked = view_root(store.root, U1) / "models" / v2.digest_hex / "files" / "config.json"
    assert os.path.samestat(linked.stat(), (store.files_dir(v2.digest) / "config.json").stat())


def test_a_restarted_agent_checks_every_link_once(
    store: ChunkStore, models: dict[str, Manifest]
) -> None:
    v1 = models["v1"]
    Views(store).sync({U1: {v1.digest}})
    files = view_root(store.root, U1) / "models" / v1.digest_hex / "files"
    (files / "tokenizer" / "vocab.json").unlink()  # as a crash mid-pass might leave it
    (files / "config.json").unlink()
    (files / "config.json").write_text("not the staged file")
    report = Views(store).sync({U1: {v1.digest}})  # a new process: nothing from memory
    assert not report.errors
    for f in v1.files:
        staged = store.files_dir(v1.digest) / f.path
        assert os.path.samestat((files / f.path).stat(), staged.stat())


def test_linked_models_are_pinned_against_eviction(
    store: ChunkStore, models: dict[str, Manifest]
) -> None:
    views = Views(store)
    views.sync({U1: {models["v1"].digest}})
    pinned = views.linked_digests()
    assert pinned == {models["v1"].digest}
    plan = store.eviction_plan(store.available_bytes() + 1, pinned)
    assert models["v1"].digest not in plan


def test_receipts_of_old_revisions_are_bounded(
    store: ChunkStore, models: dict[str, Manifest]
) -> None:
    root = view_root(store.root, U1)
    (root / "ready").mkdir(parents=True)
    old = [f"{i:064x}" for i in range(KEEP_READY + 5)]
    for i, hex_ in enumerate(old):
        (root / "ready" / hex_).touch()
        os.utime(root / "ready" / hex_, (1000 + i, 1000 + i))
    Views(store).sync({U1: {models["v1"].digest}})
    kept = {p.name for p in (root / "ready").iterdir()}
    assert kept == {models["v1"].digest_hex, *old[-KEEP_READY:]}


def test_whatever_else_is_in_the_views_folder_goes(
    store: ChunkStore, models: dict[str, Manifest]
) -> None:
    views_dir = store.root / "views"
    (views_dir / "junk").mkdir(parents=True)
    (views_dir / "a-file").write_text("x")
    root = view_root(store.root, U1)
    (root / "models" / "not-hex").mkdir(parents=True)
    (root / "models" / models["other"].digest_hex).mkdir()
    (root / "elsewhere").symlink_to("/")
    Views(store).sync({U1: {models["v1"].digest}})
    assert {p.name for p in views_dir.iterdir()} == {U1, TRASH_DIR}
    assert {p.name for p in root.iterdir()} == {"models", "ready"}
    assert {p.name for p in (root / "models").iterdir()} == {models["v1"].digest_hex}


# ---- which rollouts get a view, and of what (agent.desired.view_pins, pure) -----------
A, B, C = ("sha256:" + c * 64 for c in "abc")


def rollout(
    uid: str | None = U1,
    policy: str | None = "InPlaceIfPossible",
    *,
    stable: str | None = A,
    canary: str | None = None,
    retiring: str | None = None,
    **meta: Any,
) -> dict[str, Any]:
    status: dict[str, Any] = {}
    for key, digest in (("stableRevision", stable), ("canaryRevision", canary)):
        if digest:
            status[key] = {"revision": "r", "manifestDigest": digest, "podTemplateHash": "h"}
    if retiring:
        status["retiring"] = {"revision": "o", "manifestDigest": retiring, "podTemplateHash": "o"}
    canary_spec: dict[str, Any] = {"steps": [{"setWeight": 100}]}
    if policy:
        canary_spec["updatePolicy"] = policy
    return {
        "metadata": {"name": "llm", "namespace": "serving", "uid": uid, **meta},
        "spec": {"prefetch": {"nodeSelector": {"zone": "a"}}, "strategy": {"canary": canary_spec}},
        "status": status,
    }


NODE = {"zone": "a"}


def test_an_in_place_rollout_shows_every_revision_it_pins() -> None:
    plan = view_pins([rollout(stable=A, canary=B, retiring=C)], NODE)
    assert plan.pins == {U1: frozenset({A, B, C})} and plan.refused == ()


@pytest.mark.parametrize(
    ("r", "why"),
    [
        (rollout(policy="Recreate"), "Recreate: its pods keep their three mounts"),
        (rollout(policy=None), "the default is Recreate"),
        (rollout(deletionTimestamp="2026-01-01T00:00:00Z"), "being deleted"),
        (
            {**rollout(), "spec": {**rollout()["spec"], "prefetch": {"enabled": False}}},
            "no prefetch",
        ),
    ],
)
def test_no_view(r: dict[str, Any], why: str) -> None:
    assert view_pins([r], NODE).pins == {}, why


def test_a_rollout_not_staging_here_has_no_view() -> None:
    assert view_pins([rollout()], {"zone": "b"}).pins == {}
    assert view_pins([rollout()], NODE, namespaces=("other-*",)).pins == {}


def test_a_view_outlives_a_switch_back_to_recreate() -> None:
    """Pods created with the view keep running (the policy is not in the revision hash)."""
    plan = view_pins([rollout(policy="Recreate", stable=B)], NODE, existing={U1})
    assert plan.pins == {U1: frozenset({B})}


@pytest.mark.parametrize("uid", [None, "", "../x", U1.upper(), 7])
def test_a_rollout_whose_uid_is_not_a_uuid_is_refused(uid: Any) -> None:
    plan = view_pins([rollout(uid=uid)], NODE)
    assert plan.pins == {} and plan.refused == ("serving/llm",)


def test_the_layout_is_one_definition() -> None:
    cache = "/var/cache/weightship"
    assert viewlayout.view_root(cache, U1) == f"{cache}/views/{U1}"
    assert viewlayout.view_model_dir(cache, U1, A) == f"{cache}/views/{U1}/models/{'a' * 64}/files"
    assert viewlayout.ready_marker(cache, U1, A) == f"{cache}/views/{U1}/ready/{'a' * 64}"
    assert str(view_root(Path(cache), U1)) == viewlayout.view_root(cache, U1)


def _folder(path: Path, size: int) -> Path:
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(os.urandom(size))
    return path


def test_without_in_place_rollouts_the_cache_is_untouched(store: ChunkStore) -> None:
    assert Views(store).sync({}) == Views(store).sync({})
    assert not (store.root / "views").exists()
