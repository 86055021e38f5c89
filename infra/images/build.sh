#!/usr/bin/env bash
# Build the MinIO, RabbitMQ, Toxiproxy and HAProxy images the integration tests start through testcontainers.
# Works with no image registry: the Debian base is made with debootstrap and imported, and is tagged
# with the name the Dockerfiles expect, so the same Dockerfiles build on a laptop that can pull.
# Idempotent: an image whose build context is unchanged is kept unless FORCE=1.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
suite=$(python3 -c "import tomllib;print(tomllib.load(open('$root/pyproject.toml','rb'))['tool']['vidx']['pins']['debian_suite'])")
base="docker.io/library/debian:${suite}-slim"
cache=${VIDX_CACHE_DIR:-/var/cache/vidx}
mkdir -p "$cache"

have() { docker image inspect "$1" >/dev/null 2>&1; }
# A short digest of an image's build context (its folder, plus a binary built here): an image is rebuilt
# when its Dockerfile, its files or its binary changed, not only when it is missing.
digest() { { (cd "$here/$1" && find . -type f -print0 | sort -z | xargs -0 sha256sum); [ -z "${2:-}" ] || sha256sum <"$2"; } | sha256sum | cut -c1-16; }
current() { [ "$(docker image inspect -f '{{ index .Config.Labels "vidx.context" }}' "$2" 2>/dev/null)" = "$1" ]; }

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

# Build vidx/NAME:test from infra/images/NAME, with one binary built here copied in when given: name,
# binary, its name in the image.
image() {
  local sum
  sum=$(digest "$1" "${2:-}")
  if [ "${FORCE:-0}" = 1 ] || ! current "$sum" "vidx/$1:test"; then
    ctx=$(mktemp -d)
    trap 'rm -rf "$ctx"' EXIT
    cp -r "$here/$1/." "$ctx/"
    [ -z "${2:-}" ] || cp "$2" "$ctx/$3"
    docker build -q --label "vidx.context=$sum" -t "vidx/$1:test" "$ctx" >/dev/null
    rm -rf "$ctx"
  fi
}

image minio "$("$root/infra/local/install-minio.sh")" minio
image rabbitmq
image toxiproxy "$("$root/infra/local/install-toxiproxy.sh")" toxiproxy-server
image haproxy
echo "images ready: vidx/minio:test vidx/rabbitmq:test vidx/toxiproxy:test vidx/haproxy:test"
