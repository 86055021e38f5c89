"""Embedding models: where a checkpoint is found, loading it, and the encoders that batch images and texts."""
