"""The operator image (Dockerfile, .dockerignore, `make image` = hack/image.sh): what can be
read without building it, then a real build and runs of the built image as the chart runs
it (read-only root, non-root, no capabilities).

The build uses the machine's builder (docker with a daemon, else podman or buildah, else
podman from Debian) and, where the public Python base cannot be pulled (this machine), a
Debian base made with debootstrap, cached in ~/.cache/weightship/image-base: warm, the
whole module takes about 15 s; cold (nothing installed or cached) about 3 min."""

from __future__ import annotations

import json
import re
import subprocess
from functools import cache
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = (REPO / "Dockerfile").read_text()
IMAGE_SH = REPO / "hack" / "image.sh"


def instructions(name: str) -> list[str]:
    """The arguments of every `NAME ...` instruction, continuation lines joined."""
    joined = re.sub(r"\\\n\s*", " ", DOCKERFILE)
    return [line.split(None, 1)[1] for line in joined.splitlines() if line.startswith(name + " ")]


def copy_sources() -> list[str]:
    sources = []
    for args in instructions("COPY"):
        if args.startswith("--from"):
            continue
        sources += args.split()[:-1]
    return sources


def test_the_exposed_ports_are_the_charts_and_the_codes() -> None:
    from weightship.agent.config import DEFAULT_METRICS_PORT, DEFAULT_PEER_PORT

    values = yaml.safe_load((REPO / "charts" / "weightship" / "values.yaml").read_text())
    chart = {
        values["operator"]["livenessPort"],
        values["operator"]["metricsPort"],
        values["agent"]["peerPort"],
        values["agent"]["metricsPort"],
    }
    code = {8080, 9100, DEFAULT_PEER_PORT, DEFAULT_METRICS_PORT}  # cli --liveness, metrics
    (exposed,) = instructions("EXPOSE")
    assert {int(p) for p in exposed.split()} == chart == code


def dockerignore_excludes(path: str) -> bool:
    """Docker's rule: the last pattern that matches the path or one of its parents wins."""
    parts = path.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for raw in (REPO / ".dockerignore").read_text().splitlines():
        pattern = raw.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negated = pattern.startswith("!")
        pattern = pattern.lstrip("!")
        regex = re.escape(pattern).replace(r"\*\*/", "(.*/)?").replace(r"\*", "[^/]*")
        if any(re.fullmatch(regex, c) for c in candidates):
            excluded = not negated
    return excluded


def test_the_build_context_is_what_the_dockerfile_copies() -> None:
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    sources = copy_sources()
    assert "operator" in sources and "requirements/runtime.txt" in sources
    for path in tracked:
        copied = any(path == s or path.startswith(s + "/") for s in sources)
        assert dockerignore_excludes(path) != copied, path
    for path in [
        ".venv/bin/python",
        ".git/HEAD",
        "dist/weightship-0.1.0-py3-none-any.whl",
        "operator/weightship/__pycache__/cli.cpython-311.pyc",
        ".mypy_cache/x",
    ]:
        assert dockerignore_excludes(path), path


def test_the_labels_come_from_the_build_args_and_the_script_sets_them() -> None:
    (labels,) = instructions("LABEL")
    assert 'org.opencontainers.image.version="${VERSION}"' in labels
    assert 'org.opencontainers.image.revision="${REVISION}"' in labels
    assert "org.opencontainers.image.source=" in labels
    assert 'org.opencontainers.image.licenses="Apache-2.0"' in labels
    script = IMAGE_SH.read_text()
    assert '--build-arg "VERSION=$VERSION" --build-arg "REVISION=$REVISION"' in script
    assert "# syntax=" not in DOCKERFILE
    assert instructions("ARG")[0] == "BASE_IMAGE=docker.io/library/python:3.11-slim"
    assert [a.split()[0] for a in instructions("FROM")] == ["${BASE_IMAGE}"] * 2


def image_sh(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(IMAGE_SH), *args], cwd=REPO, capture_output=True, text=True, timeout=600
    )


@cache
def built() -> list[str]:
    """`make image` once per session; its two references."""
    done = subprocess.run(
        ["make", "-s", "image"], cwd=REPO, capture_output=True, text=True, timeout=900
    )
    if done.returncode:
        pytest.fail(f"make image failed:\n{done.stderr[-4000:]}")
    return done.stdout.split()


def test_make_image_tags_the_version_and_the_commit_and_labels_them() -> None:
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.strip()
    refs = built()
    assert refs[0] == "weightship:0.1.0"
    assert re.fullmatch(rf"weightship:0\.1\.0-{head[:12]}(-dirty)?", refs[1]), refs
    labels = json.loads(image_sh("labels").stdout)
    assert labels["org.opencontainers.image.version"] == "0.1.0"
    assert labels["org.opencontainers.image.revision"] in (head, head + "-dirty")
    assert labels["org.opencontainers.image.title"] == "weightship"


def test_the_built_image_runs_read_only_non_root_without_capabilities() -> None:
    built()
    help_ = image_sh("run", "--help")
    assert help_.returncode == 0, help_.stderr
    assert "operator" in help_.stdout and "agent" in help_.stdout
    for command in ("operator", "agent"):
        sub = image_sh("run", command, "--help")
        assert sub.returncode == 0 and "Usage: weightship " + command in sub.stdout, sub.stderr
    check = image_sh("run", "--entrypoint=pip", "check")
    assert (check.returncode, check.stdout.strip()) == (0, "No broken requirements found.")
    who = image_sh(
        "run",
        "--entrypoint=sh",
        "-c",
        "id -u; grep CapEff /proc/self/status; touch /tmp/ok && echo tmp-writable;"
        " touch /opt/weightship/x 2>&1 || true",
    )
    assert who.returncode == 0, who.stderr
    lines = who.stdout.splitlines()
    assert lines[:3] == ["65532", "CapEff:\t0000000000000000", "tmp-writable"]
    assert "Read-only file system" in lines[3]


INFERENCE_PACKAGES = {"torch", "vllm", "sglang"}
VLLM_SERVER = {"fastapi", "starlette"}


def test_the_image_holds_every_package_the_operator_and_agent_import() -> None:
    """Every weightship module imports from the image's runtime lock, except those of the
    inference images (torch, vLLM, SGLang: not runtime dependencies)."""
    built()
    probe = (
        "import importlib, pkgutil, weightship\n"
        "for m in pkgutil.walk_packages(weightship.__path__, 'weightship.'):\n"
        "    if m.name.endswith('__main__'): continue\n"
        "    try: importlib.import_module(m.name)\n"
        "    except ModuleNotFoundError as e: print(m.name, e.name)\n"
        "print('imported')\n"
    )
    done = image_sh("run", "--entrypoint=python", "-c", probe)
    assert done.returncode == 0, done.stderr
    *missing, last = done.stdout.splitlines()
    assert last == "imported"
    for line in missing:
        module, package = line.split()
        top = package.split(".")[0]
        # The vLLM plugin's endpoint runs inside vLLM's OpenAI server, which brings FastAPI.
        in_vllm = module.startswith("weightship.integrations.vllm.") and top in VLLM_SERVER
        assert top in INFERENCE_PACKAGES or in_vllm, line
    assert "weightship.controller.handlers" not in " ".join(missing)
    assert not [m for m in missing if m.startswith(("weightship.agent", "weightship.controller"))]
