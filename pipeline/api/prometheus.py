"""The text of ``GET /metrics``: the counters and histograms every replica keeps as it works (read
from the nodes, ``pipeline.api.node_metrics``), plus a few cheap live readings (queue depths, replica
counts, the router's connection, the scheduled check's last round). Never a catalog scan."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterator
from datetime import datetime
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.metrics_core import Metric

from pipeline import metrics as vm

log = logging.getLogger(__name__)
_T = TypeVar("_T")


async def _optional(what: str, call: Callable[[], Awaitable[_T]] | None) -> _T | None:
    """``call()``, or None when there is none or it fails: a part of /metrics missing must not fail it all."""
    if call is None:
        return None
    try:
        return await call()
    except Exception:
        log.warning("%s unavailable for /metrics", what, exc_info=True)
        return None


class _Families:
    """Families read elsewhere (the nodes' metrics endpoints), as a collector of a registry."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


def gauge(registry: CollectorRegistry, metric: vm.MetricDef) -> Gauge:
    """A gauge of ``registry`` named, described and labelled as ``metric`` says."""
    return Gauge(metric.name, metric.help, metric.labels, registry=registry)


async def exposition(
    stats: Callable[[], Awaitable[dict[str, Any]]],
    check_state: Callable[[], Awaitable[dict[str, Any]]] | None = None,
    replicas: Callable[[], Awaitable[dict[str, dict[str, int]]]] | None = None,
    queues: Callable[[], Awaitable[dict[str, int]]] | None = None,
    recorded: Callable[[], Awaitable[list[Metric]]] | None = None,
) -> str:
    """Prometheus text: ``stats`` the EventRouter's state (``connected``), ``check_state`` the
    scheduled check's, ``replicas`` replicas by deployment and state, ``queues`` messages per queue
    role, ``recorded`` the families the replicas recorded. A part that fails is left out."""
    # Every part at once: the scrape takes as long as its slowest part, not their sum.
    router, check, known, read, families = await asyncio.gather(
        _optional("event router state", stats),
        _optional("scheduled check state", check_state),
        _optional("replica counts", replicas),
        _optional("queue depths", queues),
        _optional("recorded metrics", recorded),
    )
    registry = CollectorRegistry()
    gauge(registry, vm.ROUTER_CONNECTED).set(1 if (router or {}).get("connected") else 0)
    if check_state is not None:
        check_metrics(registry, check or {})
    if known is not None:
        counts = gauge(registry, vm.SERVE_REPLICAS)
        for deployment, states in known.items():
            for state, count in states.items():
                counts.labels(deployment=deployment, state=state).set(count)
    if read is not None:
        depths = gauge(registry, vm.QUEUE_MESSAGES)
        for queue, depth in read.items():
            depths.labels(queue=queue).set(depth)
    if families is not None:
        registry.register(_Families(families))
    return generate_latest(registry).decode()


def check_metrics(registry: CollectorRegistry, state: dict[str, Any]) -> None:
    """The scheduled check's state as gauges: rounds, and the last round's time and findings."""
    gauge(registry, vm.CHECK_ROUNDS).set(state.get("rounds", 0))
    gauge(registry, vm.CHECK_LEADER).set(1 if state.get("leader") else 0)
    last = state.get("last")
    if not last:
        return
    gauge(registry, vm.CHECK_LAST_RUN).set(datetime.fromisoformat(last["started_at"]).timestamp())
    found = gauge(registry, vm.CHECK_LAST_FOUND)
    for finding, count in last["counts"].items():
        found.labels(finding=finding).set(count)
    gauge(registry, vm.CHECK_LAST_IN_FLIGHT).set(last["in_flight"])
    gauge(registry, vm.CHECK_LAST_SUBMITTED).set(last["submitted"])
