"""The Api's view of the metrics every replica recorded: it reads vidx's families from each Ray node's
metrics export endpoint (the nodes listed by the GCS) and merges them into one exposition, so
``/metrics`` shows the whole cluster. Prometheus on a multi-node cluster may scrape the nodes
directly instead (the same series); it should not scrape both.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping

import httpx
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from pipeline.metrics import RAY_PREFIX

log = logging.getLogger(__name__)

#: Families of vidx's own metrics on a node's endpoint (Ray's and the system's are left there).
VIDX_PREFIX = RAY_PREFIX + "vidx_"
#: Labels the OpenTelemetry exporter adds that say nothing about the series.
DROPPED_LABELS = frozenset({"otel_scope_name", "otel_scope_schema_url", "otel_scope_version"})
#: Largest answer read from one node (a node's whole exposition, Ray's own metrics included).
MAX_NODE_BYTES = 32 * 1024 * 1024
#: Nodes asked at once.
MAX_PARALLEL_NODES = 16


def ray_node_endpoints() -> list[str]:
    """The metrics export URL of every live node of the Ray cluster this process belongs to (the GCS
    node table: no dashboard needed)."""
    import ray

    urls: dict[str, None] = {}  # ordered, and one URL once: two node entries at one address count once
    for node in ray.nodes():
        port = node.get("MetricsExportPort")
        if node.get("Alive") and port:
            urls[f"http://{node['NodeManagerAddress']}:{port}/metrics"] = None
    return list(urls)


def vidx_lines(text: str, prefix: str = VIDX_PREFIX) -> str:
    """The lines of an exposition about families starting with ``prefix`` (HELP, TYPE and samples):
    cheap, so only vidx's few families are parsed."""
    keep = []
    for line in text.splitlines():
        name = line.split(" ", 3)[2] if line.startswith(("# HELP ", "# TYPE ")) else line
        if name.startswith(prefix):
            keep.append(line)
    return "\n".join(keep) + "\n"


def merge(texts: Iterable[str], prefix: str = VIDX_PREFIX) -> list[Metric]:
    """The families of ``prefix`` in every exposition of ``texts``, one family per name, samples of all.

    Raises:
        ValueError: an exposition that does not parse.
    """
    merged: dict[str, Metric] = {}
    for text in texts:
        for family in text_string_to_metric_families(vidx_lines(text, prefix)):
            into = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            into.samples.extend(
                Sample(
                    s.name,
                    {k: v for k, v in s.labels.items() if k not in DROPPED_LABELS},
                    s.value,
                    s.timestamp,
                    s.exemplar,
                )
                for s in family.samples
            )
    return list(merged.values())


class NodeMetrics:
    """Reads vidx's families from every node's endpoint at once; a node that does not answer within
    ``timeout_s`` is left out (logged), never failing the scrape."""

    def __init__(
        self, endpoints: Callable[[], list[str]], timeout_s: float, fetch: Callable[[str], Awaitable[str]] | None = None
    ) -> None:
        self._endpoints = endpoints
        self._timeout_s = timeout_s
        self._fetch = fetch or self._get

    async def _get(self, url: str) -> str:
        async with httpx.AsyncClient(timeout=self._timeout_s) as client, client.stream("GET", url) as response:
            response.raise_for_status()
            body = bytearray()
            async for part in response.aiter_bytes():
                body += part
                if len(body) > MAX_NODE_BYTES:  # stop reading: never hold more than the bound
                    raise ValueError(f"answer over {MAX_NODE_BYTES} bytes")
            return body.decode(response.encoding or "utf-8", errors="replace")

    async def families(self) -> list[Metric]:
        """Raises: TimeoutError when the node list itself takes over ``timeout_s`` (the GCS away)."""
        urls = await asyncio.wait_for(asyncio.to_thread(self._endpoints), self._timeout_s)
        limit = asyncio.Semaphore(MAX_PARALLEL_NODES)

        async def fetch(url: str) -> str:
            async with limit:
                return await asyncio.wait_for(self._fetch(url), self._timeout_s)

        answers = await asyncio.gather(*(fetch(url) for url in urls), return_exceptions=True)
        texts = []
        for url, answer in zip(urls, answers, strict=True):
            if isinstance(answer, BaseException):
                log.warning("metrics of node %s unavailable: %s", url, type(answer).__name__)
            else:
                texts.append(answer)
        # Parsing every node's text is CPU work: off the Api's event loop.
        return await asyncio.to_thread(merge, texts)


class QueueDepths:
    """Messages (ready + unacked) on each queue by role, every reader asked at once in a thread; a
    queue whose reader fails or takes over ``timeout_s`` is left out (logged by the error's kind:
    the management API's answer never reaches a log)."""

    def __init__(self, readers: Mapping[str, Callable[[], int]], timeout_s: float) -> None:
        self._readers = dict(readers)
        self._timeout_s = timeout_s

    async def _depth(self, role: str) -> int | None:
        try:
            return await asyncio.wait_for(asyncio.to_thread(self._readers[role]), self._timeout_s)
        except Exception as exc:
            log.warning("%s queue depth unavailable: %s", role, type(exc).__name__)
            return None

    async def __call__(self) -> dict[str, int]:
        roles = list(self._readers)
        depths = await asyncio.gather(*(self._depth(role) for role in roles))
        return {role: n for role, n in zip(roles, depths, strict=True) if n is not None}
