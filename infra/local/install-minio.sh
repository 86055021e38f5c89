#!/usr/bin/env bash
# Build MinIO from the pinned revision (pyproject.toml [tool.vidx.pins].minio) with `go install`,
# once per machine, and print the binary's path. The community edition is distributed as source only.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
pin=$(python3 -c "import tomllib;print(tomllib.load(open('$root/pyproject.toml','rb'))['tool']['vidx']['pins']['minio'])")
version=${pin##*@}
dest=${VIDX_CACHE_DIR:-/var/cache/vidx}/minio/$version
if [ ! -x "$dest/minio" ]; then
  command -v go >/dev/null || { echo "Go is needed to build MinIO (it ships as source only)" >&2; exit 1; }
  mkdir -p "$dest"
  echo "building MinIO $version with go install (a few minutes, once per machine)" >&2
  GOBIN="$dest" GOFLAGS=-mod=mod go install "$pin" >&2
fi
echo "$dest/minio"
