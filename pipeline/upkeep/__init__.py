"""Keeping the index true over time: the invariant checker, its report, and the scheduled rounds."""
