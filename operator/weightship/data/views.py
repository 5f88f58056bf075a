"""Per-rollout read-only views of the node cache: exactly the models one rollout pins.

A pod of a rollout with ``updatePolicy: InPlaceIfPossible`` swaps to the next revision's
weights without restarting, so it must be able to read models that were not known when
it started, and nothing else: no other rollout's weights. Its only node mount is its
rollout's view, which the node agent keeps equal to what that rollout pins (canary,
stable, retiring) and this node has fully staged:

    <cacheDir>/views/<rollout-uid>/
        models/<hex>/files/<path>    hard links to <cacheDir>/models/<hex>/files/<path>
        models/<hex>/manifest.json   a hard link to the staged manifest
        models/<hex>/STAGED          written last, once every link is in place, so
                                     `weightship.loader.locate_staged(<view>, digest)`
                                     never sees a model half linked
        ready/<hex>                  an empty file: the start gate of the pods created
                                     for <hex> (below)
    <cacheDir>/views/.trash/         what was taken out, deleted a bounded amount per pass

Hard links, not copies or bind mounts: same filesystem, no bytes copied, nothing mounted
by the agent, and a staged file never changes (content-addressed, verified, renamed into
place once). A link outlives its original, so eviction and views are kept consistent:
the agent never evicts a model any view links (its digests join the pinned set), and a
view drops a model as soon as its rollout no longer pins it here; a view entry whose
original is gone or was staged again (another manifest.json inode) is dropped and
rebuilt. Taking a model out of a view is one rename into ``.trash`` (instant, whatever
its size), so a view never names an unpinned model, however much deleting is left.

The start gate. The view folder exists once its first model is linked, so a `Directory`
hostPath of it alone would let a pod created for the *next* revision start before that
revision is linked. Pods also mount ``ready/<hex>`` of their own revision (`File`): the
kubelet waits until the agent writes it, right after the model's STAGED. Unlike the
model, a receipt outlives its pin (the newest `KEEP_READY` of them): a pod swapped in
place to another revision keeps its original revision's mount, and a container restart
must still find it. A receipt holds no bytes of anything; a receipt of a digest that is
pinned again but not linked yet is removed, so new pods of it wait again.

Everything is derived from the disk and the wanted pins on each pass: nothing lives only
in memory, so a restarted agent carries on where it stopped (and checks every link of
every view once, in case a crash cut a pass short).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import uuid
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from weightship.data.chunkstore import ChunkStore, fsync_dir
from weightship.data.viewlayout import HEX_PATTERN, READY_DIR, UID_PATTERN, VIEWS_DIR, check_uid
from weightship.weightformat.cachedir import (
    FILES_DIR,
    MANIFEST_FILE,
    MODELS_DIR,
    STAGED_MARKER,
    manifest_digest_hex,
)
from weightship.weightformat.manifest import Manifest, ManifestError

TRASH_DIR = ".trash"
KEEP_READY = 16  # receipts of revisions no longer pinned, kept for restarting pods
DEFAULT_BUDGET = 4096  # file operations (links, checks, deletions) per pass


class ViewError(RuntimeError):
    """A model cannot be shown in a view (its staged copy is not what it should be)."""


def view_root(cache_root: Path, uid: str) -> Path:
    """``<cacheDir>/views/<uid>`` (viewlayout.view_root, as a Path)."""
    return cache_root / VIEWS_DIR / check_uid(uid)


@dataclass
class Budget:
    """File operations left in this pass."""

    left: int

    def take(self, n: int = 1) -> bool:
        if self.left < n:
            self.left = 0
            return False
        self.left -= n
        return True


@dataclass
class SyncReport:
    """What one pass did, and whether work is left for the next one."""

    linked: list[tuple[str, str]] = field(default_factory=list)  # (uid, digest) completed
    removed: list[tuple[str, str]] = field(default_factory=list)  # (uid, hex) taken out
    views_removed: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    pending: bool = False  # the budget ran out: call again soon


class Views:
    """The views under ``store.root / "views"``. Not thread-safe: one caller at a time."""

    def __init__(self, store: ChunkStore, *, keep_ready: int = KEEP_READY) -> None:
        self.store = store
        self.root = store.root / VIEWS_DIR
        self.trash = self.root / TRASH_DIR
        self.keep_ready = keep_ready
        self._manifests: dict[str, Manifest] = {}  # digest -> parsed (immutable) manifest
        self._checked: set[tuple[str, str]] = set()  # (uid, hex) whose every link was checked
        # (uid, hex) -> where linking or checking stopped when a pass ran out of budget.
        # Memory only to save work: a restarted agent starts over, and gets as far.
        self._cursor: dict[tuple[str, str], int] = {}

    # ---- reading --------------------------------------------------------------------------
    def uids(self) -> set[str]:
        """The rollouts that have a view on this node."""
        return {name for name, _ in self._view_dirs()}

    def contents(self) -> dict[str, set[str]]:
        """uid -> the digests its view shows (STAGED written)."""
        out: dict[str, set[str]] = {}
        for uid, path in self._view_dirs():
            out[uid] = {
                "sha256:" + hex_
                for hex_, entry in _model_entries(path / MODELS_DIR)
                if (entry / STAGED_MARKER).is_file()
            }
        return out

    def linked_digests(self) -> set[str]:
        """Every digest any view holds links of, complete or not: these are never
        evicted (a link would keep the bytes alive, unaccounted for)."""
        return {
            "sha256:" + hex_
            for _, path in self._view_dirs()
            for hex_, _ in _model_entries(path / MODELS_DIR)
        }

    # ---- one pass -------------------------------------------------------------------------
    def sync(self, want: Mapping[str, Collection[str]], budget: int = DEFAULT_BUDGET) -> SyncReport:
        """Make the views match ``want`` (rollout uid -> the digests it pins on this node):
        a model is shown once it is staged here, and taken out at once when it is no
        longer pinned; a view whose uid is not in ``want`` goes. At most ``budget`` file
        operations; ``pending`` says when more are left. Idempotent."""
        report = SyncReport()
        left = Budget(budget)
        if not want and not self.root.exists():
            return report  # no rollout here has ever had a view: nothing to touch
        self.root.mkdir(parents=True, exist_ok=True)
        self.trash.mkdir(exist_ok=True)
        wanted: dict[str, set[str]] = {}
        for uid, digests in want.items():
            if not UID_PATTERN.fullmatch(uid):
                report.errors.append(f"refused a view for {uid[:80]!r}: not a rollout uid")
                continue
            hexes = set()
            for d in digests:
                try:
                    hexes.add(manifest_digest_hex(d))
                except ValueError as e:
                    report.errors.append(f"view {uid}: {e}")
            wanted[uid] = hexes
        # Removals first, and each is one rename: whatever the budget, no view shows a
        # model its rollout does not pin after this loop.
        for entry in _entries(self.root):
            if entry.name == TRASH_DIR:
                continue
            if entry.name not in wanted or not _is_dir(entry):
                self._remove_view(Path(entry.path), report)
        for uid in sorted(wanted):
            try:
                self._sync_view(uid, wanted[uid], left, report)
            except OSError as e:
                report.errors.append(f"view {uid}: {type(e).__name__}: {e}")
        keep = set().union(*wanted.values())
        self._manifests = {
            d: m for d, m in self._manifests.items() if manifest_digest_hex(d) in keep
        }
        if not self._empty_trash(left):
            report.pending = True
        if left.left == 0:
            report.pending = True
        return report

    def _sync_view(self, uid: str, hexes: set[str], left: Budget, report: SyncReport) -> None:
        root = self.root / uid
        models = root / MODELS_DIR
        for entry in _entries(root):
            if entry.name not in (MODELS_DIR, READY_DIR) or not _is_dir(entry):
                self._discard(Path(entry.path))  # nothing else belongs in a view
        for hex_, path in _model_entries(models, everything=True):
            if hex_ not in hexes or not self._current(path, hex_):
                self._discard(path)
                self._forget(uid, hex_)
                report.removed.append((uid, hex_))
        for hex_ in sorted(hexes):
            digest = "sha256:" + hex_
            if not self.store.is_staged(digest) or left.left == 0:
                continue
            try:
                if self._link_model(uid, digest, models / hex_, left):
                    report.linked.append((uid, digest))
            except (OSError, ManifestError, ViewError) as e:
                report.errors.append(f"view {uid}: cannot link {digest}: {e}")
                self._discard(models / hex_)
                self._forget(uid, hex_)
        # Shown: STAGED written (an entry whose links are still being checked after a
        # restart included: it was complete when it was written).
        shown = {h for h in hexes if (models / h / STAGED_MARKER).is_file()}
        self._sync_ready(root / READY_DIR, hexes, shown)

    def _current(self, path: Path, hex_: str) -> bool:
        """Whether a view entry still shows the model staged now: the store has it staged
        and the entry's manifest is the store's very file (a model evicted and staged
        again has a new one); an entry still being built has no manifest yet."""
        staged = self.store.model_dir("sha256:" + hex_)
        if not (staged / STAGED_MARKER).is_file():
            return False
        mine = path / MANIFEST_FILE
        return not _exists(mine) or _same_file(mine, staged / MANIFEST_FILE)

    def _link_model(self, uid: str, digest: str, dest: Path, left: Budget) -> bool:
        """Link every file of a staged model into ``dest``, then write STAGED; True when
        this call wrote STAGED. Stops where the budget runs out (the next call goes on).
        Links already in place are checked once per process, and afterwards only
        through STAGED and the manifest's inode (`_current`)."""
        hex_ = manifest_digest_hex(digest)
        if (dest / STAGED_MARKER).is_file() and (uid, hex_) in self._checked:
            return False
        src = self.store.model_dir(digest)
        manifest = self._manifest(digest)
        shown = (dest / STAGED_MARKER).is_file()
        key = (uid, hex_)
        at = self._cursor.get(key, -1)  # -1: the manifest; then files in manifest order
        (dest / FILES_DIR).mkdir(parents=True, exist_ok=True)
        while at < len(manifest.files):
            if not left.take():
                self._cursor[key] = at
                return False
            if at < 0:
                _link(src / MANIFEST_FILE, dest / MANIFEST_FILE)
            else:
                path = manifest.files[at].path
                target = dest / FILES_DIR / path
                if not _same_file(target, src / FILES_DIR / path):
                    target.parent.mkdir(parents=True, exist_ok=True)
                    _link(src / FILES_DIR / path, target)
            at += 1
        self._cursor.pop(key, None)
        if not shown:
            # The store may have lost it meanwhile (evicted while it was not pinned yet):
            # show it only if what was linked is still its staged copy.
            if not self._current(dest, hex_) or not _exists(dest / MANIFEST_FILE):
                raise ViewError(f"{digest} is no longer staged in the node cache")
            dirs = {(dest / FILES_DIR / f.path).parent for f in manifest.files}
            for d in sorted(dirs | {dest / FILES_DIR}, key=lambda p: len(p.parts), reverse=True):
                fsync_dir(d)
            tmp = dest / f".{STAGED_MARKER}.tmp"
            tmp.write_text(digest + "\n")
            tmp.replace(dest / STAGED_MARKER)
            fsync_dir(dest)
        self._checked.add((uid, hex_))
        return not shown

    def _sync_ready(self, ready: Path, pinned: set[str], shown: set[str]) -> None:
        """A receipt for every model shown; none for a pinned one not shown (yet); of
        revisions no longer pinned, the newest ``keep_ready`` (pods born on them)."""
        if shown:
            ready.mkdir(parents=True, exist_ok=True)
        old: list[tuple[float, Path]] = []
        for entry in _entries(ready):
            path = Path(entry.path)
            if not HEX_PATTERN.fullmatch(entry.name) or not entry.is_file(follow_symlinks=False):
                self._discard(path)
            elif entry.name in pinned and entry.name not in shown:
                path.unlink(missing_ok=True)
            elif entry.name not in pinned:
                old.append((entry.stat(follow_symlinks=False).st_mtime, path))
        for _, path in sorted(old, reverse=True)[self.keep_ready :]:
            path.unlink(missing_ok=True)
        for hex_ in shown:
            receipt = ready / hex_
            if not receipt.is_file():
                fd = os.open(receipt, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o644)
                os.close(fd)

    # ---- removal --------------------------------------------------------------------------
    def _remove_view(self, root: Path, report: SyncReport) -> None:
        """Take a view away: its models first (each one rename), then the folder."""
        for hex_, path in _model_entries(root / MODELS_DIR, everything=True):
            self._discard(path)
            report.removed.append((root.name, hex_))
        self._discard(root)
        self._checked = {k for k in self._checked if k[0] != root.name}
        self._cursor = {k: v for k, v in self._cursor.items() if k[0] != root.name}
        report.views_removed.append(root.name)

    def _forget(self, uid: str, hex_: str) -> None:
        self._checked.discard((uid, hex_))
        self._cursor.pop((uid, hex_), None)

    def _discard(self, path: Path) -> None:
        """Move ``path`` into the trash: gone from the view at once, deleted later."""
        self.trash.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            path.rename(self.trash / uuid.uuid4().hex)

    def _empty_trash(self, left: Budget) -> bool:
        """Delete what the trash holds, within the budget; True when it is empty."""
        return all(_delete_tree(Path(e.path), left) for e in _entries(self.trash))

    # ---- helpers --------------------------------------------------------------------------
    def _manifest(self, digest: str) -> Manifest:
        found = self._manifests.get(digest)
        if found is None:
            path = self.store.model_dir(digest) / MANIFEST_FILE
            found = Manifest.parse(path.read_bytes(), source=str(path))
            if found.digest != digest:
                raise ViewError(f"{path} is the manifest of {found.digest}, not {digest}")
            self._manifests[digest] = found
        return found

    def _view_dirs(self) -> Iterator[tuple[str, Path]]:
        for entry in _entries(self.root):
            if UID_PATTERN.fullmatch(entry.name) and _is_dir(entry):
                yield entry.name, Path(entry.path)


