"""``python -m bench.ha``: no single node. vidx on a 3-node RabbitMQ cluster with quorum queues, a
4-node distributed MinIO (one erasure set) — both behind HAProxy — and Ray with a head and 2 worker
nodes (infra/harness/ha.py, infra/harness/cluster.py), under a bounded flood of uploads with overwrites and deletes,
while a seeded schedule takes nodes away one after another and brings each back later
(infra/harness/ha_nodes.py): the RabbitMQ node leading the index queue SIGKILLed, a MinIO node SIGKILLed, the
Ray worker node running an Encoder and the most consumers SIGKILLed whole, a RabbitMQ node partitioned
for 30 s. At the end every object must be settled: 0 lost, 0 duplicated, 0 stuck, ``vidx check`` 0.

First, side by side on fresh clusters of the same shape, the cost of HA: the same burst of uploads
indexed on one RabbitMQ node (classic queues) and one MinIO node, then on the HA topology.

``python -m bench.ha [--uploads 1000] [--seed 0] [--rate 4] [--burst 150]``; needs the container
engine. Prints ``ha: …`` and writes bench/results/ha.json and docs/img/ha-flood.png.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import ROOT, machine
from infra.harness.ha_nodes import (
    BACK_TIMEOUT_S,
    MINIO_DOWN_S,
    PARTITION_S,
    PROBE_TIMEOUT_S,
    RABBIT_DOWN_S,
    RAY_DOWN_S,
    TARGET_POLL_S,
    TARGET_WAIT_S,
    FaultRecord,
    RayNodes,
    Watch,
)

RAY_NODES = 3
NODE_CPUS = 2
#: Share of the stream's operations that are deletes (run_stream's default); the rest are uploads.
DELETE_SHARE = 0.3
#: Where in the stream (share of its operations) each fault starts; one fault at a time.
FAULT_AT = (0.12, 0.30, 0.48, 0.66)
CONVERGE_TIMEOUT_S = 900.0
BURST_TIMEOUT_S = 900.0
#: Window over which completions count as "running again" after a fault.
RECOVERY_WINDOW_S = 10.0


@contextmanager
def app_on(services: Any, address: str, model_dir: Path, state: Path, prefix: str) -> Iterator[Any]:
    from infra.harness.faults import start_app

    with start_app(services, prefix, model_dir, state, address=address) as host:
        yield host


def count_status(host: Any, prefix: str, status: str) -> int:
    """Catalog rows under ``prefix`` of the upload bucket with ``status``."""
    from infra.harness.faults import Tables

    uri = f"s3://{host.bucket}/{prefix}"
    return sum(1 for r in Tables(host.settings).videos().values() if r["uri"].startswith(uri) and r["status"] == status)


def burst(host: Any, variants: list[Any], n: int) -> float:
    """Upload ``n`` distinct videos at once; videos per second from the first upload until every one is
    indexed (the catalog's rows)."""
    from concurrent.futures import ThreadPoolExecutor

    from infra.harness.services import eventually

    client = host.services.minio_client()
    keys = [f"burst/v{i:04d}.mp4" for i in range(n)]

    def put(i: int) -> None:
        client.fput_object(host.bucket, keys[i], str(variants[i % len(variants)].path))

    started = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(put, range(n)))
    eventually(lambda: count_status(host, "burst/", "indexed") >= n, f"{n} burst videos indexed", BURST_TIMEOUT_S, 0.5)
    return n / (time.monotonic() - started)


def burst_on(ha_topology: bool, n: int, model_dir: Path, state: Path, variants: list[Any]) -> float:
    """``burst`` on fresh clusters: one RabbitMQ node and one MinIO node, or the HA topology."""
    from infra.harness.cluster import local_cluster
    from infra.harness.ha import start_ha_services
    from infra.harness.services import start_services, unique_prefix

    with local_cluster(RAY_NODES, NODE_CPUS) as address:
        if ha_topology:
            with start_ha_services(4) as ha, app_on(ha.services, address, model_dir, state, unique_prefix()) as host:
                return burst(host, variants, n)
        with start_services() as services, app_on(services, address, model_dir, state, unique_prefix()) as host:
            return burst(host, variants, n)


