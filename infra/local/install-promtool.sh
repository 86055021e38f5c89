#!/usr/bin/env bash
# Build Prometheus's promtool at the pinned version (pyproject.toml [tool.vidx.pins].promtool) with
# `go install`, once per machine, and print the binary's path. About 6 minutes on 2 cores, so
# `--background` starts the build and returns at once (make install does this: the build overlaps the
# other steps and the tests); a later call without it waits for that build (one build at a time, under
# a lock) and then prints the path.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
pin=$(python3 -c "import tomllib;print(tomllib.load(open('$root/pyproject.toml','rb'))['tool']['vidx']['pins']['promtool'])")
version=${pin##*@}
dest=${VIDX_CACHE_DIR:-/var/cache/vidx}/promtool/$version
mkdir -p "$dest"
build() {
  exec 9>"$dest/.lock"
  flock 9
  if [ ! -x "$dest/promtool" ]; then
    command -v go >/dev/null || { echo "Go is needed to build promtool" >&2; exit 1; }
    echo "building promtool $version with go install (a few minutes, once per machine)" >&2
    GOBIN="$dest" GOFLAGS=-mod=mod go install "$pin" >"$dest/build.log" 2>&1 || { cat "$dest/build.log" >&2; exit 1; }
  fi
}
if [ "${1:-}" = "--background" ]; then
  [ -x "$dest/promtool" ] || (build &) >/dev/null 2>&1
  exit 0
fi
build
echo "$dest/promtool"
