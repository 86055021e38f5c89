"""The ``vidx`` command line, one module per group of commands (``main`` wires them)."""
