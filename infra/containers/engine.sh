#!/usr/bin/env bash
# Start (idempotently) a Docker-compatible API in front of podman and print the variables
# testcontainers needs. Usage: eval "$(infra/containers/engine.sh)"
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
state=${VIDX_ENGINE_DIR:-/tmp/vidx-engine}
sock="$state/podman.sock"
mkdir -p "$state"
export CONTAINERS_CONF="$here/containers.conf"
if [ -n "${DOCKER_HOST:-}" ] && [ "${DOCKER_HOST}" != "unix://$sock" ] && docker version >/dev/null 2>&1; then
  # A real Docker engine is already configured (a laptop): use it as it is.
  echo "export DOCKER_HOST=$DOCKER_HOST"
  exit 0
fi
if [ -S /var/run/docker.sock ] && DOCKER_HOST=unix:///var/run/docker.sock docker version >/dev/null 2>&1; then
  echo "export DOCKER_HOST=unix:///var/run/docker.sock"
  exit 0
fi
if ! DOCKER_HOST="unix://$sock" docker version >/dev/null 2>&1; then
  command -v podman >/dev/null || { echo "podman is not installed: run 'make install'" >&2; exit 1; }
  rm -f "$sock"
  # From /: the service outlives the checkout that started it, and conmon fails every container start
  # ("Failed to get working directory") once the service's working directory is deleted.
  cd /
  nohup podman system service --time=0 "unix://$sock" >"$state/podman.log" 2>&1 &
  for _ in $(seq 1 50); do
    DOCKER_HOST="unix://$sock" docker version >/dev/null 2>&1 && break
    sleep 0.2
  done
  DOCKER_HOST="unix://$sock" docker version >/dev/null 2>&1 || { echo "podman API did not come up; see $state/podman.log" >&2; exit 1; }
fi
echo "export CONTAINERS_CONF=$here/containers.conf"
echo "export DOCKER_HOST=unix://$sock"
echo "export TESTCONTAINERS_RYUK_DISABLED=true"
echo "export TESTCONTAINERS_CONNECTION_MODE=docker_host"
