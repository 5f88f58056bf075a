"""Start, find and stop the local cluster's daemons, tracked by pid files."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie is not alive for our purposes.
    with contextlib.suppress(OSError):
        if Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z":
            return False
    return True


def read_pid(pid_file: Path) -> int | None:
    try:
        return int(pid_file.read_text().strip())
    except (OSError, ValueError):
        return None


def running(pid_file: Path) -> int | None:
    pid = read_pid(pid_file)
    return pid if pid is not None and pid_alive(pid) else None


def start_daemon(
    name: str,
    argv: list[str],
    *,
    pids: Path,
    logs: Path,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> int:
    """Start `argv` detached in its own session, unless it already runs. Returns its pid."""
    pids.mkdir(parents=True, exist_ok=True)
    logs.mkdir(parents=True, exist_ok=True)
    pid_file = pids / f"{name}.pid"
    if (pid := running(pid_file)) is not None:
        return pid
    with open(logs / f"{name}.log", "ab") as log:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **(env or {})},
            cwd=cwd,
        )
    pid_file.write_text(str(proc.pid))
    return proc.pid


def stop_daemon(pid_file: Path, *, grace: float = 10.0) -> None:
    """SIGTERM the daemon's process group, then SIGKILL it after `grace` seconds."""
    pid = read_pid(pid_file)
    if pid is not None and pid_alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
    pid_file.unlink(missing_ok=True)


def tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
