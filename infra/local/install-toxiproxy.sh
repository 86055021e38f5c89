#!/usr/bin/env bash
# Build Shopify's Toxiproxy (the TCP fault proxy the nemesis puts between the app and MinIO/RabbitMQ)
# at the pinned version (pyproject.toml [tool.vidx.pins].toxiproxy) with `go install`, once per
# machine, and print the binary's path (about a minute on 2 cores).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
pin=$(python3 -c "import tomllib;print(tomllib.load(open('$root/pyproject.toml','rb'))['tool']['vidx']['pins']['toxiproxy'])")
version=${pin##*@}
dest=${VIDX_CACHE_DIR:-/var/cache/vidx}/toxiproxy/$version
if [ ! -x "$dest/server" ]; then
  command -v go >/dev/null || { echo "Go is needed to build Toxiproxy" >&2; exit 1; }
  mkdir -p "$dest"
  echo "building Toxiproxy $version with go install (about a minute, once per machine)" >&2
  GOBIN="$dest" GOFLAGS=-mod=mod go install "$pin" >&2
fi
echo "$dest/server"
