"""Tooling for developers and demos: sample videos, the tiny offline model, the demo, the local stack.

Nothing here is imported by the Serve app (a test checks it).
"""
