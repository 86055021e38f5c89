"""Switching the embedding model: the model lifecycle (preflight, start, abort, cleanup, the live tables).
The backfill that re-embeds every video runs in ``pipeline.upkeep``."""
