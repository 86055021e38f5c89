"""vidx benchmarks: each measures a baseline in the same run on the same input and reports ratios.

``python -m bench`` (``make bench``) runs them all and regenerates ``bench/results/latest.json`` and
``docs/benchmarks.md``; ``python -m bench.<name>`` runs one.
"""
