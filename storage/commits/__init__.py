"""Writes gathered into shared commits: the grouped-commit core, and the frame and catalog writers on it."""
