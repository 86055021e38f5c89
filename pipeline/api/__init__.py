"""The HTTP surface: the v1 routes, the admin routes, the web page and the ``/metrics`` page."""
