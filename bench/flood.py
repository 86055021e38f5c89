"""The flood: a bounded burst of uploads, shaped like the seed's profile (ramp up, sustained, spike at
2×, sustained, ramp down), through the real app on loopback, at several times the capacity measured
at the start of the run. Every second it samples the offered rate, queue depth, replicas per
deployment, completed and failed; at the end every object must be indexed exactly once (the checker).

``python -m bench.flood [--videos N] [--duration-s S] [--seed-like] [--out PATH] [--plots DIR]``;
needs the container engine (``make bench`` sets it up). Writes ``bench/results/flood.json`` (or
``flood-seedlike.json``) and PNG plots with "flood" in their names.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.common import ROOT, machine, percentile
from bench.flood_watch import (
    CONSUMER,
    ENCODER,
    Prober,
    Sampler,
    Uploader,
    ack_latencies_ms,
    capacity_run,
    catalog_version,
    decisions,
    plot,
    scaling_figures,
    settle,
    statuses,
    wait_done,
)
from storage.catalog import VideoStatus

#: (segment, share of the flood's duration, rate multiplier at its start, at its end).
PROFILE: tuple[tuple[str, float, float, float], ...] = (
    ("ramp_up", 0.15, 0.0, 1.0),
    ("sustained", 0.30, 1.0, 1.0),
    ("spike", 0.10, 2.0, 2.0),
    ("sustained", 0.30, 1.0, 1.0),
    ("ramp_down", 0.15, 1.0, 0.0),
)
CLIP_SIZE = (160, 90)
CLIP_FPS = 10
CLIP_SECONDS = (2.0, 3.0, 4.0)
#: Logical CPUs of each node of ``--nodes`` (the single-node harness gives its one node 4).
NODE_CPUS = 2
#: The seed-like autoscaling settings (its harness: poll 2 s, upscale delay 15 s, downscale delay 60 s).
SEED_LIKE_ENV = {
    "VIDX_AUTOSCALE__POLL_INTERVAL_S": "2",
    "VIDX_AUTOSCALE__UPSCALE_DELAY_S": "15",
    "VIDX_AUTOSCALE__DOWNSCALE_DELAY_S": "60",
}
WARMUP_TIMEOUT_S = 300.0
#: Longest wait for the capacity batch, and for the queue to empty before the flood starts.
CAPACITY_TIMEOUT_S = 600.0
QUIET_TIMEOUT_S = 60.0
#: Thread joins at the end (each).
JOIN_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class FloodPlan:
    videos: int = 2000
    #: Longest flood; shorter when ``overload`` × capacity offers ``videos`` sooner.
    duration_s: float = 300.0
    #: The sustained offered rate is at least this many times the measured capacity (0: just fit the duration).
    overload: float = 5.0
    capacity_videos: int = 80
    distinct_clips: int = 24
    #: Every n-th flood video has content of its own and is timed upload → returned by image search.
    probe_every: int = 20
    ack_requests: int = 40
    ack_rate_per_s: float = 20.0
    upload_threads: int = 16
    drain_timeout_s: float = 1800.0
    #: After the drain, sampling goes on until the consumers are back at their minimum, or this long.
    cooldown_s: float = 90.0
    sample_every_s: float = 1.0
    key_prefix: str = "flood/"
    env: Mapping[str, str] = field(default_factory=dict)
    #: A running Ray cluster to join (``infra.harness.cluster.local_cluster``); None: a local one-node Ray.
    ray_address: str | None = None


@dataclass
class FloodResult:
    metrics: dict[str, Any]
    settings: dict[str, Any]
    samples: list[dict[str, Any]]
    decisions: list[dict[str, Any]]
    check: dict[str, Any]
    notes: list[str]

    def as_json(self) -> dict[str, Any]:
        return {
            "command": " ".join(["python", "-m", "bench.flood", *sys.argv[1:]]),
            "finished_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "machine": machine(),
            **self.metrics,
            "settings": self.settings,
            "check": self.check,
            "notes": self.notes,
            "decisions": self.decisions,
            "samples": self.samples,
        }


# -- the profile -------------------------------------------------------------------------------------
def multiplier(x: float) -> float:
    """The profile's rate multiplier at ``x`` (0–1) of the flood's duration."""
    start = 0.0
    for _name, share, a, b in PROFILE:
        if x <= start + share:
            return a + (b - a) * (x - start) / share
        start += share
    return PROFILE[-1][3]


def profile_area() -> float:
    """∫ multiplier over the flood (in units of duration): uploads = base rate × duration × area."""
    return sum(share * (a + b) / 2 for _n, share, a, b in PROFILE)


def due_times(n: int, duration_s: float) -> list[float]:
    """Seconds after the flood's start at which each of ``n`` uploads is due, following the profile."""
    import numpy as np

    x = np.linspace(0.0, 1.0, 20_001)
    m = np.array([multiplier(float(v)) for v in x])
    cumulative = np.concatenate([[0.0], np.cumsum((m[1:] + m[:-1]) / 2 * np.diff(x))])
    targets = (np.arange(n) + 0.5) / n * cumulative[-1]
    return [float(t) * duration_s for t in np.interp(targets, cumulative, x)]


