"""bench/gpu_check_inplace.py's parts that need no GPU and no vLLM: the two staged
revisions, the pod env, the swap token the plugin accepts, the plugin's entry points for a
Python without weightship installed, and the server's command line (its --dry-run)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from weightship.api.inference import SwapRequest
from weightship.integrations.serving import SwapAuth
from weightship.weightformat.cachedir import STAGED_MARKER

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_check_inplace.py"


@pytest.fixture(scope="module")
def check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check_inplace", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_dry_run_stages_two_revisions_and_builds_the_in_place_server(
    check: ModuleType, tmp_path: Path
) -> None:
    result = check.main(["--dry-run", "--workdir", str(tmp_path)])
    v1, v2 = result["digests"]["v1"], result["digests"]["v2"]
    assert v1 != v2
    for digest in (v1, v2):
        model = tmp_path / "cache" / "models" / digest.removeprefix("sha256:")
        assert (model / STAGED_MARKER).is_file() and (model / "files" / "config.json").is_file()
    argv = result["argv"]
    assert argv[argv.index("serve") + 1].endswith(f"{v1.removeprefix('sha256:')}/files")
    assert argv[argv.index("--load-format") + 1] == "weightship"
    assert argv[argv.index("--weight-transfer-config") + 1] == '{"backend": "weightship"}'
    assert "--tensor-parallel-size" not in argv


def test_the_token_opens_this_pods_swap_only(check: ModuleType, tmp_path: Path) -> None:
    models = check.Models(tmp_path, {"v1": "sha256:" + "1" * 64})
    env = check.pod_env(models, bytes(range(32)), tmp_path)
    digest = "sha256:" + "2" * 64
    token = check.swap_token(env, digest, 1_000_000.0)
    request = SwapRequest(digest, "v2")
    assert SwapAuth.from_env(env).check(f"Bearer {token}", request, 1_000_010.0) is None
    refused = SwapAuth.from_env({**env, "WEIGHTSHIP_POD_NAME": "another"}).check(
        f"Bearer {token}", request, 1_000_010.0
    )
    assert refused is not None and refused.status == 403
    check.check_token_offline(env, digest)  # the script's own check passes (no exit)


def test_plugin_entry_points_for_a_python_without_weightship(
    check: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert check.plugin_site(tmp_path) is None  # this venv has weightship installed
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: [])
    site = check.plugin_site(tmp_path)
    monkeypatch.undo()
    (dist,) = importlib.metadata.distributions(path=[str(site)])
    got = {(e.group, e.name, e.value) for e in dist.entry_points}
    assert got == {
        ("vllm.general_plugins", "weightship", "weightship.integrations.vllm:register"),
        (
            "vllm.endpoint_plugins",
            "weightship",
            "weightship.integrations.vllm.endpoint:endpoint_plugin",
        ),
    }
