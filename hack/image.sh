#!/usr/bin/env bash
# `make image`: build the operator image from the Dockerfile with the builder the machine
# has (docker with a running daemon, else podman, else buildah; none: podman and runc from
# Debian through hack/deps.sh), tagged IMAGE:VERSION (the chart's default tag, its
# appVersion) and IMAGE:VERSION-COMMIT (pyproject's version, the git commit).
#
#   hack/image.sh build                      build; prints both references on stdout
#   hack/image.sh push                       push both (IMAGE must name a registry)
#   hack/image.sh run [--entrypoint=X] ARGS  run IMAGE:VERSION-COMMIT as the chart runs it:
#                                            read-only root, non-root, no capabilities
#   hack/image.sh labels                     print IMAGE:VERSION-COMMIT's labels (JSON)
#   hack/image.sh base                       print the base image, making it if needed
#
# Environment: IMAGE (default weightship), BASE_IMAGE (default the Dockerfile's; where that
# cannot be pulled, a Debian base made with debootstrap), BUILDER (docker, podman or buildah),
# WEIGHTSHIP_CACHE (default ~/.cache/weightship), DEBIAN_MIRROR, DEBIAN_SECURITY_MIRROR.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${WEIGHTSHIP_CACHE:-$HOME/.cache/weightship}"
IMAGE="${IMAGE:-weightship}"
DEBIAN_SUITE=bookworm  # python3 3.11, as pyproject's requires-python and the locks need
DEBIAN_MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
DEBIAN_SECURITY_MIRROR="${DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}"
# What goes into the image; a change to any of these since the commit makes the tag -dirty.
INPUTS=(Dockerfile .dockerignore pyproject.toml README.md LICENSE operator requirements)

log() { echo "[image] $*" >&2; }
die() {
  echo "[image] error: $*" >&2
  exit 1
}

VERSION="$(python3 -c 'import sys, tomllib; print(tomllib.load(open(sys.argv[1], "rb"))["project"]["version"])' "$REPO/pyproject.toml")"
REVISION="$(git -C "$REPO" rev-parse HEAD 2>/dev/null)" || die "$REPO is not a git checkout: the image's tag and revision label need its commit"
TAG="$VERSION-${REVISION:0:12}"
if [[ -n "$(git -C "$REPO" status --porcelain -- "${INPUTS[@]}")" ]]; then
  TAG+=-dirty REVISION+=-dirty
fi
REFS=("$IMAGE:$VERSION" "$IMAGE:$TAG")

pick_builder() {
  if [[ -n "${BUILDER:-}" ]]; then
    [[ "$BUILDER" == @(docker|podman|buildah) ]] || die "BUILDER=$BUILDER: use docker, podman or buildah"
    command -v "$BUILDER" >/dev/null || die "BUILDER=$BUILDER is not installed"
  elif command -v docker >/dev/null && docker info >/dev/null 2>&1; then
    BUILDER=docker
  elif command -v podman >/dev/null; then
    BUILDER=podman
  elif command -v buildah >/dev/null; then
    BUILDER=buildah
  else
    log "no image builder here (docker with a running daemon, podman or buildah): installing podman and runc from Debian"
    bash "$REPO/hack/deps.sh" image-builder >/dev/null
    BUILDER=podman
  fi
  case "$BUILDER" in
    docker) export DOCKER_BUILDKIT=1 ;; # build secrets need BuildKit
    # RUN steps in a chroot: no OCI runtime, cgroups or nested namespaces needed, so the
    # build works inside containers and VMs where podman's default isolation does not.
    podman | buildah) export BUILDAH_ISOLATION="${BUILDAH_ISOLATION:-chroot}" ;;
  esac
}

image_exists() {
  case "$BUILDER" in
    docker) docker image inspect "$1" >/dev/null 2>&1 ;;
    podman) podman image exists "$1" ;;
    buildah) buildah inspect --type image "$1" >/dev/null 2>&1 ;;
  esac
}

