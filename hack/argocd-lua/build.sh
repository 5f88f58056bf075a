#!/usr/bin/env bash
# Build argocd-lua (Argo CD's own Lua VM, for the tests of argocd/) into the bin dir $1.
# Called by hack/deps.sh; the build tree lives in the cache, never in the repo.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
build="${WEIGHTSHIP_CACHE:-$HOME/.cache/weightship}/build/argocd-lua"
rm -rf "$build" && mkdir -p "$build"
cp "$here/main.go" "$here/go.mod" "$here/go.sum" "$build/"
cd "$build"
CGO_ENABLED=0 GOFLAGS=-mod=mod go build -trimpath -ldflags "-s -w" -o "$1/argocd-lua" .