def _entries(path: Path) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(path) as it:
            return sorted(it, key=lambda e: e.name)
    except (FileNotFoundError, NotADirectoryError):
        return []


def _model_entries(models: Path, *, everything: bool = False) -> list[tuple[str, Path]]:
    """(name, path) of a view's model folders; with ``everything`` also whatever else is
    there (so that it is taken out)."""
    return [
        (e.name, Path(e.path))
        for e in _entries(models)
        if everything or (HEX_PATTERN.fullmatch(e.name) and _is_dir(e))
    ]


def _is_dir(entry: os.DirEntry[str]) -> bool:
    return entry.is_dir(follow_symlinks=False)


def _exists(path: Path) -> bool:
    return os.path.lexists(path)


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samestat(os.lstat(a), os.lstat(b))
    except FileNotFoundError:
        return False


def _delete_tree(path: Path, left: Budget) -> bool:
    """Delete ``path`` (never following a link), one budget unit per file; True when
    it is gone."""
    if path.is_symlink() or not path.is_dir():
        if not left.take():
            return False
        path.unlink(missing_ok=True)
        return True
    for top, dirs, files in os.walk(path, topdown=False):
        for name in files:
            if not left.take():
                return False
            (Path(top) / name).unlink(missing_ok=True)
        for name in dirs:
            sub = Path(top) / name
            with contextlib.suppress(OSError):
                if sub.is_symlink():
                    sub.unlink()
                else:
                    sub.rmdir()
    with contextlib.suppress(OSError):
        path.rmdir()
    return not _exists(path)


def _link(src: Path, dst: Path) -> None:
    """Hard-link the regular file ``src`` at ``dst``, replacing whatever ``dst`` is."""
    info = os.lstat(src)
    if not stat.S_ISREG(info.st_mode):
        raise ViewError(f"{src} is not a regular file")
    if _exists(dst):
        if _same_file(src, dst):
            return
        if dst.is_dir() and not dst.is_symlink():
            shutil.rmtree(dst)
        else:
            dst.unlink()
    os.link(src, dst, follow_symlinks=False)
