# vidx — the commands the README tells people to run. `make test` is exactly what CI runs.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3.11
ENGINE = eval "$$(infra/containers/engine.sh)"

.PHONY: install promtool system venv minio toxiproxy schemas images ready lint typecheck test test-unit bench demo down clean help

help:
	@echo "make demo   install everything, start the stack, index sample videos, search them"
	@echo "make test   install everything and run lint, types and every test tier (what CI runs)"
	@echo "make bench  run every benchmark; writes bench/results/latest.json and docs/benchmarks.md"
	@echo "make down   stop the local stack"

install: promtool system venv minio schemas

# The Go builds need Go; where it is missing, install-system.sh installs it first.
GO_FIRST := $(if $(shell command -v go 2>/dev/null),,system)

# Prometheus's rule checker for the alert rules' test: its build (minutes) starts first and runs on
# in the background; the test waits for it (infra/local/install-promtool.sh).
promtool: $(GO_FIRST)
	@infra/local/install-promtool.sh --background

system:
	infra/local/install-system.sh

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

venv: $(VENV)/.installed

minio: $(GO_FIRST)
	@infra/local/install-minio.sh >/dev/null

toxiproxy: $(GO_FIRST)
	@infra/local/install-toxiproxy.sh >/dev/null

# The schemas the manifest tests check against (Go module downloads, no build).
schemas: $(GO_FIRST)
	@infra/local/install-schemas.sh >/dev/null

images: system minio toxiproxy
	$(ENGINE) && infra/images/build.sh

# Everything the tests need, and the static checks: side by side where one does not need another (the
# downloads of apt, pip and debootstrap overlap the Go builds); each step's output is printed whole.
ready: install images lint typecheck

lint: venv
	$(VENV)/bin/ruff check pipeline events storage infra tests bench

typecheck: venv
	$(VENV)/bin/mypy

test-unit: venv
	$(PY) -m pytest tests/unit -q

# Every tier; a skipped integration or e2e test fails the run (VIDX_NO_SKIPS).
test:
	@$(MAKE) --no-print-directory -j4 --output-sync=target ready
	$(ENGINE) && VIDX_NO_SKIPS=1 $(PY) -m pytest tests -q -p no:cacheprovider --durations=20

# Every benchmark with its baseline, ≤ 32 minutes on 2 cores (BENCH_ARGS=--full for bigger inputs).
bench: install images
	$(ENGINE) && $(PY) -m bench $(BENCH_ARGS)

demo: install
	$(VENV)/bin/vidx demo

down: venv
	$(VENV)/bin/vidx down

clean: down
	rm -rf .vidx
