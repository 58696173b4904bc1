#!/usr/bin/env bash
# Builds Baton's image (Containerfile) with podman, from nothing a registry must serve:
#   1. a base image: a Debian bookworm root file system with Debian's Python 3.11, made by
#      debootstrap from Debian's packages and imported (cached as a tarball in ~/.cache/baton);
#   2. a wheelhouse: Baton's wheel and every runtime dependency, built here by pip;
#   3. the image, installing the wheelhouse offline into a virtualenv.
# Usage: build.sh IMAGE [EXTRAS]. With BASE_IMAGE set (docker.io/library/python:3.11-slim-bookworm,
# say), step 1 is skipped and that base is used. Progress goes to stderr.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
image="${1:?usage: build.sh IMAGE [EXTRAS]}"
extras="${2:-}"
export CONTAINERS_CONF="$here/containers.conf"
step() { echo "deploy/image: $*" >&2; }

if ! command -v podman >/dev/null || ! command -v runc >/dev/null \
  || ! command -v debootstrap >/dev/null; then
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "deploy/image: podman, runc and debootstrap are needed; install them (Debian:" \
      "apt-get install podman runc debootstrap) and run again" >&2
    exit 2
  fi
  step "installing podman, runc and debootstrap from Debian's packages"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
    podman runc debootstrap uidmap >/dev/null
fi

base="${BASE_IMAGE:-}"
if [ -z "$base" ]; then
  # What debootstrap is asked for is the base's key: a change builds a new one.
  suite=bookworm packages=python3,python3-venv,ca-certificates,wget
  key="$(echo "minbase $suite $packages" | sha256sum | cut -c1-12)"
  base="localhost/baton-base:$suite-$key"
  if ! podman image exists "$base"; then
    tarball="$HOME/.cache/baton/image-base-$key.tar"
    if [ ! -f "$tarball" ]; then
      step "debootstrap: a Debian $suite root file system with $packages (about a minute)"
      rootfs="$(mktemp -d)"
      trap 'rm -rf "$rootfs"' EXIT
      debootstrap --variant=minbase --include="$packages" "$suite" "$rootfs" \
        http://deb.debian.org/debian >/dev/null
      rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
      mkdir -p "$(dirname "$tarball")"
      tar -C "$rootfs" -cf "$tarball.part" . && mv "$tarball.part" "$tarball"
    fi
    step "importing $tarball as $base"
    podman import --quiet "$tarball" "$base" >/dev/null
  fi
fi

step "the wheelhouse: Baton${extras:+[$extras]} and its runtime dependencies"
wheelhouse="$root/build/wheelhouse"
rm -rf "$wheelhouse"
python="${PYTHON:-python3}"
"$python" -m pip wheel --quiet --wheel-dir "$wheelhouse" "$root${extras:+[$extras]}"

step "building $image on $base"
previous="$(podman image inspect --format '{{.Id}}' "$image" 2>/dev/null || true)"
podman build --quiet --layers=false --file "$root/Containerfile" --build-arg "BASE_IMAGE=$base" \
  --build-arg "EXTRAS=$extras" --tag "$image" "$root"
# The image this build replaced, untagged now: gone, unless a container still uses it.
if [ -n "$previous" ] && [ "$previous" != "$(podman image inspect --format '{{.Id}}' "$image")" ]; then
  podman rmi "$previous" >/dev/null 2>&1 || true
fi