@dataclass
class Faults:
    """The schedule's faults against one HA run; each records itself in ``records``."""

    host: Any
    ha: Any
    ray: RayNodes
    started: float
    rng: random.Random

    def __post_init__(self) -> None:
        self.records: list[FaultRecord] = []

    def _t(self) -> float:
        return time.time() - self.started

    def _wait(self, what: str, ok: Callable[[], bool]) -> None:
        deadline = time.monotonic() + BACK_TIMEOUT_S
        while not ok():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} not back within {BACK_TIMEOUT_S:g}s")
            time.sleep(0.5)

    def _away(
        self,
        record: FaultRecord,
        take_away: Callable[[], object],
        down_s: float,
        bring_back: Callable[[], object],
    ) -> FaultRecord:
        """Take a node away, leave it away ``down_s``, bring it back (each step bounded by the callee),
        noting when. The record is kept even if a step fails half way (the node may still be away)."""
        self.records.append(record)
        take_away()
        time.sleep(down_s)
        record.restored_s = self._t()
        bring_back()
        record.back_s = self._t()
        return record

    def kill_rabbit_leader(self) -> str:
        rabbit, queue = self.ha.rabbit, self.host.settings.serve.index_queue
        leader = rabbit.leader(queue)
        record = self._away(
            FaultRecord("rabbitmq_kill", leader, self._t(), detail=f"leader of {queue}"),
            lambda: rabbit.kill_node(leader),
            RABBIT_DOWN_S,  # the supervisor starts it again after RABBITMQ_RESTART_DELAY_S
            lambda: rabbit.wait_running(timeout_s=BACK_TIMEOUT_S),
        )
        return f"{leader} SIGKILLed, running again {record.back_s - record.at_s:.1f}s later"

    def partition_rabbit(self) -> str:
        rabbit = self.ha.rabbit
        node = self.rng.choice(sorted(rabbit.nodes))
        record = self._away(
            FaultRecord("rabbitmq_partition", node, self._t(), detail=f"{PARTITION_S:g}s off the network"),
            lambda: rabbit.partition(node, PARTITION_S),  # blocks while the node is cut off
            0.0,
            lambda: rabbit.wait_running(timeout_s=BACK_TIMEOUT_S),
        )
        return f"{node} partitioned {PARTITION_S:g}s, running again {record.back_s - record.restored_s:.1f}s after"

    def kill_minio(self) -> str:
        minio = self.ha.minio
        node = self.rng.choice(sorted(minio.nodes))
        record = self._away(
            FaultRecord("minio_kill", node, self._t()),
            lambda: minio.kill_node(node),
            MINIO_DOWN_S,
            lambda: minio.start_node(node, timeout_s=BACK_TIMEOUT_S),
        )
        return f"{node} SIGKILLed, live again {record.back_s - record.at_s:.1f}s later"

    def _target(self) -> tuple[str, dict[str, int]]:
        """The Ray worker node to kill: one running an Encoder and consumers, waited for at most
        ``TARGET_WAIT_S`` (the consumers scale out with the flood's backlog), else the best one then."""
        deadline = time.monotonic() + TARGET_WAIT_S
        while True:
            try:
                node_id, replicas = self.ray.busiest_worker()
            except RuntimeError:  # no replica on a worker node yet
                if time.monotonic() > deadline:
                    raise
            else:
                if (replicas.get("Encoder") and replicas.get("IndexConsumer")) or time.monotonic() > deadline:
                    return node_id, replicas
            time.sleep(TARGET_POLL_S)

    def kill_ray_worker(self) -> str:
        node_id, replicas = self._target()
        before = self.ray.alive_ids()

        def new_node() -> None:
            self.ray.start_node()
            self._wait("a new Ray node", lambda: bool(self.ray.alive_ids() - before))

        self._away(
            FaultRecord("ray_node_kill", node_id[:12], self._t(), detail=f"replicas {replicas}"),
            lambda: self.ray.kill(node_id),
            RAY_DOWN_S,
            new_node,
        )
        return f"Ray node {node_id[:12]} (replicas {replicas}) SIGKILLed whole; a new node joined"

    def schedule(self, ops: int) -> list[Any]:
        from infra.harness.faults import Fault

        kinds = [self.kill_rabbit_leader, self.kill_minio, self.kill_ray_worker, self.partition_rabbit]
        self.rng.shuffle(kinds)
        return [Fault(int(ops * at), kind.__name__, kind) for at, kind in zip(FAULT_AT, kinds, strict=True)]


