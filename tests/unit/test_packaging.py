"""The operator's wheel (what the image installs) ships the product and nothing of the test rig."""

from __future__ import annotations

import ast
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RIG_PACKAGES = ("weightship_dev", "weightship_testing")


def test_operator_wheel_contains_only_the_weightship_package(tmp_path: Path) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            str(REPO),
        ],
        check=True,
    )
    (wheel,) = tmp_path.glob("weightship-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    code = [n for n in names if n.endswith(".py")]
    assert code, names
    outside = [n for n in code if not n.startswith("weightship/")]
    assert outside == []
    rig = [n for n in code if any(p in n for p in ("kubelet", "tinyllm", "tinyvllm", "/dev/"))]
    assert rig == [], f"test-rig code in the operator wheel: {rig}"


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
