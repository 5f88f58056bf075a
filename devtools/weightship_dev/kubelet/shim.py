"""Runs inside a pod's network and mount namespaces, then execs the container's command.

Started as `ip netns exec <ns> unshare --uts -- python -m weightship_dev.kubelet.shim SPEC`.
`ip netns exec` already gave this process a private mount namespace (mounts made here
never reach the host) and bound /etc/netns/<ns>/{hosts,resolv.conf} over /etc.
Kept free of third-party imports: it runs once per container start.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path


def _mount(*args: str) -> None:
    proc = subprocess.run(["mount", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"weightship-shim: mount {' '.join(args)}: {proc.stderr.strip()}")


def _under(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def _stash_shadowed(keep: list[str], destinations: list[str]) -> dict[str, Path]:
    """The "image" is the host: its interpreter, virtualenv and source must stay visible
    even when a volume is mounted over a parent of theirs (an emptyDir at /tmp over a
    checkout in /tmp). Bind them aside first; `_restore` puts them back on top."""
    stashed = {}
    for i, path in enumerate(keep):
        if any(_under(path, d) and path != d for d in destinations):
            aside = Path("/run/weightship-keep") / f"{os.getpid()}-{i}"
            aside.mkdir(parents=True, exist_ok=True)
            _mount("--bind", path, str(aside))
            stashed[path] = aside
    return stashed


def _restore(stashed: dict[str, Path], *, read_only: bool) -> None:
    for path, aside in stashed.items():
        Path(path).mkdir(parents=True, exist_ok=True)
        _mount("--bind", str(aside), path)
        if read_only:
            _mount("-o", "remount,bind,ro", path)
        subprocess.run(["umount", str(aside)], check=False, capture_output=True)
        aside.rmdir()


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    socket.sethostname(spec["hostname"])
    stashed = _stash_shadowed(spec.get("keep") or [], [m["dst"] for m in spec["mounts"]])
    for m in spec["mounts"]:
        dst = Path(m["dst"])
        if Path(m["src"]).is_dir():
            dst.mkdir(parents=True, exist_ok=True)
        elif not dst.exists():
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.touch()
        _mount("--bind", m["src"], str(dst))
        if m.get("readOnly"):
            _mount("-o", "remount,bind,ro", str(dst))
    _restore(stashed, read_only=bool(spec.get("readOnlyRootFilesystem")))
    if spec.get("readOnlyRootFilesystem"):
        _mount("-o", "remount,bind,ro", "/")
    workdir = spec.get("workingDir") or "/"
    gid, uid = spec.get("gid"), spec.get("uid")
    if spec.get("supplementalGroups") is not None:
        os.setgroups(spec["supplementalGroups"])
    if gid is not None:
        os.setgid(gid)
    if uid is not None:
        os.setuid(uid)
    os.chdir(workdir)
    argv = spec["argv"]
    env = spec["env"]
    try:
        os.execvpe(argv[0], argv, env)  # noqa: S606 - exec is the shim's job
    except OSError as e:
        raise SystemExit(f"weightship-shim: exec {argv[0]!r}: {e}") from e


if __name__ == "__main__":
    main(sys.argv[1])
