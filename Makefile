# weightship: two commands on a fresh machine are `make demo` and `make test`.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export PATH := $(abspath $(BIN)):$(PATH)

.PHONY: demo test lint unit e2e bench deps venv cluster-up cluster-down cluster-status crds clean

$(STAMP): pyproject.toml devtools/pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev,torch]' -e ./devtools
	touch $(STAMP)

venv: $(STAMP)

# Build (once, cached in ~/.cache/weightship keyed by version) the control plane, etcd,
# KWOK, the S3 server, helm; install Prometheus and iproute2 from Debian.
deps:
	bash hack/deps.sh all >/dev/null

lint: venv
	$(BIN)/ruff check operator devtools tests e2e bench argocd
	$(BIN)/ruff format --check operator devtools tests e2e bench argocd
	$(BIN)/mypy

unit: venv
	$(BIN)/pytest tests -q

e2e: venv deps
	$(BIN)/pytest e2e -q

# The whole suite: lint, unit and e2e (the e2e tests start the local cluster if needed).
test: venv deps lint
	$(BIN)/pytest -m "not bench" --durations=25

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
