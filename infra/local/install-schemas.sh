#!/usr/bin/env bash
# Fetch the Go modules whose files the manifest tests validate against (pyproject.toml
# [tool.vidx.pins]: kuberay, compose_spec) into Go's module cache, once per machine, and print the
# schema files' paths. Only downloads (no build); the tests read the files from the cache offline.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
command -v go >/dev/null || { echo "Go is needed to fetch the manifest schemas (infra/local/install-system.sh)" >&2; exit 1; }
pins() { python3 -c "import tomllib;p=tomllib.load(open('$root/pyproject.toml','rb'))['tool']['vidx']['pins'];print(p['$1'])"; }
# Outside any module, so no go.mod is read or written; Go's own cache is the only state.
cd "$(mktemp -d)"
trap 'rmdir "$PWD" 2>/dev/null || true' EXIT
fetch() {  # pin, file inside the module
  local dir
  dir=$(GOFLAGS=-mod=mod go mod download -json "$1" | python3 -c "import json,sys;d=json.load(sys.stdin);print(d.get('Dir') or sys.exit(d.get('Error','no module directory')))")
  [ -f "$dir/$2" ] || { echo "$1 has no $2" >&2; exit 1; }
  echo "$dir/$2"
}
fetch "$(pins kuberay)" config/crd/bases/ray.io_rayservices.yaml
fetch "$(pins compose_spec)" schema/compose-spec.json
