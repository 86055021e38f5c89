"""What the tests and the benchmarks share to run the real thing: service containers (``services``), the
app under faults (``faults``), the nemesis (``nemesis``), HA nodes (``ha``, ``ha_nodes``) and Ray
clusters (``cluster``). Nothing the product runs imports it."""
