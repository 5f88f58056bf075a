#!/usr/bin/env bash
# Refresh the lock files in requirements/ (`make lock`): one per environment, every
# package pinned with its hashes, compiled by the pinned uv of the dev venv (pyproject's
# dev extra) for CPython 3.11 on x86_64 Linux (glibc >= 2.28), what the image, the dev venv
# and the vLLM venv run on.
#
#   runtime.txt  the operator's image (Dockerfile): pyproject.toml's dependencies
#   build.txt    the image's build stage: the build backend (hatchling)
#   dev.txt      the dev and test venv (make venv): extras dev, torch, bench + devtools
#   vllm.txt     the vLLM venv of the process nodes (hack/deps.sh vllm)
#
# A refresh keeps every pin that still satisfies the inputs (uv prefers the versions in an
# existing output file); UPGRADE=1 re-resolves to the newest versions PyPI serves, and
# UPGRADE_PACKAGE=name upgrades that one package only. tests/unit/test_locks.py fails when
# pyproject.toml and the locks disagree.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
UV="${UV:-$REPO/.venv/bin/uv}"

args=(
  --quiet
  --generate-hashes
  --python-version 3.11
  --python-platform x86_64-manylinux_2_28
  --custom-compile-command "make lock"
)
[[ -n "${UPGRADE:-}" ]] && args+=(--upgrade)
[[ -n "${UPGRADE_PACKAGE:-}" ]] && args+=(--upgrade-package "$UPGRADE_PACKAGE")

compile() {
  echo "[lock] requirements/$1" >&2
  "$UV" pip compile "${args[@]}" "${@:2}" -o "requirements/$1"
}

compile runtime.txt pyproject.toml
compile build.txt requirements/build.in
compile dev.txt requirements/dev.in \
  --no-emit-package weightship --no-emit-package weightship-devtools
compile vllm.txt requirements/vllm.in --override requirements/vllm-overrides.txt