def flood_shape(plan: FloodPlan, capacity_per_s: float) -> tuple[float, float]:
    """(sustained rate per second, duration in seconds) for ``plan`` given the measured capacity."""
    area = profile_area()
    rate = max(plan.videos / (area * plan.duration_s), plan.overload * capacity_per_s)
    return rate, plan.videos / (area * rate)


# -- media -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Clip:
    data: bytes
    seed: int
    seconds: float


def make_clips(directory: Path, n: int, first_seed: int, seconds: Sequence[float]) -> list[Clip]:
    from infra.dev.samples import write_video

    directory.mkdir(parents=True, exist_ok=True)
    clips = []
    for i in range(n):
        s, seed = seconds[i % len(seconds)], first_seed + i
        path = write_video(directory / f"c{seed}.mp4", seconds=s, fps=CLIP_FPS, size=CLIP_SIZE, seed=seed)
        clips.append(Clip(path.read_bytes(), seed, s))
    return clips


def probe_png(seed: int) -> bytes:
    from PIL import Image

    from infra.dev.samples import frame_at

    buf = io.BytesIO()
    Image.fromarray(frame_at(0, seed, CLIP_SIZE)).save(buf, format="PNG")
    return buf.getvalue()


# -- measuring the app -------------------------------------------------------------------------------
# -- the run -----------------------------------------------------------------------------------------
def run_flood(services: Any, model_dir: Path, tmp: Path, plan: FloodPlan) -> FloodResult:
    """Start the app over ``services`` (``plan.env`` on top of the test settings), measure its capacity,
    flood it, wait (bounded) until every upload is indexed, and check bucket against index."""
    from infra.harness.faults import start_app, vidx_check
    from infra.harness.services import unique_prefix
    from storage.ids import s3_uri, video_id
    from storage.tables import IndexStore

    notes: list[str] = []
    probe_at = list(range(plan.probe_every - 1, plan.videos, plan.probe_every)) if plan.probe_every else []
    n_probes = len(probe_at)
    shared = make_clips(tmp / "clips", plan.distinct_clips, 7000, CLIP_SECONDS)
    probes = make_clips(tmp / "probes", n_probes, 80_000, CLIP_SECONDS[:1])
    with start_app(services, unique_prefix(), model_dir, tmp / "state", env=plan.env, address=plan.ray_address) as host:
        settings = host.settings
        store = IndexStore(settings.s3)
        uploader = Uploader(services, host.bucket, plan.upload_threads)
        threads: list[Sampler | Prober] = []
        try:
            # Warm-up: one video through every hop, so imports and first commits don't count.
            uploader.put("warmup/w.mp4", shared[0].data)
            wait_done(store, [video_id(host.bucket, "warmup/w.mp4")], WARMUP_TIMEOUT_S)

            cap_keys = [f"capacity/c{i:03d}.mp4" for i in range(plan.capacity_videos)]
            auto = getattr(settings, "autoscale", None)
            fleet = auto.consumer_max_replicas if auto is not None and auto.enabled else None
            for i, key in enumerate(cap_keys):
                uploader.submit(key, shared[i % len(shared)].data)
            capacity, capacity_cold, at_full_fleet = capacity_run(
                store, [video_id(host.bucket, k) for k in cap_keys], settings.serve.app_name, fleet, CAPACITY_TIMEOUT_S
            )
            print(
                f"capacity: {capacity:.2f} videos/s at the full fleet, {capacity_cold:.2f} over the whole batch "
                f"({len(cap_keys)} videos)",
                flush=True,
            )

            acks = ack_latencies_ms(
                host, [s3_uri(host.bucket, k) for k in cap_keys[: plan.ack_requests]], plan.ack_rate_per_s
            )
            least = getattr(auto, "consumer_min_replicas", None)
            # The flood starts from a cold fleet: queue empty, consumers back at their minimum.
            if not settle(host, least, QUIET_TIMEOUT_S + plan.cooldown_s):
                notes.append("the queue or the consumers had not settled when the flood started")

            rate, duration = flood_shape(plan, capacity)
            print(
                f"flood: {plan.videos} videos over {duration:.0f}s, sustained {rate:.2f}/s, spike {2 * rate:.2f}/s",
                flush=True,
            )
            keys = [f"{plan.key_prefix}v{i:05d}.mp4" for i in range(plan.videos)]
            probe_of = dict(zip(probe_at, probes, strict=True))
            content = [probe_of[i] if i in probe_of else shared[i % len(shared)] for i in range(plan.videos)]
            ids = [video_id(host.bucket, k) for k in keys]
            base = store.catalog.counts()
            version_before = catalog_version(store)
            limit_s = duration + plan.drain_timeout_s + plan.cooldown_s + JOIN_TIMEOUT_S
            sampler = Sampler(host, uploader, plan.sample_every_s, base, limit_s)
            prober = Prober(
                host, uploader, {ids[i]: (keys[i], probe_png(c.seed)) for i, c in probe_of.items()}, limit_s
            )
            threads.extend([sampler, prober])
            with uploader.lock:
                uploader.offered = 0
            sampler.start()
            prober.start()
            flood_started = time.monotonic()
            for i, due in enumerate(due_times(plan.videos, duration)):
                time.sleep(max(0.0, flood_started + due - time.monotonic()))
                uploader.submit(keys[i], content[i].data)
            uploader.pool.shutdown(wait=True)
            last_upload_at = time.time()
            flood_s = time.monotonic() - flood_started
            print(f"uploads done after {flood_s:.0f}s; draining", flush=True)

            uploaded_ids = [video_id(host.bucket, k) for k in uploader.uploaded if k.startswith(plan.key_prefix)]
            try:
                drained_at = wait_done(store, uploaded_ids, plan.drain_timeout_s, poll_s=2.0)
                drain_s: float | None = drained_at - flood_started
            except TimeoutError as exc:
                notes.append(f"drain: {exc}")
                drain_s = None
            words_s: float | None = None
            if settings.text.on and drain_s is not None:  # then every video's words, read by its text job
                try:
                    words_s = wait_words(store, uploaded_ids, plan.drain_timeout_s) - flood_started
                except TimeoutError as exc:
                    notes.append(f"words: {exc}")
            version_after = catalog_version(store)
            # Sampling goes on while the fleet shrinks back (or for a short while without autoscaling).
            settle(host, least, plan.cooldown_s if auto is not None else min(plan.cooldown_s, 5.0))
            for thread in threads:
                thread.stop.set()
                thread.join(JOIN_TIMEOUT_S)
            decided = decisions(settings.serve.app_name)
            from infra.harness.cluster import replica_nodes

            placed = replica_nodes(settings.serve.app_name, CONSUMER)
            ray_nodes = _alive_nodes()
            check = vidx_check(prefix="")
            final = statuses(store, ids)
        finally:
            uploader.pool.shutdown(wait=False, cancel_futures=True)
            for thread in threads:
                thread.stop.set()

    uploads = len(uploaded_ids)
    indexed = sum(1 for v in uploaded_ids if final.get(v) == "indexed")
    failed = sum(1 for v in uploaded_ids if final.get(v) == "failed")
    counts = check.report["counts"]
    latencies = list(prober.latency_s.values())
    target = getattr(auto, "consumer_target_per_replica", None)
    metrics: dict[str, Any] = {
        **({"words_drain_s": None if words_s is None else round(words_s, 1)} if settings.text.on else {}),
        "uploads": uploads,
        "indexed": indexed,
        "failed": failed,
        "lost": uploads - indexed - failed,
        "duplicates": int(counts.get("duplicate_frames", 0)) + int(counts.get("rows_mismatch", 0)),
        "inconsistencies": check.inconsistencies,
        "upload_errors": len(uploader.errors),
        "capacity_videos_per_s": round(capacity, 3),
        "capacity_with_scale_up_videos_per_s": round(capacity_cold, 3),
        "capacity_at_full_fleet": at_full_fleet,
        "offered_sustained_per_s": round(rate, 3),
        "offered_over_capacity": round(rate / capacity, 2),
        "flood_s": round(flood_s, 1),
        "drain_s": round(drain_s, 1) if drain_s is not None else None,
        "catalog_commits_per_video": round((version_after - version_before) / max(1, uploads), 3),
        "catalog_versions": version_after - version_before,
        **scaling_figures(
            sampler.samples,
            decided,
            target_per_replica=target,
            max_replicas={
                CONSUMER: getattr(auto, "consumer_max_replicas", None),
                ENCODER: getattr(auto, "encoder_max_replicas", None),
            },
            last_upload_at=last_upload_at,
        ),
        "ray_nodes": ray_nodes,
        "consumer_nodes": len(placed),
        "consumer_replicas_by_node": sorted(placed.values(), reverse=True),
        "latency_probes": n_probes,
        "latency_timed": len(latencies),
        "latency_p50_s": round(percentile(latencies, 50), 3) if latencies else None,
        "latency_p95_s": round(percentile(latencies, 95), 3) if latencies else None,
        "latency_p99_s": round(percentile(latencies, 99), 3) if latencies else None,
        "ack_p50_ms": round(percentile(acks, 50), 1) if acks else None,
        "ack_p99_ms": round(percentile(acks, 99), 1) if acks else None,
    }
    if auto is None:
        notes.append("the app has no autoscale settings: replicas are fixed, scaling figures are None")
    if len(latencies) < n_probes:
        notes.append(f"{n_probes - len(latencies)} probe videos were never returned by the image search")
    notes += [f"upload error: {e}" for e in uploader.errors[:10]]
    notes += [f"sampler error: {e}" for e in sampler.errors[:5]] + [f"prober error: {e}" for e in prober.errors[:5]]
    notes.append(
        f"ack: {len(acks)} POST /v1/index at {plan.ack_rate_per_s:g}/s for already indexed videos, before the flood"
    )
    plan_json = {k: v for k, v in asdict(plan).items() if k != "env"}
    used = {
        "plan": plan_json,
        "env": dict(plan.env),
        "profile": [list(p) for p in PROFILE],
        "clip": {"size": list(CLIP_SIZE), "fps": CLIP_FPS, "seconds": list(CLIP_SECONDS)},
        "autoscale": auto.model_dump(mode="json") if auto is not None else None,
        "serve": settings.serve.model_dump(
            mode="json", include={"consumer_replicas", "consumer_concurrency", "encoder_replicas"}
        ),
    }
    report = {k: v for k, v in check.report.items() if k != "found"} | {
        "found": check.found[:20],
        "exit_code": check.exit_code,
    }
    return FloodResult(metrics, used, sampler.samples, decided, report, notes)


