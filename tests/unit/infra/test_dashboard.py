"""The Grafana dashboard (infra/grafana/vidx.json) queries only metrics the facade lists, so a renamed
or dropped metric fails here instead of leaving an empty panel."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pipeline.metrics import sample_names

DASHBOARD = Path(__file__).resolve().parents[3] / "infra" / "grafana" / "vidx.json"
#: A metric name in PromQL: vidx's own, or as Ray's metrics agent exports them.
METRIC = re.compile(r"\b(?:ray_)?vidx_[a-z0-9_]+\b")
PANELS = {
    "Throughput",
    "Failures by reason",
    "Queue depths",
    "Stage latency p50 / p95",
    "Encoder batch size",
    "Search latency p50 / p95",
    "Dead letters and parked events",
    "Replicas",
}


def exprs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "expr" and isinstance(value, str):
                yield value
            else:
                yield from exprs(value)
    elif isinstance(node, list):
        for item in node:
            yield from exprs(item)


def test_every_metric_in_the_dashboard_is_in_the_facade() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    queries = list(exprs(dashboard))
    used = {name for q in queries for name in METRIC.findall(q)}
    assert queries and used
    assert used <= sample_names(), f"not in pipeline/metrics.py: {sorted(used - sample_names())}"


def test_the_dashboard_has_the_operators_panels() -> None:
    titles = {p["title"] for p in json.loads(DASHBOARD.read_text())["panels"]}
    assert titles >= PANELS
