"""The process kubelet runs `weightship:<tag>` from the release venv built for that tag,
and every other weightship image from the working tree (its PATH)."""

from __future__ import annotations

from pathlib import Path

import pytest

from weightship_dev.kubelet import images


def built(cache: Path, tag: str) -> Path:
    script = cache / f"weightship-release-{tag}" / "bin" / "weightship"
    script.parent.mkdir(parents=True)
    script.touch()
    return script


@pytest.mark.parametrize(
    ("image", "tag"),
    [
        ("ghcr.io/weightship/weightship:r-d508bb1f1234", "r-d508bb1f1234"),
        ("weightship:local", "local"),
        ("registry.local:5000/weightship:v1", "v1"),
        ("registry.local:5000/weightship", None),
        ("ghcr.io/weightship/weightship@sha256:abc", None),
        ("ghcr.io/weightship/weightship:v1@sha256:abc", "v1"),
    ],
)
def test_image_tag(image: str, tag: str | None) -> None:
    assert images.image_tag(image) == tag


def test_a_built_release_tag_runs_its_venv_and_any_other_tag_the_working_tree(
    tmp_path: Path,
) -> None:
    script = built(tmp_path, "r-old")
    assert images.weightship_entrypoint("ghcr.io/weightship/weightship:r-old", tmp_path) == [
        str(script)
    ]
    for image in (
        "ghcr.io/weightship/weightship:local",  # no release built for it
        "ghcr.io/weightship/weightship",  # no tag
        "ghcr.io/weightship/weightship@sha256:abc",
        "weightship:..",  # never a path outside the cache
    ):
        assert images.weightship_entrypoint(image, tmp_path) == ["weightship"], image


def test_resolve_runs_the_release_with_the_images_uid_and_the_pods_args(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WEIGHTSHIP_CACHE", str(tmp_path))
    script = built(tmp_path, "r-old")
    entry = images.resolve("ghcr.io/weightship/weightship:r-old", None, ["agent"])
    assert entry.argv == [str(script), "agent"] and entry.default_uid == 65532
    assert images.release_venv("r-old") == script.parents[1]
    # A container's own command wins, as over any image's entrypoint.
    entry = images.resolve("ghcr.io/weightship/weightship:r-old", ["weightship"], ["agent"])
    assert entry.argv == ["weightship", "agent"]
    assert images.resolve("weightship:new", None, ["agent"]).argv == ["weightship", "agent"]