# The Dockerfile's base if the builder has it or can pull it; BASE_IMAGE set by hand is used
# as it is (its pull's error is the build's). Otherwise a base made from Debian's packages.
base_image() {
  if [[ -n "${BASE_IMAGE:-}" ]]; then
    echo "$BASE_IMAGE"
    return
  fi
  local default err
  default="$(sed -n 's/^ARG BASE_IMAGE=//p' "$REPO/Dockerfile")"
  [[ -n "$default" ]] || die "the Dockerfile has no 'ARG BASE_IMAGE=' default"
  if image_exists "$default" || err="$("$BUILDER" pull -q "$default" 2>&1 >/dev/null)"; then
    echo "$default"
    return
  fi
  log "cannot pull $default ($(tail -n1 <<<"$err")): using a base made from Debian $DEBIAN_SUITE's python3 with debootstrap instead"
  debian_base
}

# Debian's minbase with python3 and its venv module, security updates applied, committed
# as localhost/weightship-base:<suite>-<hash of this recipe>. The root filesystem's tarball
# is cached in $CACHE/image-base (about 1 min to make, once); an edit of the recipe makes a
# new one. Refresh the updates by deleting that folder.
BASE_PACKAGES=python3,python3-venv,ca-certificates
make_rootfs() {
  local dir="$1" root="$1/rootfs"
  command -v debootstrap >/dev/null || bash "$REPO/hack/deps.sh" debootstrap >/dev/null
  ((EUID == 0)) || die "making the Debian base needs root (debootstrap); or set BASE_IMAGE to a python >= 3.11 image your builder can pull"
  rm -rf "$root"
  debootstrap --variant=minbase --include="$BASE_PACKAGES" "$DEBIAN_SUITE" "$root" "$DEBIAN_MIRROR" >&2
  cat >"$root/etc/apt/sources.list" <<EOF
deb $DEBIAN_MIRROR $DEBIAN_SUITE main
deb $DEBIAN_MIRROR $DEBIAN_SUITE-updates main
deb $DEBIAN_SECURITY_MIRROR $DEBIAN_SUITE-security main
EOF
  chroot "$root" env DEBIAN_FRONTEND=noninteractive sh -c \
    'apt-get update -qq && apt-get upgrade -y -qq && apt-get clean' >&2
  # Not needed at run time; the runtime gives /etc/resolv.conf.
  rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/log/* \
    "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/usr/share/locale/*
  : >"$root/etc/resolv.conf"
  tar --numeric-owner -C "$root" -cf "$dir/rootfs.tar.partial" .
  mv "$dir/rootfs.tar.partial" "$dir/rootfs.tar"
  rm -rf "$root"
}

debian_base() {
  local key dir ref
  key="$(printf '%s\n' "$DEBIAN_SUITE" "$BASE_PACKAGES" "$(declare -f make_rootfs)" | sha256sum | cut -c1-12)"
  ref="localhost/weightship-base:$DEBIAN_SUITE-$key"
  dir="$CACHE/image-base/$DEBIAN_SUITE-$key"
  if ! image_exists "$ref"; then
    mkdir -p "$dir"
    if [[ ! -f "$dir/rootfs.tar" ]]; then
      log "making the Debian $DEBIAN_SUITE base with debootstrap into $dir (about 1 min, once)"
      make_rootfs "$dir"
    fi
    printf 'FROM scratch\nADD rootfs.tar /\nENV LANG=C.UTF-8\nCMD ["python3"]\n' >"$dir/Containerfile"
    "$BUILDER" build -q -f "$dir/Containerfile" -t "$ref" "$dir" >/dev/null
  fi
  echo "$ref"
}

# The host pip's CA bundle (PIP_CERT or pip's `cert` setting), which a proxy that re-signs
# TLS makes necessary; empty when the host's pip trusts the defaults.
pip_ca() {
  local ca="${PIP_CERT:-}"
  [[ -n "$ca" ]] || ca="$(python3 -m pip config get global.cert 2>/dev/null || true)"
  [[ -z "$ca" || -r "$ca" ]] || die "pip's CA bundle $ca (PIP_CERT or pip config's cert) is not readable"
  echo "$ca"
}

build() {
  local base ca args
  base="$(base_image)"
  args=(build -f "$REPO/Dockerfile" -t "${REFS[0]}" -t "${REFS[1]}"
    --build-arg "BASE_IMAGE=$base" --build-arg "VERSION=$VERSION" --build-arg "REVISION=$REVISION"
    # The Dockerfile's LABELs from these build args are right for a fresh build, but buildah
    # (podman) reuses a cached LABEL layer when only an ARG's value changed (buildah issue
    # 5501): a rebuild at a new commit kept the old commit's revision. --label is applied
    # to the final image whatever was cached.
    --label "org.opencontainers.image.version=$VERSION" --label "org.opencontainers.image.revision=$REVISION"
    --label "org.opencontainers.image.base.name=$base")
  [[ "$BUILDER" != buildah ]] || args+=(--layers) # podman and docker keep layers by default
  ca="$(pip_ca)"
  if [[ -n "$ca" ]]; then
    log "pip in the build trusts $ca, the host pip's CA bundle (a build secret, not kept in the image)"
    args+=(--secret "id=pip-ca,src=$ca")
  fi
  log "building ${REFS[1]} with $BUILDER on $base"
  "$BUILDER" "${args[@]}" "$REPO" >&2
  printf '%s\n' "${REFS[@]}"
}

push() {
  local first="${IMAGE%%/*}" ref
  [[ "$IMAGE" == */* && ("$first" == *.* || "$first" == *:* || "$first" == localhost) ]] ||
    die "IMAGE=$IMAGE names no registry to push to: make image IMAGE=registry.example.com/team/weightship push"
  for ref in "${REFS[@]}"; do
    image_exists "$ref" || die "$ref is not built: run make image IMAGE=$IMAGE first"
    log "pushing $ref"
    "$BUILDER" push "$ref" >&2
  done
}