def slow_ops(lines: list[str], shown: int = 8) -> list[str]:
    """The stream's slow operations, the first ``shown`` of them and how many more."""
    more = [f"... and {len(lines) - shown} more slow operations"] if len(lines) > shown else []
    return [f"slow: {line}" for line in lines[:shown]] + more


def rate(completions: list[float], start: float, end: float) -> float:
    """Completions per second between ``start`` and ``end`` (seconds of the run): the final states the
    watch saw whose catalog rows say they were written in that span."""
    if end <= start:
        return 0.0
    return sum(1 for t in completions if start < t <= end) / (end - start)


def recovery(completions: list[float], record: FaultRecord) -> float | None:
    """Seconds from the fault until completions ran at half the rate of the 30 s before it again
    (over the ``RECOVERY_WINDOW_S`` before each second after the fault)."""
    start = max(0.0, record.at_s - 30)
    before = rate(completions, start, record.at_s)
    if before <= 0:
        return 0.0
    last = max(completions, default=record.at_s)
    t = record.at_s + RECOVERY_WINDOW_S
    while t <= last + RECOVERY_WINDOW_S:
        if rate(completions, t - RECOVERY_WINDOW_S, t) >= before / 2:
            return float(t - record.at_s)
        t += 1.0
    return None


def plot(samples: list[dict[str, Any]], completions: list[float], records: list[FaultRecord], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s["t_s"] for s in samples]
    seconds = [float(x) for x in range(int(max(t + completions, default=0)) + 2)]
    per_s = [rate(completions, x - 5, x) for x in seconds]
    fig, axes = plt.subplots(3, 1, figsize=(9, 7), dpi=110, sharex=True)
    axes[0].plot(seconds, per_s, label="completed videos/s (5 s window)")

    def series(key: str) -> list[float]:
        return [math.nan if s.get(key) is None else float(s[key]) for s in samples]

    axes[1].step(t, series("backlog"), where="post", label="index queue")
    axes[1].step(t, series("events_backlog"), where="post", label="bucket events")
    for key, label, style in (
        ("rabbit_nodes", "RabbitMQ", "-"),
        ("minio_nodes", "MinIO", "--"),
        ("ray_nodes", "Ray", ":"),
    ):
        axes[2].step(t, series(key), style, where="post", label=f"{label} nodes up")
    axes[1].set_title(
        f"backlog and nodes as the management APIs answered within {PROBE_TIMEOUT_S:g} s (gaps: no answer)",
        fontsize=8,
    )
    for ax, ylabel in zip(axes, ("videos/s", "messages", "nodes"), strict=True):
        for r in records:
            ax.axvspan(r.at_s, r.back_s, alpha=0.12, color="red")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right", fontsize=7)
    for r in records:
        axes[0].annotate(r.kind, (r.at_s, 0), fontsize=7, rotation=90, va="bottom")
    axes[2].set_xlabel("seconds since the flood started (red: a node away until it is back)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.ha", description=__doc__)
    parser.add_argument("--uploads", type=int, default=1000, help="uploads in the flood (at least)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rate", type=float, default=4.0, help="operations a second the flood offers")
    parser.add_argument("--burst", type=int, default=150, help="videos of the side-by-side burst (0: skip)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "ha.json")
    parser.add_argument("--plot", type=Path, default=ROOT / "docs" / "img" / "ha-flood.png")
    args = parser.parse_args(argv)

    from infra.dev.tinymodel import build_tiny_siglip
    from infra.harness.cluster import local_cluster
    from infra.harness.faults import StreamPlan, converge, make_variants, run_stream, vidx_check
    from infra.harness.ha import start_ha_services
    from infra.harness.services import unique_prefix

    result: dict[str, Any] = {"machine": machine(), "seed": args.seed}
    with tempfile.TemporaryDirectory(prefix="vidx-ha-") as tmp:
        root = Path(tmp)
        model_dir = build_tiny_siglip(root / "tiny-siglip", seed=0)
        variants = make_variants(root, 1.0)
        if args.burst:
            single = burst_on(False, args.burst, model_dir, root / "s1", variants)
            clustered = burst_on(True, args.burst, model_dir, root / "s2", variants)
            result["side_by_side"] = {
                "burst_videos": args.burst,
                "single_node_videos_per_s": round(single, 3),
                "ha_videos_per_s": round(clustered, 3),
                "ha_vs_single": round(clustered / single, 3),
            }
            print(f"side by side: {args.burst} videos, single node {single:.2f}/s, HA {clustered:.2f}/s", flush=True)

        ops = int(args.uploads / (1 - DELETE_SHARE)) + 40
        with (
            local_cluster(RAY_NODES, NODE_CPUS) as address,
            start_ha_services(4, rabbit_restart_delay_s=RABBIT_DOWN_S) as ha,
            app_on(ha.services, address, model_dir, root / "s3", unique_prefix()) as host,
        ):
            variants = make_variants(root, host.settings.sampling.every_s)
            plan = StreamPlan(f"ha-{args.seed}", ops, seed=args.seed, rate_per_s=args.rate, delete_share=DELETE_SHARE)
            ray_nodes = RayNodes(address, host.settings.serve.app_name, NODE_CPUS)
            watch = Watch(host, ha, ray_nodes, limit_s=ops / args.rate + CONVERGE_TIMEOUT_S + 600)
            faults = Faults(host, ha, ray_nodes, watch.started, random.Random(args.seed))
            watch.start()
            log = run_stream(host, plan, variants, faults.schedule(ops))
            stream_end = time.time() - watch.started
            summary, converge_s = converge(host, plan, log, CONVERGE_TIMEOUT_S)
            check = vidx_check(prefix=plan.prefix)
            failed = count_status(host, plan.prefix, "failed")
            watch.stop.set()
            watch.join(30)
        samples, completions, records = watch.samples, sorted(watch.completions), faults.records
        for record in records:
            record.recovery_s = recovery(completions, record)
        first = min((r.at_s for r in records), default=0.0)
        last = max((r.back_s or r.at_s for r in records), default=0.0)
        end = stream_end + converge_s
        result |= {
            "uploads": log.uploads,
            "deletes": log.deletes,
            "indexed": summary.indexed,
            "failed": failed,
            "refused_ops": log.failed_ops,
            "lost": summary.lost,
            "duplicates": summary.duplicated,
            "stuck": check.in_flight,
            "check_inconsistencies": check.inconsistencies,
            "node_kills": sum(1 for r in records if r.kind.endswith("_kill")),
            "partitions": sum(1 for r in records if r.kind.endswith("_partition")),
            "throughput_before_videos_per_s": round(rate(completions, 0, first), 3),
            "throughput_during_videos_per_s": round(rate(completions, first, last), 3),
            "throughput_after_videos_per_s": round(rate(completions, last, end), 3),
            "recovery_s": {r.kind: r.as_json()["recovery_s"] for r in records},
            "faults": [r.as_json() for r in records],
            "stream_s": round(log.stream_s, 1),
            "converged_after_stream_s": round(converge_s, 1),
            "notes": log.notes + log.errors + watch.errors[:10] + slow_ops(log.slow_ops),
            "problems": list(summary.problems[:20]) + check.found[:20],
            "timeline": {"completions_t_s": completions, "samples": samples},
        }
    ok = not log.errors and summary.ok and not log.failed_ops and not failed and not check.inconsistencies
    ok = ok and not check.in_flight
    keys = ("uploads", "indexed", "failed", "lost", "duplicates", "stuck", "node_kills", "partitions")
    print("ha: " + ", ".join(f"{k} {result[k]}" for k in keys), flush=True)
    print(
        "  throughput videos/s before {throughput_before_videos_per_s}, during {throughput_during_videos_per_s}, "
        "after {throughput_after_videos_per_s}; recovery_s {recovery_s}".format(**result),
        flush=True,
    )
    for line in result["notes"]:
        print(f"  {line}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    plot(samples, completions, records, args.plot)  # after the figures are safe
    print(f"wrote {args.out} and {args.plot}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
