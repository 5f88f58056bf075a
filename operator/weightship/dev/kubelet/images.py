"""Map container images to local commands: process nodes pull no images.

A container with `command` runs that command (found on the kubelet's PATH, which holds
the project's virtualenv). A container without `command` runs its image's entrypoint
from IMAGE_ENTRYPOINTS, matched on the image's repository name without registry or tag.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    mapped = IMAGE_ENTRYPOINTS.get(repository_name(image))
    uid = mapped[1] if mapped else None
    if command:
        return Entrypoint([*command, *(args or [])], uid)
    if mapped is None:
        raise ImageNotMapped(
            f"image {image!r} has no local entrypoint: set `command`, or add "
            f"{repository_name(image)!r} to weightship.dev.kubelet.images.IMAGE_ENTRYPOINTS"
        )
    return Entrypoint([*mapped[0], *(args or [])], uid)
