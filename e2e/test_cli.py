"""The CLI fails like a kubectl plugin should, against the real API server: a missing
rollout, a forbidden request or an unreachable server prints one line naming what failed
and exits non-zero, for every subcommand."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from e2e.conftest import Cluster

pytestmark = pytest.mark.e2e

NAMESPACE_PREFIX = "cli-"
WEIGHTSHIP = shutil.which("weightship", path=str(Path(sys.executable).parent)) or "weightship"
SUBCOMMANDS = [
    ["status"],
    ["status", "-o", "json"],
    ["promote"],
    ["promote", "--full"],
    ["abort", "--no-wait"],
    ["retry", "--no-wait"],
]


def cli(kubeconfig: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [WEIGHTSHIP, *argv],
        env={**os.environ, "KUBECONFIG": str(kubeconfig)},
        capture_output=True,
        text=True,
        timeout=120,
    )


def one_line_error(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode != 0, done.stdout
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("Error: "), lines[0]
    assert "{" not in lines[0], lines[0]  # no raw JSON from the API
    return lines[0]


def kubeconfig_with(admin: Path, out: Path, *, server: str | None = None, token: str = "") -> Path:
    config: dict[str, Any] = yaml.safe_load(admin.read_text())
    if server is not None:
        config["clusters"][0]["cluster"]["server"] = server
    if token:
        config["users"][0]["user"] = {"token": token}
    out.write_text(yaml.safe_dump(config))
    return out


@pytest.mark.parametrize("argv", SUBCOMMANDS, ids=" ".join)
def test_missing_rollout_is_one_line_naming_it(
    cluster: Cluster, crds: None, namespace: str, argv: list[str]
) -> None:
    line = one_line_error(cli(cluster.paths.admin_kubeconfig, *argv, "nothere", "-n", namespace))
    assert line == f"Error: modelrollout {namespace}/nothere not found"


def test_forbidden_request_is_one_line(
    cluster: Cluster, crds: None, namespace: str, tmp_path: Path
) -> None:
    """A service account with no RBAC: every subcommand says forbidden and names the object."""
    core = cluster.core
    core.create_namespaced_service_account(namespace, {"metadata": {"name": "nobody"}})
    token = core.create_namespaced_service_account_token(
        "nobody",
        namespace,
        client.AuthenticationV1TokenRequest(spec=client.V1TokenRequestSpec(audiences=[])),
    ).status.token
    kubeconfig = kubeconfig_with(cluster.paths.admin_kubeconfig, tmp_path / "kc", token=token)
    for argv in SUBCOMMANDS:
        line = one_line_error(cli(kubeconfig, *argv, "llm", "-n", namespace))
        assert line.startswith("Error: forbidden: "), line
        assert "modelrollouts" in line and '"llm"' in line, line
        assert f"system:serviceaccount:{namespace}:nobody" in line, line


def test_unreachable_api_server_is_one_line(cluster: Cluster, tmp_path: Path) -> None:
    # A loopback port nothing listens on: refused at once, never a wait.
    kubeconfig = kubeconfig_with(
        cluster.paths.admin_kubeconfig, tmp_path / "kc", server="https://127.0.0.1:1"
    )
    for argv in (["status"], ["promote"]):
        line = one_line_error(cli(kubeconfig, *argv, "llm"))
        assert line.startswith("Error: cannot reach the API server at https://127.0.0.1:1"), line