def _alive_nodes() -> int:
    """Nodes of the Ray cluster this driver is connected to."""
    import ray
    from ray.util.state import list_nodes

    nodes = list_nodes(address=ray.get_runtime_context().gcs_address, raise_on_missing_output=False)
    return sum(1 for n in nodes if n.state == "ALIVE")


def wait_words(store: Any, ids: Sequence[str], timeout_s: float, poll_s: float = 2.0) -> float:
    """Wait until every one of ``ids`` that is indexed has its words in the live text table at its version
    (its text job settled; failed ones have none to read); the monotonic time it was seen so."""
    from pipeline.upkeep.text_backfill import has_words

    deadline = time.monotonic() + timeout_s
    pending = set(ids)
    while pending:
        text = store.models.read().text
        if text is not None:
            records = store.catalog.get_many(pending)
            pending -= {
                v
                for v, r in records.items()
                if r.status is VideoStatus.FAILED or (r.status is VideoStatus.INDEXED and has_words(r, text))
            }
        if not pending:
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(pending)}/{len(ids)} videos without their words after {timeout_s:.0f}s")
        time.sleep(poll_s)
    return time.monotonic()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.flood", description=__doc__)
    parser.add_argument("--videos", type=int, default=FloodPlan.videos)
    parser.add_argument("--duration-s", type=float, default=FloodPlan.duration_s, help="longest flood")
    parser.add_argument("--overload", type=float, default=FloodPlan.overload, help="offered rate ≥ this × capacity")
    parser.add_argument("--capacity-videos", type=int, default=FloodPlan.capacity_videos)
    parser.add_argument("--seed-like", action="store_true", help="poll 2 s, upscale delay 15 s, downscale delay 60 s")
    parser.add_argument(
        "--text",
        action="store_true",
        help="a text source on (subtitles): every video's text job runs on the TextConsumer",
    )
    parser.add_argument(
        "--out", type=Path, help="default bench/results/flood.json (flood-seedlike.json with --seed-like)"
    )
    parser.add_argument("--plots", default=str(ROOT / "docs" / "img"), help="directory for the PNGs ('' for none)")
    parser.add_argument(
        "--nodes",
        type=int,
        default=1,
        help="Ray nodes started on this machine (ray start --head, then ray start --address; 2 CPUs each)",
    )
    args = parser.parse_args()

    from infra.dev.tinymodel import build_tiny_siglip
    from infra.harness.services import start_services

    suffix = (
        ("-seedlike" if args.seed_like else "")
        + (f"-{args.nodes}nodes" if args.nodes > 1 else "")
        + ("-text" if args.text else "")
    )
    out = args.out or ROOT / "bench" / "results" / f"flood{suffix}.json"
    env = {
        "VIDX_AUTOSCALE__ENABLED": "true",
        **(SEED_LIKE_ENV if args.seed_like else {}),
        **({"VIDX_TEXT__SUBTITLES": "true"} if args.text else {}),
    }
    plan = FloodPlan(
        videos=args.videos,
        duration_s=args.duration_s,
        overload=args.overload,
        capacity_videos=args.capacity_videos,
        env=env,
    )
    with tempfile.TemporaryDirectory(prefix="vidx-flood-") as tmp_name, contextlib.ExitStack() as stack:
        tmp = Path(tmp_name)
        model_dir = build_tiny_siglip(tmp / "tiny", seed=0)
        if args.nodes > 1:
            from infra.harness.cluster import local_cluster

            plan = dataclasses.replace(plan, ray_address=stack.enter_context(local_cluster(args.nodes, NODE_CPUS)))
        with start_services() as services:
            result = run_flood(services, model_dir, tmp, plan)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result.as_json(), indent=2) + "\n")
    if args.plots:
        for path in plot(result.samples, Path(args.plots), suffix):
            print(f"plot: {path}")
    for k, v in result.metrics.items():
        print(f"{k}: {v}")
    for note in result.notes:
        print(f"note: {note}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
