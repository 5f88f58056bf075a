"""An earlier release of weightship, built from this repository's history for upgrade tests.

`build(commit)` writes `git archive <commit>` of this repository to
`$WEIGHTSHIP_CACHE/weightship-release-<tag>/tree` (outside the repo, keyed by commit) and
makes a venv beside it, `$WEIGHTSHIP_CACHE/weightship-release-<tag>/bin/weightship`: the
working tree's locked runtime dependencies (requirements/runtime.txt, from uv's cache)
and the old tree's operator package with `--no-deps`. The process kubelet runs the image
`weightship:<tag>` from that venv (weightship_dev.kubelet.images), so a chart installed
from the old tree with `image.tag=<tag>` runs the old operator and agents. A finished
build leaves a `.built` marker and is reused as it is.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

from weightship_dev.kubelet.images import release_venv

REPO = Path(__file__).resolve().parents[2]

# The previous release the upgrade test starts from: main just before the leader-election
# / drain / pod-template-typing series (4f34de0, cd77f43, 3b5f3f6), the newest state of
# main whose chart and CRD differ from today's. Its chart has no leader election (no
# --leader-elect, no Lease Role, no PodDisruptionBudget) and does not let a scoped
# operator list namespaces; its ModelRollout CRD has an untyped spec.template.spec and
# no bound on prefetch.bandwidthLimit's length; its operator scales pods down without
# draining them first. An older pin, before the in-place fields (effcf76), would add
# CRD fields too; it was not tried: in-place also changed how ReplicaSets select their
# pods (weightship.io/template-hash), a bigger step than one release's upgrade.
PREVIOUS_RELEASE = "d508bb1f"


@dataclass(frozen=True)
class Release:
    commit: str  # full hash
    tag: str  # the image tag that runs it: weightship:<tag>
    root: Path  # the venv (bin/weightship), and the tree below it
    tree: Path  # `git archive` of the commit: its chart, crds/ and operator package

    @property
    def chart(self) -> Path:
        return self.tree / "charts" / "weightship"

    @property
    def crds(self) -> Path:
        return self.tree / "crds"

    @property
    def weightship(self) -> Path:
        return self.root / "bin" / "weightship"


def resolve_commit(ref: str) -> str:
    return subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--verify", f"{ref}^{{commit}}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


def release_tag(commit: str) -> str:
    """The image tag of a release built from `commit`: `r-` and its first 12 hex digits."""
    return f"r-{commit[:12]}"


def build(ref: str = PREVIOUS_RELEASE) -> Release:
    """The release of `ref` (a commit of this repository), built once and cached."""
    commit = resolve_commit(ref)
    tag = release_tag(commit)
    root = release_venv(tag)
    release = Release(commit, tag, root, root / "tree")
    marker = root / ".built"
    if marker.exists() and marker.read_text().strip() == commit:
        return release
    shutil.rmtree(root, ignore_errors=True)
    uv = Path(sys.executable).parent / "uv"  # the dev lock's pinned uv
    _run([str(uv), "venv", "--quiet", "--python", sys.executable, str(root)])
    release.tree.mkdir(parents=True)
    archive = root / "tree.tar"
    _run(["git", "-C", str(REPO), "archive", "--format=tar", "-o", str(archive), commit])
    with tarfile.open(archive) as tar:
        tar.extractall(release.tree, filter="data")
    archive.unlink()
    python = str(root / "bin" / "python")
    pip = [str(uv), "pip", "install", "--quiet", "--python", python]
    # The project's locked dependencies (runtime and the build backend), from uv's cache;
    # the old package itself with --no-deps, built by that backend.
    for lock in ("runtime.txt", "build.txt"):
        _run([*pip, "--require-hashes", "--no-deps", "-r", str(REPO / "requirements" / lock)])
    _run([*pip, "--no-deps", "--no-build-isolation", str(release.tree)])
    if not release.weightship.exists():
        raise RuntimeError(f"building {commit}: no {release.weightship}")
    marker.write_text(commit + "\n")
    return release


def _run(argv: list[str]) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed:\n{proc.stdout}\n{proc.stderr}")


if __name__ == "__main__":
    built = build(sys.argv[1] if len(sys.argv) > 1 else PREVIOUS_RELEASE)
    print(f"{built.commit} -> image tag {built.tag}: {built.weightship}")
