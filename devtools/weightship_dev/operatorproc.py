"""`weightship operator` as its own process, for the e2e tests and bench_scale alike.

Its own process group (so a test can kill -9 it and whatever it started), and it dies
with the process that started it (PR_SET_PDEATHSIG): a pytest or a bench killed by
`timeout` or kill -9 leaks no operator on the shared cluster. The death signal follows the
thread that started it, so start it from a thread that outlives it (the main thread).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int) -> Callable[[], None]:
    """A preexec_fn: the child gets SIGKILL when `parent` (the starting thread) exits."""

    def preexec() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            os._exit(127)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(0)

    return preexec


@dataclass
class OperatorProcess:
    kubeconfig: Path
    log_path: Path
    namespaces: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)  # added to os.environ
    cwd: Path | None = None
    metrics_port: int = 0
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            "WEIGHTSHIP_METRICS_PORT": str(self.metrics_port),
            **self.env,
        }
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "weightship",
                    "operator",
                    "--standalone",
                    "--liveness",
                    "",
                    *(f"--namespace={n}" for n in self.namespaces),
                ],
                env=env,
                cwd=self.cwd,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=die_with_parent(os.getpid()),
            )

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def kill(self) -> None:
        """SIGKILL: no cleanup, as when a node dies under the operator."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None

    def stop(self, timeout_s: float = 15) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        self.proc = None

    def restart(self) -> None:
        self.kill()
        self.start()

    def tail(self, lines: int = 40) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def reconciled_at(self, namespace: str, name: str) -> float | None:
        """When this operator last finished a reconcile of the rollout (Unix time, from
        its /metrics: weightship_rollout_last_reconcile_timestamp_seconds); None before its
        first, or when it serves no metrics (metrics_port 0) or is down."""
        if not self.metrics_port:
            return None
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                text = resp.read().decode()
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return None
        for family in text_string_to_metric_families(text):
            if family.name != "weightship_rollout_last_reconcile_timestamp_seconds":
                continue
            for sample in family.samples:
                if sample.labels == {"namespace": namespace, "name": name}:
                    return float(sample.value)
        return None
