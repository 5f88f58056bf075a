"""Readiness, liveness and startup probes, run from the host against the pod's IP."""

from __future__ import annotations

import http.client
import socket
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from weightship_dev.kubelet.podspec import port_number


@dataclass
class ProbeState:
    """Kubernetes probe bookkeeping: thresholds count consecutive results."""

    spec: Mapping[str, Any]
    started_at: float
    last_run: float = 0.0
    successes: int = 0
    failures: int = 0
    passing: bool = False
    last_message: str = ""

    def due(self, now: float) -> bool:
        if now - self.started_at < float(self.spec.get("initialDelaySeconds", 0)):
            return False
        return now - self.last_run >= float(self.spec.get("periodSeconds", 10))

    def record(self, ok: bool, message: str, now: float) -> None:
        self.last_run = now
        self.last_message = message
        if ok:
            self.successes += 1
            self.failures = 0
            if self.successes >= int(self.spec.get("successThreshold", 1)):
                self.passing = True
        else:
            self.failures += 1
            self.successes = 0
            if self.failures >= int(self.spec.get("failureThreshold", 3)):
                self.passing = False

    @property
    def failed_out(self) -> bool:
        return self.failures >= int(self.spec.get("failureThreshold", 3))


def run_probe(
    spec: Mapping[str, Any], container: Mapping[str, Any], pod_ip: str, netns: str
) -> tuple[bool, str]:
    timeout = float(spec.get("timeoutSeconds", 1))
    if http_get := spec.get("httpGet"):
        return _http_get(http_get, container, pod_ip, timeout)
    if tcp := spec.get("tcpSocket"):
        port = port_number(container, tcp["port"])
        try:
            with socket.create_connection((tcp.get("host") or pod_ip, port), timeout=timeout):
                return True, ""
        except OSError as e:
            return False, f"dial tcp {pod_ip}:{port}: {e}"
    if exec_ := spec.get("exec"):
        try:
            proc = subprocess.run(
                ["ip", "netns", "exec", netns, *exec_["command"]],
                capture_output=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired:
            return False, f"command timed out after {timeout:.0f}s"
        return proc.returncode == 0, proc.stdout.decode(errors="replace")[-200:]
    return False, "probe has no handler"


def _http_get(
    spec: Mapping[str, Any], container: Mapping[str, Any], pod_ip: str, timeout: float
) -> tuple[bool, str]:
    port = port_number(container, spec["port"])
    host = spec.get("host") or pod_ip
    path = spec.get("path") or "/"
    conn_cls = (
        http.client.HTTPSConnection if spec.get("scheme") == "HTTPS" else http.client.HTTPConnection
    )
    conn = conn_cls(host, port, timeout=timeout)
    try:
        headers = {h["name"]: h["value"] for h in spec.get("httpHeaders") or []}
        conn.request("GET", path, headers={"User-Agent": "kube-probe/1.34", **headers})
        resp = conn.getresponse()
        resp.read(1024)
        ok = 200 <= resp.status < 400
        return ok, "" if ok else f"HTTP probe failed with statuscode: {resp.status}"
    except (OSError, http.client.HTTPException) as e:
        return False, f'Get "http://{host}:{port}{path}": {e}'
    finally:
        conn.close()


def monotonic() -> float:
    return time.monotonic()