# Read-only root with a tmpfs at /tmp (the chart's emptyDir), the image's non-root user,
# every capability dropped, no privilege gain, no network.
run() {
  local global=() flags=(--rm --read-only --user 65532:65532 --cap-drop=ALL --security-opt=no-new-privileges --network=none)
  image_exists "${REFS[1]}" || die "${REFS[1]} is not built: run make image first"
  case "$BUILDER" in
    buildah) die "hack/image.sh run needs podman or docker (buildah only builds)" ;;
    docker) flags+=(--tmpfs /tmp) ;; # podman's --read-only mounts one itself
    podman)
      # runc where installed: Debian 12's crun refuses hybrid cgroup v1 hosts. Podman asks
      # for nofile and nproc limits above what it has itself where it lacks
      # CAP_SYS_RESOURCE (runc: "error setting rlimits ... operation not permitted"): ask
      # for modest ones, ample for the operator and the agent.
      ! command -v runc >/dev/null || global+=(--runtime "$(command -v runc)")
      local nofile
      nofile="$(ulimit -Hn)"
      [[ "$nofile" != unlimited ]] && ((nofile < 65536)) || nofile=65536
      flags+=(--ulimit "nofile=$nofile:$nofile" --ulimit nproc=4096:4096)
      ;;
  esac
  [[ "${1:-}" != --entrypoint=* ]] || {
    flags+=("$1")
    shift
  }
  "$BUILDER" "${global[@]}" run "${flags[@]}" "${REFS[1]}" "$@"
}

labels() {
  image_exists "${REFS[1]}" || die "${REFS[1]} is not built: run make image first"
  case "$BUILDER" in
    buildah) buildah inspect --type image --format '{{json .OCIv1.Config.Labels}}' "${REFS[1]}" ;;
    *) "$BUILDER" image inspect --format '{{json .Config.Labels}}' "${REFS[1]}" ;;
  esac
}

main() {
  local what="${1:-build}"
  shift || true
  pick_builder
  case "$what" in
    build) build ;;
    push) push ;;
    run) run "$@" ;;
    labels) labels ;;
    base) base_image ;;
    *) die "unknown command $what (build, push, run, labels, base)" ;;
  esac
}
main "$@"
