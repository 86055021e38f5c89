#!/usr/bin/env bash
# Install the system packages vidx needs on a Debian machine (idempotent): RabbitMQ, podman with
# runc and a Docker-compatible API for testcontainers, debootstrap for base images, ffmpeg (bench),
# Chromium (browser tests), Tesseract's English model and Flite (the words in a video). MinIO is
# built from source separately (install-minio.sh). Needs root (or sudo) and Debian's package mirror.
set -euo pipefail
need=()
command -v rabbitmq-server >/dev/null 2>&1 || [ -x /usr/sbin/rabbitmq-server ] || need+=(rabbitmq-server)
command -v podman >/dev/null 2>&1 || need+=(podman)
command -v runc >/dev/null 2>&1 || need+=(runc)
command -v debootstrap >/dev/null 2>&1 || [ -x /usr/sbin/debootstrap ] || need+=(debootstrap)
dpkg -s uidmap slirp4netns fuse-overlayfs >/dev/null 2>&1 || need+=(uidmap slirp4netns fuse-overlayfs)
command -v go >/dev/null 2>&1 || need+=(golang-go)
# The web page's browser tests (tests/e2e/test_web_page.py) drive it through Playwright.
command -v chromium >/dev/null 2>&1 || need+=(chromium)
# The decode benchmark's baseline: what a user would otherwise write (ffmpeg's fps filter).
command -v ffmpeg >/dev/null 2>&1 || need+=(ffmpeg)
# The words in a video: Tesseract's English model (pipeline/text/ocr.py); Flite's voices and the
# DejaVu fonts make the text tests' and bench.relevance's clips (infra/dev/textclips.py).
dpkg -s tesseract-ocr-eng >/dev/null 2>&1 || need+=(tesseract-ocr-eng)
command -v flite >/dev/null 2>&1 || need+=(flite)
dpkg -s fonts-dejavu-core >/dev/null 2>&1 || need+=(fonts-dejavu-core)
if [ ${#need[@]} -gt 0 ]; then
  sudo=""; [ "$(id -u)" = 0 ] || sudo=sudo
  echo "installing system packages: ${need[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}" >/dev/null
  # Debian starts the system broker on install; vidx runs its own (vidx up) or a container (tests).
  if [[ " ${need[*]} " == *" rabbitmq-server "* ]]; then
    $sudo service rabbitmq-server stop >/dev/null 2>&1 || true
  fi
fi
echo "system packages ready"
