"""How vidx runs: scripts, images, manifests, and the developer tooling in ``infra.dev``."""
