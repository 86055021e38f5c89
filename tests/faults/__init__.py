"""Fault scenarios: the real Ray Serve app over the test containers, a seeded stream of uploads,
overwrites and deletes, faults injected while it runs, and a check that the index converges on the
bucket (``harness``). ``python -m tests.faults.stream`` runs the long stream on its own."""
