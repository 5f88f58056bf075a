"""The operator's wheel (what the image installs) ships the product and nothing of the test rig."""

from __future__ import annotations

import ast
import os
import subprocess
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RIG_PACKAGES = ("weightship_dev", "weightship_testing")


def make_wheel(dist: Path) -> Path:
    """`make wheel`: the wheel a vLLM image COPYs in (docs/integrations.md)."""
    subprocess.run(["make", "-s", "wheel", f"DIST={dist}"], cwd=REPO, check=True, timeout=300)
    (wheel,) = dist.glob("weightship-*.whl")
    return wheel


def test_operator_wheel_contains_only_the_weightship_package(tmp_path: Path) -> None:
    wheel = make_wheel(tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    code = [n for n in names if n.endswith(".py")]
    assert code, names
    outside = [n for n in code if not n.startswith("weightship/")]
    assert outside == []
    rig = [n for n in code if any(p in n for p in ("kubelet", "tinyllm", "tinyvllm", "/dev/"))]
    assert rig == [], f"test-rig code in the operator wheel: {rig}"
    # Test fixtures live in devtools' weightship_testing (samples, core) since issue 41.
    fixtures = [n for n in code if n.endswith(("/samples.py", "/testing.py"))]
    assert fixtures == [], f"test fixtures in the operator wheel: {fixtures}"


def test_the_operator_package_never_imports_the_test_rig() -> None:
    offenders = []
    for path in sorted((REPO / "operator" / "weightship").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                modules = [node.module or ""]
            else:
                continue
            offenders += [
                f"{path.relative_to(REPO)}: {m}" for m in modules if m.split(".")[0] in RIG_PACKAGES
            ]
    assert offenders == []


def test_the_image_copies_only_the_operator_sources() -> None:
    copies = [
        line.split()[1]
        for line in (REPO / "Dockerfile").read_text().splitlines()
        if line.startswith("COPY ") and "--from" not in line
    ]
    assert "devtools" not in " ".join(copies)
    assert "operator" in copies


def test_the_wheel_installs_into_the_vllm_venv_and_vllm_loads_its_plugin(tmp_path: Path) -> None:
    """docs/integrations.md's vLLM image: `make wheel`'s wheel, installed with --no-deps by
    the vLLM venv's own pip (hack/deps.sh builds it from requirements/vllm.txt; the
    "vLLM image" of the process nodes), is all the plugin needs: vLLM's plugin loader finds
    it by its entry point and registers the `weightship` load format, from the wheel's
    files (they come first on the path, before the venv's editable checkout)."""
    from weightship_dev.kubelet.images import vllm_venv

    python = vllm_venv() / "bin" / "python"
    if not python.exists():
        pytest.fail(f"no vLLM venv at {vllm_venv()}: run `bash hack/deps.sh vllm` (make deps)")
    wheel = make_wheel(tmp_path / "dist")
    target = tmp_path / "site"
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index",
         "--target", str(target), str(wheel)],
        check=True, timeout=300,
    )  # fmt: skip
    check = f"""
import weightship
assert weightship.__file__.startswith({str(target)!r}), weightship.__file__
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm.model_executor import model_loader
loader = model_loader._LOAD_FORMAT_TO_MODEL_LOADER["weightship"]
import sys
print("weightship load format registered from", sys.modules[loader.__module__].__file__)
"""
    env = {**os.environ, "PYTHONPATH": str(target), "VLLM_PLUGINS": "weightship"}
    result = subprocess.run(
        [str(python), "-c", check], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"registered from {target}/weightship/" in result.stdout
