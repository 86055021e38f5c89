#!/usr/bin/env bash
# Build the MinIO, RabbitMQ and Toxiproxy images the integration tests start through testcontainers.
# Works with no image registry: the Debian base is made with debootstrap and imported, and is tagged
# with the name the Dockerfiles expect, so the same Dockerfiles build on a laptop that can pull.
# Idempotent: images already present are kept unless FORCE=1.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
suite=$(python3 -c "import tomllib;print(tomllib.load(open('$root/pyproject.toml','rb'))['tool']['vidx']['pins']['debian_suite'])")
base="docker.io/library/debian:${suite}-slim"
cache=${VIDX_CACHE_DIR:-/var/cache/vidx}
mkdir -p "$cache"

have() { docker image inspect "$1" >/dev/null 2>&1; }

if [ "${FORCE:-0}" = 1 ] || ! have "$base"; then
  if ! docker pull -q "$base" >/dev/null 2>&1; then
    echo "building the $suite base image with debootstrap (no registry reachable)"
    tarball="$cache/debian-${suite}-minbase.tar"
    if [ ! -s "$tarball" ]; then
      rootfs=$(mktemp -d)
      debootstrap --variant=minbase "$suite" "$rootfs" >"$cache/debootstrap.log" 2>&1 \
        || { echo "debootstrap failed; see $cache/debootstrap.log" >&2; exit 1; }
      tar -C "$rootfs" -cf "$tarball.tmp" . && mv "$tarball.tmp" "$tarball"
      rm -rf "$rootfs"
    fi
    docker import "$tarball" "$base" >/dev/null
  fi
fi

# An image whose Dockerfile copies in one binary built here: name, binary, its name in the image.
binary_image() {
  if [ "${FORCE:-0}" = 1 ] || ! have "vidx/$1:test"; then
    ctx=$(mktemp -d)
    cp "$here/$1/Dockerfile" "$ctx/"
    cp "$2" "$ctx/$3"
    docker build -q -t "vidx/$1:test" "$ctx" >/dev/null
    rm -rf "$ctx"
  fi
}

binary_image minio "$("$root/infra/local/install-minio.sh")" minio
if [ "${FORCE:-0}" = 1 ] || ! have vidx/rabbitmq:test; then
  docker build -q -t vidx/rabbitmq:test "$here/rabbitmq" >/dev/null
fi
binary_image toxiproxy "$("$root/infra/local/install-toxiproxy.sh")" toxiproxy-server
echo "images ready: vidx/minio:test vidx/rabbitmq:test vidx/toxiproxy:test"
