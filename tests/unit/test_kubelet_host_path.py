"""The process kubelet checks hostPath types as a kubelet does (issue 12, High 3): a rollout
pod's `Directory`/`File` mounts of a staged model wait until the agent staged it."""

from __future__ import annotations

from pathlib import Path

import pytest

from weightship_dev.kubelet.podspec import PodSpecError
from weightship_dev.kubelet.volumes import host_path, materialize


def test_directory_and_file_must_exist_as_such(tmp_path: Path) -> None:
    model = tmp_path / "var/cache/weightship/models/ab"
    with pytest.raises(PodSpecError, match="not a directory"):
        host_path(tmp_path, "/var/cache/weightship/models/ab/files", "Directory")
    with pytest.raises(PodSpecError, match="not a file"):
        host_path(tmp_path, "/var/cache/weightship/models/ab/STAGED", "File")
    assert not model.exists(), "a type check must not create what it checks"
    (model / "files").mkdir(parents=True)
    (model / "STAGED").write_text("")
    assert host_path(tmp_path, "/var/cache/weightship/models/ab/files", "Directory") == (
        (model / "files").resolve()
    )
    assert host_path(tmp_path, "/var/cache/weightship/models/ab/STAGED", "File").is_file()
    with pytest.raises(PodSpecError, match="not a file"):
        host_path(tmp_path, "/var/cache/weightship/models/ab/files", "File")


def test_or_create_types_create(tmp_path: Path) -> None:
    assert host_path(tmp_path, "/a/b", "DirectoryOrCreate").is_dir()
    assert host_path(tmp_path, "/c/d", "FileOrCreate").is_file()
    assert host_path(tmp_path, "/e", "").is_dir()


def test_a_host_path_never_leaves_the_node_root(tmp_path: Path) -> None:
    node = tmp_path / "node"
    node.mkdir()
    (node / "link").symlink_to(tmp_path)
    for path in ("/../../etc", "/link/elsewhere"):
        with pytest.raises(PodSpecError, match="leaves the node's root"):
            host_path(node, path, "DirectoryOrCreate")


def test_a_secret_volume_is_readable_by_the_pods_fs_group(tmp_path: Path) -> None:
    """The agents' credential Secret is mounted 0400; a non-root agent reads it through the
    pod's fsGroup, as on a real kubelet."""

    class Objects:
        def secret(self, namespace: str, name: str, optional: bool) -> dict[str, str]:
            return {"AWS_ACCESS_KEY_ID": "a"}

    pod = {
        "metadata": {"name": "agent", "namespace": "ns"},
        "spec": {"securityContext": {"fsGroup": 65532}},
    }
    volume = {"name": "s3", "secret": {"secretName": "s3", "defaultMode": 0o400}}
    target = materialize(
        pod,
        volume,
        pod_dir=tmp_path / "pod",
        node_root=tmp_path / "root",
        source=Objects(),  # type: ignore[arg-type]
        pod_ip="10.0.0.2",
        host_ip="10.0.0.1",
    )
    info = (target / "AWS_ACCESS_KEY_ID").stat()
    assert (info.st_gid, info.st_mode & 0o777) == (65532, 0o440)
