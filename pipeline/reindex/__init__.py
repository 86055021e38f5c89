"""Switching the embedding model: the model lifecycle and the backfill that re-embeds every video."""
