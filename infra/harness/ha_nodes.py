"""Node faults and the once-a-second watch of ``python -m bench.ha`` (bench/ha.py).

Each fault takes a node away and brings it back later, and says when: a RabbitMQ node SIGKILLed (its
container's supervisor starts it again after ``RABBIT_DOWN_S``), one partitioned (its container cut off
the network for ``PARTITION_S``), a MinIO node SIGKILLed and started again after ``MINIO_DOWN_S``, a Ray
worker node — every process of it, its replicas included — SIGKILLed and a new node started in its place
after ``RAY_DOWN_S``. The watch samples completions (catalog rows reaching their final state), the
queues' backlog and the live nodes of each cluster.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: How long each kind of node stays away before it is brought back.
RABBIT_DOWN_S = 15.0
PARTITION_S = 30.0
MINIO_DOWN_S = 20.0
RAY_DOWN_S = 20.0
#: Longest wait for a node to be back (running, live, registered).
BACK_TIMEOUT_S = 180.0
#: Longest wait for a Ray worker node running both an Encoder and IndexConsumers (then the best there is).
TARGET_WAIT_S = 90.0
#: How often the busiest worker is looked up again while waiting for one.
TARGET_POLL_S = 2.0
#: Longest wait of the watch for one answer of RabbitMQ's management API or of one MinIO node.
PROBE_TIMEOUT_S = 2.0


@dataclass
class FaultRecord:
    kind: str
    target: str
    #: Wall-clock seconds since the run's start: the node went away, was brought back, was serving.
    at_s: float
    restored_s: float = 0.0
    back_s: float = 0.0
    detail: str = ""
    #: Seconds from the fault until completions ran again at half the rate before it (None: never did).
    recovery_s: float | None = None

    def as_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "target": self.target,
            "at_s": round(self.at_s, 1),
            "down_s": round(self.restored_s - self.at_s, 1),
            "back_after_s": round(self.back_s - self.at_s, 1),
            "recovery_s": None if self.recovery_s is None else round(self.recovery_s, 1),
            "detail": self.detail,
        }


class RayNodes:
    """The Ray cluster of infra/harness/cluster.py: which worker node to kill, killing it, starting another."""

    def __init__(self, address: str, app_name: str, cpus_per_node: int) -> None:
        self.address = address
        self.app_name = app_name
        self.cpus = cpus_per_node

    def alive_ids(self) -> set[str]:
        from ray.util.state import list_nodes

        nodes = list_nodes(address=self.address, raise_on_missing_output=False)
        return {str(n.node_id) for n in nodes if n.state == "ALIVE"}

    def busiest_worker(self) -> tuple[str, dict[str, int]]:
        """The non-head node running an Encoder and IndexConsumers (else an Encoder), the most
        IndexConsumers, the CatalogWriter if it can: its id and replica counts."""
        from ray.util.state import list_actors, list_nodes

        head = {n.node_id for n in list_nodes(address=self.address, raise_on_missing_output=False) if n.is_head_node}
        by_node: dict[str, dict[str, int]] = {}
        for actor in list_actors(
            address=self.address, filters=[("state", "=", "ALIVE")], limit=10_000, raise_on_missing_output=False
        ):
            name = str(actor.class_name)
            if actor.node_id in head or not name.startswith(f"ServeReplica:{self.app_name}:"):
                continue
            deployment = name.rsplit(":", 1)[1]
            counts = by_node.setdefault(str(actor.node_id), {})
            counts[deployment] = counts.get(deployment, 0) + 1
        if not by_node:
            raise RuntimeError("no replica runs on a worker node")
        return max(
            by_node.items(),
            key=lambda kv: (
                kv[1].get("Encoder", 0) > 0 and kv[1].get("IndexConsumer", 0) > 0,
                kv[1].get("Encoder", 0) > 0,
                kv[1].get("IndexConsumer", 0),
                "CatalogWriter" in kv[1],
            ),
        )

    def kill(self, node_id: str) -> int:
        """SIGKILL every process of node ``node_id`` at once: its raylet and agents (their command lines
        name the node) and the workers the state API places there. Returns how many."""
        from ray.util.state import list_workers

        pids = {
            int(w.pid)
            for w in list_workers(
                address=self.address,
                filters=[("node_id", "=", node_id), ("is_alive", "=", "True")],
                limit=10_000,
                raise_on_missing_output=False,
            )
            if w.pid
        }
        for proc in Path("/proc").iterdir():
            try:
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:  # not a process, or gone
                continue
            if proc.name.isdigit() and (f"node_id={node_id}" in cmdline or f"node-id={node_id}" in cmdline):
                pids.add(int(proc.name))
        pids.discard(os.getpid())
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return len(pids)

    def start_node(self) -> None:
        from infra.harness.cluster import ray_cli

        ray_cli("start", f"--address={self.address}", f"--num-cpus={self.cpus}", "--disable-usage-stats")


class Watch(threading.Thread):
    """About once a second until stopped (at most ``limit_s``; a sample takes as long as its reads): the
    final states reached so far, each dated by its catalog row's ``updated_at`` (a final state replaced
    between two samples is not seen), the queues' backlog and the live nodes of each cluster. A probe
    that fails or doesn't answer in time (``PROBE_TIMEOUT_S`` for RabbitMQ's management API and each
    MinIO node) leaves None in its sample: a gap in the plot, not a zero."""

    def __init__(self, host: Any, ha: Any, ray_nodes: RayNodes, limit_s: float) -> None:
        super().__init__(name="ha-watch", daemon=True)
        self.host = host
        self.ha = ha
        self.ray_nodes = ray_nodes
        self.limit_s = limit_s
        self.started = time.time()
        self.samples: list[dict[str, Any]] = []
        #: Seconds of the run at which a video reached a final state (its row's ``updated_at``).
        self.completions: list[float] = []
        self.errors: list[str] = []
        self.stop = threading.Event()
        #: (video, row revision) of each final state counted: every catalog write raises the revision,
        #: so a key overwritten back to earlier content, or deleted again, counts again.
        self._seen: set[tuple[str, int]] = set()

    def run(self) -> None:
        from infra.harness.faults import Tables

        try:
            tables = Tables(self.host.settings)
        except Exception as exc:  # nothing to sample with: say so, the run goes on unwatched
            self.errors.append(f"no watch: {type(exc).__name__}: {exc}"[:300])
            return
        while not self.stop.is_set() and time.time() - self.started < self.limit_s:
            try:
                self.samples.append(self.sample(tables))
            except Exception as exc:  # a sample missed while a node is away is not worth the run
                if len(self.errors) < 50:
                    self.errors.append(f"t={time.time() - self.started:.0f}s {type(exc).__name__}: {exc}"[:300])
            self.stop.wait(1.0 - (time.time() - self.started) % 1.0)

    def _probe(self, read: Any) -> Any:
        try:
            return read()
        except Exception:  # an answer missing this second: a gap in the plot, not a zero
            return None

    def _backlog(self, queue: str) -> int | None:
        """Ready + unacknowledged on ``queue``; None without an answer or a count (a new leader's first
        seconds): unknown, not 0."""
        from infra.harness.services import queue_info

        messages = queue_info(self.host.services, queue, PROBE_TIMEOUT_S).get("messages")
        return messages if isinstance(messages, int) else None

    def sample(self, tables: Any) -> dict[str, Any]:
        settings = self.host.settings
        for vid, row in tables.videos().items():
            key = (vid, int(row["rev"] or 0))
            if row["status"] in ("indexed", "deleted", "failed") and key not in self._seen:
                self._seen.add(key)
                self.completions.append(round(row["updated_at"].timestamp() - self.started, 2))
        minio, rabbit = self.ha.minio, self.ha.rabbit
        running = rabbit.running_nodes(PROBE_TIMEOUT_S)
        sample = {
            "completed": len(self._seen),
            "backlog": self._backlog(settings.serve.index_queue),
            "events_backlog": self._backlog(settings.amqp.events_queue),
            "rabbit_nodes": None if running is None else len(running),
            "minio_nodes": sum(minio.live(n) for n in minio.nodes) if minio is not None else 1,
            "ray_nodes": self._probe(lambda: len(self.ray_nodes.alive_ids())),
        }
        # Dated once every probe answered: a node seen up was up at least until then.
        return {"t_s": round(time.time() - self.started, 2), **sample}
