"""Keeping the index true over time: every background service (index maintenance, the model and text
backfills, the scheduled check), each under a lease, and the invariant checker with its report."""
