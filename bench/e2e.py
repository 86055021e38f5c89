"""End to end: the real Ray Serve app over MinIO and RabbitMQ containers, tiny SigLIP checkpoint.

- throughput: N generated 10 s 640x360 videos uploaded at once with a plain S3 client; videos/s
  (``capacity_videos_per_s``) until all are indexed;
- each stage alone on the same videos, one after another in this process (fetch from MinIO, decode,
  embed with the same checkpoint, write: its frame write and the video's one catalog commit after it, as a
  job shorter than ``serve.claim_after_s`` does, on LanceDB on MinIO); the pipeline's rate divided by
  the slowest stage's rate is ``e2e_vs_slowest_stage_ratio``;
- freshness: single clips uploaded one at a time, upload done -> the search endpoint returns the clip
  (an image search with one of its frames), p50/p99;
- event delivery (upload done -> the event reaches a queue bound beside the router's) and the overhead
  per video: event receipt -> the job's end (its own log line, after its settle landed), minus the job's
  fetch, decode, embed and frame write (what is left: router, index-queue hop, catalog reads and writes,
  HEADs); how much later a status poll sees ``indexed`` is reported beside it.

``python -m bench.e2e [--full] [--trace-s3]`` (``--trace-s3``: S3 requests per video by API and table);
needs the container engine (``make bench`` sets it up).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench.common import per_video, percentile, save_section, stopwatch, work_counts
from bench.pyspy import PY_SPY_WRITE_S, finish_py_spy, start_py_spy
from infra.harness.joblogs import INDEX_LOGS, JobLogWatch, serve_log_dir
from infra.harness.s3relay import Counts, relay, trace_lines
from storage.ids import video_id

DEFAULT_VIDEOS, FULL_VIDEOS = 50, 200
VIDEO_S = 10.0
SIZE = (640, 360)
FPS = 30
GOP = 60  # 2 s at 30 fps: a realistic keyframe interval
FRESHNESS_CLIPS, FULL_FRESHNESS_CLIPS = 12, 40
INDEX_TIMEOUT_S = 900.0
#: Stages of a job's log line that are the video's own work; every other stage (catalog, head, ...)
#: counts as overhead.
WORK_STAGES = frozenset({"fetch", "probe", "decode", "embed", "thumbnails", "write"})
#: Poll period of the freshness run (status and search); it bounds the error of each figure.
POLL_S = 0.05
#: The profiled batch (after the timed one): videos, and how long py-spy records.
PROFILE_VIDEOS = 20
PROFILE_S = 30
#: Moments asked of each freshness search (the clip's own frame is the nearest by far).
SEARCH_K = 20
FRESH_TIMEOUT_S = 120.0
TAP_QUEUE = "bench-tap"


def generate_videos(directory: Path, n: int, first_seed: int) -> list[Path]:
    """``n`` clips of ``VIDEO_S`` s, ``SIZE`` at ``FPS``, written into ``directory`` (seeds from ``first_seed``)."""
    from infra.dev.samples import write_video

    return [
        write_video(directory / f"v{i:03d}.mp4", seconds=VIDEO_S, fps=FPS, size=SIZE, gop=GOP, seed=first_seed + i)
        for i in range(n)
    ]


def _query_png(path: Path, settings: Any) -> bytes:
    """The clip's middle sampled frame as PNG (lossless: the search embeds exactly the indexed pixels)."""
    from PIL import Image

    from pipeline.media.decode import sample_frames

    frames = list(sample_frames(path, settings.sampling.spec, settings.limits, settings.sampling.decode_max_side))
    out = io.BytesIO()
    Image.fromarray(frames[len(frames) // 2].rgb).save(out, format="PNG")
    return out.getvalue()


def _wait_fresh(host: Any, vid: str, png: bytes, timeout_s: float) -> tuple[float, float]:
    """(status indexed, returned by the search endpoint): monotonic seconds each was first seen, the
    two polled on their own threads so neither poll delays the other."""
    import httpx

    deadline = time.monotonic() + timeout_s

    def indexed() -> float:
        with httpx.Client(base_url=host.settings.api_url, timeout=30) as http:
            while time.monotonic() < deadline:
                resp = http.get(f"/v1/videos/{vid}")
                if resp.status_code == 200 and resp.json()["status"] == "indexed":
                    return time.monotonic()
                if resp.status_code == 200 and resp.json()["status"] == "failed":
                    raise RuntimeError(f"{vid} failed: {resp.json()['error']}")
                time.sleep(POLL_S)
        raise TimeoutError(f"{vid} not indexed after {timeout_s}s")

    def found() -> float:
        with httpx.Client(base_url=host.settings.api_url, timeout=30) as http:
            while time.monotonic() < deadline:
                files = {"image": ("q.png", png, "image/png")}
                resp = http.post("/v1/search/image", params={"k": SEARCH_K}, files=files)
                if resp.status_code == 200 and any(r["video_id"] == vid for r in resp.json()["results"]):
                    return time.monotonic()
                time.sleep(POLL_S)
        raise TimeoutError(f"{vid} not returned by the search endpoint after {timeout_s}s")

    with ThreadPoolExecutor(2) as pool:
        status, search = pool.submit(indexed), pool.submit(found)
        return status.result(), search.result()


def _tap(services: Any, prefix: str) -> Any:
    """A queue bound to MinIO's exchange beside the router's, consumed here: when each event arrived."""
    import pika

    from bench.stages.events import EventTap
    from events.config import AmqpSettings

    amqp = AmqpSettings()
    name = f"{prefix}.{TAP_QUEUE}"
    connection = pika.BlockingConnection(pika.URLParameters(services.amqp_url))
    channel = connection.channel()
    channel.queue_declare(queue=name, durable=True)
    channel.queue_bind(queue=name, exchange=amqp.exchange, routing_key=amqp.routing_key)
    connection.close()
    return EventTap(services.amqp_url, name).start()


def _job_lines(prefix: str) -> list[dict[str, Any]]:
    """The index replicas' per-job JSON lines of this run (``pipeline.index.joblog``, in Ray's Serve log
    folder): each indexed job's total, stages and when it ended (the line's ``timestamp_ns``, written right
    after the job's last step, on this process's monotonic clock: same host)."""
    import json

    wall_to_monotonic = time.monotonic() - time.time()
    jobs = []
    for path in serve_log_dir().glob(INDEX_LOGS):
        try:
            text = path.read_text(errors="replace")
        except OSError:  # a replica's file gone meanwhile
            continue
        for line in text.splitlines():
            if '"outcome": "indexed"' not in line or f"s3://{prefix}-videos/" not in line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            jobs.append(
                {
                    "uri": record["uri"],
                    "total": float(record["duration_s"]),
                    "stages": {k: float(v) for k, v in record["stages_s"].items()},
                    "ended": record["timestamp_ns"] / 1e9 + wall_to_monotonic,
                }
            )
    return jobs


def _stages_alone(settings: Any, model_dir: Path, paths: list[Path], bucket: str, keys: list[str]) -> dict[str, float]:
    """Seconds for all ``paths`` per stage, each stage run alone over all of them."""
    from pipeline.embedding.siglip import SiglipEncoder
    from pipeline.media.decode import sample_frames
    from pipeline.media.frames import thumbnail_jpeg
    from storage.catalog import VideoRecord, VideoStatus
    from storage.frames import FrameRow, VideoFrames
    from storage.ids import frame_id
    from storage.s3 import ObjectStore
    from storage.tables import IndexStore

    seconds: dict[str, float] = {}

    async def fetch_all(dest: Path) -> None:
        async with ObjectStore(settings.s3) as store:
            for i, key in enumerate(keys):
                head = await store.head(bucket, key)
                assert head is not None
                await store.download(head, dest / f"{i}.mp4", settings.limits.max_bytes)

    with tempfile.TemporaryDirectory() as tmp, stopwatch() as elapsed:
        asyncio.run(fetch_all(Path(tmp)))
    seconds["fetch"] = elapsed()
    decoded = []
    with stopwatch() as elapsed:
        for path in paths:
            decoded.append(
                list(
                    sample_frames(
                        path,
                        settings.sampling.spec,
                        settings.limits,
                        max_side=settings.sampling.decode_max_side,
                    )
                )
            )
    seconds["decode"] = elapsed()
    encoder = SiglipEncoder(settings.model.model_copy(update={"id": str(model_dir)}))
    vectors = []
    with stopwatch() as elapsed:
        for frames in decoded:
            vectors.append(encoder.embed_images([f.rgb for f in frames]))
    seconds["embed"] = elapsed()
    rows = []
    with stopwatch() as elapsed:
        for i, frames in enumerate(decoded):
            vid = f"bench-alone-{i}"
            rows.append(
                [
                    FrameRow(
                        frame_id(vid, f.index),
                        f.ts_s,
                        vectors[i][j],
                        thumbnail_jpeg(f.rgb, settings.sampling.thumbnail_max_side),
                    )
                    for j, f in enumerate(frames)
                ]
            )
    seconds["thumbnails"] = elapsed()
    store = IndexStore(settings.s3, uri=f"s3://{settings.s3.index_bucket}/bench-alone")
    frames_only = 0.0
    with stopwatch() as elapsed:
        for i, video_rows in enumerate(rows):
            # What a short job costs the catalog (the lazy claim: no claim): read, frames, read again,
            # finish (-> indexed), a compare-and-set commit of its own.
            vid, uri = f"bench-alone-{i}", f"s3://x/bench-alone-{i}"
            seen = store.catalog.get(vid)
            started = time.perf_counter()
            store.frames.replace(VideoFrames(vid, uri, "1", "fp", "tiny", video_rows))
            frames_only += time.perf_counter() - started
            now = store.catalog.get(vid)
            assert (now.rev if now else 0) == (seen.rev if seen else 0)
            base = now or VideoRecord(video_id=vid, uri=uri, status=VideoStatus.INDEXING, version="1", model="tiny")
            done = base.evolve(status=VideoStatus.INDEXED, fingerprint="fp", frames=len(video_rows), duration_s=VIDEO_S)
            assert store.catalog.write(done, base.rev) is not None
    seconds["write"] = elapsed()
    seconds["write_frames_only"] = frames_only
    return seconds


def _profiled_batch(host: Any, client: Any, bucket: str, paths: list[Path], out: Path) -> None:
    """The same videos again under new keys, with py-spy on a consumer replica (not timed)."""
    pids = host.replica_pids("IndexConsumer")
    if not pids:
        return
    spy = start_py_spy(pids[0], PROFILE_S, out)
    keys = [f"profiled/v{i:03d}.mp4" for i in range(len(paths))]
    watch = JobLogWatch(serve_log_dir()).skip_existing()
    for key, path in zip(keys, paths, strict=True):
        client.fput_object(bucket, key, str(path), content_type="video/mp4")
    watch.wait([video_id(bucket, k) for k in keys], INDEX_TIMEOUT_S)
    finish_py_spy(spy, PROFILE_S + PY_SPY_WRITE_S)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.e2e", description=__doc__)
    parser.add_argument("--full", action="store_true")
    parser.add_argument("--videos", type=int, help=f"videos in the throughput run (default {DEFAULT_VIDEOS})")
    parser.add_argument("--clips", type=int, help=f"clips in the freshness run (default {FRESHNESS_CLIPS})")
    parser.add_argument(
        "--profile",
        type=Path,
        default=Path("docs/profiles/e2e-consumer.svg"),
        help="py-spy output for a second, untimed batch (.txt: collapsed stacks)",
    )
    parser.add_argument("--no-profile", dest="profile", action="store_const", const=None)
    parser.add_argument(
        "--trace-s3",
        action="store_true",
        help="the app reaches MinIO through a counting relay: S3 requests per video by API and table "
        "(a diagnostic: the relay's hop is in every timed figure of that run)",
    )
    args = parser.parse_args()
    n_videos = args.videos or (FULL_VIDEOS if args.full else DEFAULT_VIDEOS)
    n_clips = args.clips or (FULL_FRESHNESS_CLIPS if args.full else FRESHNESS_CLIPS)

    from infra.dev.tinymodel import build_tiny_siglip
    from infra.harness.faults import start_app
    from infra.harness.services import start_services, unique_prefix

    notes: list[str] = []
    metrics: dict[str, Any] = {}
    fresh: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="vidx-bench-") as tmp_name:
        tmp = Path(tmp_name)
        print(f"generating {n_videos} + {n_clips} videos ({VIDEO_S:g}s {SIZE[0]}x{SIZE[1]} {FPS} fps)", flush=True)
        (tmp / "batch").mkdir()
        (tmp / "clips").mkdir()
        paths = generate_videos(tmp / "batch", n_videos, 1000)
        clips = generate_videos(tmp / "clips", n_clips + 1, 5000)
        model_dir = build_tiny_siglip(tmp / "tiny", seed=0)
        with start_services() as services, contextlib.ExitStack() as stack:
            prefix = unique_prefix()
            s3 = stack.enter_context(relay(services.s3_endpoint)) if args.trace_s3 else None
            # The fleet starts full (min = max consumer replicas): capacity is what the fleet does,
            # not how fast it scales (bench.flood measures that, and the capacity once it is full).
            from pipeline.settings import Settings

            fleet = Settings().autoscale.consumer_max_replicas
            notes.append(f"the consumer fleet is pinned at its maximum, {fleet} replicas, for the whole run")
            env = {"VIDX_AUTOSCALE__CONSUMER_MIN_REPLICAS": str(fleet)}
            if s3 is not None:
                env["VIDX_S3__ENDPOINT_URL"] = f"http://127.0.0.1:{s3.port}"
            traced: list[Counts] = []
            with start_app(services, prefix, model_dir, tmp / "state", env=env, metrics_push_ms=None) as host:
                client = services.minio_client()
                bucket = host.bucket
                tap = _tap(services, prefix)
                try:
                    # Warm-up: one video through every hop, so imports and first commits don't count.
                    client.fput_object(bucket, "warmup/w.mp4", str(clips[0]), content_type="video/mp4")
                    warm_png = _query_png(clips[0], host.settings)
                    _wait_fresh(host, video_id(bucket, "warmup/w.mp4"), warm_png, 300)

                    # Freshness: one clip at a time.
                    lone_before = work_counts(host)
                    traced += [s3.snapshot()] if s3 else []
                    for i, clip in enumerate(clips[1:]):
                        key = f"fresh/c{i:03d}.mp4"
                        png = _query_png(clip, host.settings)
                        client.fput_object(bucket, key, str(clip), content_type="video/mp4")
                        uploaded = time.monotonic()
                        indexed, found = _wait_fresh(host, video_id(bucket, key), png, FRESH_TIMEOUT_S)
                        received = tap.arrived.get(f"{bucket}/{key}")
                        fresh.append(
                            {"uri": f"s3://{bucket}/{key}", "uploaded": uploaded, "received": received}
                            | {"indexed": indexed, "found": found}
                        )
                    # The trace's windows leave out the benchmark's own table reads (work_counts).
                    traced += [s3.snapshot()] if s3 else []
                    lone = per_video(lone_before, work_counts(host, ending=True), len(fresh))
                    print(
                        f"freshness p50 {statistics.median(f['found'] - f['uploaded'] for f in fresh):.2f}s "
                        f"over {len(fresh)} clips",
                        flush=True,
                    )

                    # Throughput: everything at once (no profiler running: it would take a core's share).
                    keys = [f"batch/v{i:03d}.mp4" for i in range(n_videos)]
                    batch_before, watch = work_counts(host), JobLogWatch(serve_log_dir()).skip_existing()
                    traced += [s3.snapshot()] if s3 else []
                    with stopwatch() as elapsed:
                        for key, path in zip(keys, paths, strict=True):
                            client.fput_object(bucket, key, str(path), content_type="video/mp4")
                        watch.wait([video_id(bucket, k) for k in keys], INDEX_TIMEOUT_S)
                    wall = elapsed()
                    traced += [s3.snapshot()] if s3 else []
                    batch = per_video(batch_before, work_counts(host, ending=True), n_videos)
                    if args.profile is not None:
                        try:
                            _profiled_batch(host, client, bucket, paths[:PROFILE_VIDEOS], args.profile)
                        except (TimeoutError, RuntimeError, OSError) as exc:  # the timed figures stand without it
                            notes.append(f"the profiled batch failed: {type(exc).__name__}: {exc}")
                finally:
                    tap.stop()
                jobs = _job_lines(prefix)
                alone = _stages_alone(host.settings, model_dir, paths, bucket, keys)

    batch_jobs = [j for j in jobs if "/batch/" in j["uri"]]
    alone_each = {k: v / n_videos for k, v in alone.items() if k != "write_frames_only"}
    slowest_stage, slowest_s = max(alone_each.items(), key=lambda kv: kv[1])
    pipeline_rate = n_videos / wall
    freshness = [f["found"] - f["uploaded"] for f in fresh]
    metrics.update(
        {
            "videos": n_videos,
            "video_s_each": VIDEO_S,
            "resolution": f"{SIZE[0]}x{SIZE[1]}",
            "wall_s": round(wall, 2),
            "videos_per_min": round(60 * pipeline_rate, 1),
            "capacity_videos_per_s": round(pipeline_rate, 3),
            "indexed_video_s_per_wall_s": round(n_videos * VIDEO_S / wall, 2),
            "stage_alone_s_per_video": {k: round(v, 4) for k, v in alone_each.items()},
            "write_alone_frames_only_s_per_video": round(alone["write_frames_only"] / n_videos, 4),
            "slowest_stage": slowest_stage,
            "e2e_vs_slowest_stage_ratio": round(pipeline_rate / (1 / slowest_s), 3),
            "freshness_p50_s": round(statistics.median(freshness), 3),
            "freshness_p99_s": round(percentile(freshness, 99), 3),
            "indexed_status_p50_s": round(statistics.median(f["indexed"] - f["uploaded"] for f in fresh), 3),
            "freshness_clips": len(fresh),
            "catalog_commits_per_video_lone": lone["catalog_commits_per_video"],
            "catalog_commits_per_video_batch": batch["catalog_commits_per_video"],
            "catalog_upkeep_commits_per_video_lone": lone["catalog_upkeep_commits_per_video"],
            "catalog_upkeep_commits_per_video_batch": batch["catalog_upkeep_commits_per_video"],
            "s3_requests_per_video": batch["s3_requests_per_video"],
            "s3_requests_per_video_by_api": batch["s3_requests_per_video_by_api"],
            "s3_requests_per_video_lone": lone["s3_requests_per_video"],
        }
    )
    if batch_jobs:
        stage_names = sorted({s for j in batch_jobs for s in j["stages"]})
        metrics["pipeline_stage_s_per_video"] = {
            s: round(sum(j["stages"].get(s, 0.0) for j in batch_jobs) / len(batch_jobs), 4) for s in stage_names
        }
    metrics |= _overhead(fresh, {j["uri"]: j for j in jobs if "/fresh/" in j["uri"]}, notes)
    notes.append(
        "stages alone run one video after another in one process; the pipeline runs the app's consumer "
        "concurrency and overlaps stages across videos, so the ratio can exceed 1. The write stage alone "
        "is the video's frame write and its one catalog commit after it (a compare-and-set, as a job "
        "shorter than serve.claim_after_s makes it when nothing groups it); "
        "write_alone_frames_only_s_per_video is the frame write by itself."
    )
    notes.append(
        "the throughput batch's end is seen in the index replicas' own log lines (infra/harness/joblogs.py: "
        "no request to the app). s3_requests_per_video: MinIO's minio_api_requests_total (type s3) over that "
        "batch, its uploads included (one PutObject each); _lone: over the freshness run, where the "
        "benchmark's own status and search polls are S3 reads too. catalog_commits_per_video: versions the "
        "videos table gained, lone (one upload at a time) and in the batch; catalog_upkeep_commits_per_video: "
        "of those, the ones no job's write made (compaction, index upkeep: the version's Lance operation)."
    )
    notes.append(
        f"freshness: upload done -> an image search (k={SEARCH_K}, the clip's middle sampled frame as PNG) "
        f"returns the clip; indexed_status_p50_s: upload done -> GET /v1/videos/<id> says indexed. Each "
        f"polled on its own thread, {POLL_S * 1000:.0f} ms between polls (each figure is late by up to that "
        "plus one request)."
    )
    if args.profile is not None:
        notes.append(
            f"profile of one consumer replica during a second, untimed batch of {PROFILE_VIDEOS} videos "
            f"(py-spy, {PROFILE_S} s; it would take a core's share from the timed one): {args.profile}"
        )
    if len(traced) == 4:
        lone_lines = trace_lines(traced[0], traced[1], len(fresh))
        batch_lines = trace_lines(traced[2], traced[3], n_videos)
        notes.append(
            "--trace-s3: the app reached MinIO through a counting relay (infra/harness/s3relay.py), a hop in every "
            "timed figure of this run; requests per video by API and what they touch, lone uploads: "
            + "; ".join(" ".join(line.split()) for line in lone_lines[1:])
            + ". In the batch: "
            + "; ".join(" ".join(line.split()) for line in batch_lines[1:])
        )
    save_section("e2e", metrics, notes)
    for k, v in metrics.items():
        print(f"{k}: {v}")
    if len(traced) == 4:
        print(f"\nS3 requests per lone upload ({len(fresh)}), through the relay:")
        print("\n".join(lone_lines))
        print(f"\nS3 requests per video in the batch ({n_videos}), through the relay:")
        print("\n".join(batch_lines))


def _overhead(fresh: list[dict[str, Any]], jobs: dict[str, dict[str, Any]], notes: list[str]) -> dict[str, Any]:
    """Event delivery and the overhead per video of the freshness clips (see the module docstring)."""
    delivery = [f["received"] - f["uploaded"] for f in fresh if f["received"] is not None]
    out: dict[str, Any] = {
        "event_delivery_ms_p50": round(1000 * statistics.median(delivery), 1) if delivery else "not measured",
        "event_delivery_ms_p95": round(1000 * percentile(delivery, 95), 1) if delivery else "not measured",
    }
    overhead, hops, in_job, catalog, poll_lag = [], [], [], [], []
    for f in fresh:
        job = jobs.get(f["uri"])
        if job is None or f["received"] is None:
            continue
        work = sum(v for k, v in job["stages"].items() if k in WORK_STAGES)
        overhead.append(job["ended"] - f["received"] - work)
        hops.append(job["ended"] - f["received"] - job["total"])
        in_job.append(job["total"] - work)
        catalog.append(job["stages"].get("catalog", 0.0))
        poll_lag.append(f["indexed"] - job["ended"])
    if not overhead:
        notes.append("no consumer job lines (or no tapped events) for the freshness clips: overhead not measured")
        return out | {"overhead_ms_per_video": "not measured"}
    notes.append(
        "overhead_ms_per_video (p50 over the freshness clips) = event receipt -> the job's end (its log line's "
        "timestamp, written after the settle landed and the last HEAD), minus the job's "
        f"{', '.join(sorted(WORK_STAGES))} stages; = outside_job_ms (router, index queue, consumer pick-up) + "
        "in_job_overhead_ms (catalog reads/writes, HEADs, the wait for a decode slot). "
        "status_poll_lag_ms_p50: how much later the benchmark's status poll saw it (poll interval + one GET: "
        "not in the overhead; indexed_status_p50_s includes it). "
        "event_delivery_ms (upload done -> event on a queue bound beside the router's) is not in it."
    )
    fresh_jobs = [jobs[f["uri"]] for f in fresh if f["uri"] in jobs]
    stage_names = sorted({k for j in fresh_jobs for k in j["stages"]})
    return out | {
        "freshness_job_stage_ms_p50": {
            k: round(1000 * statistics.median(j["stages"].get(k, 0.0) for j in fresh_jobs), 1) for k in stage_names
        },
        "freshness_job_total_ms_p50": round(1000 * statistics.median(j["total"] for j in fresh_jobs), 1),
        "overhead_ms_per_video": round(1000 * statistics.median(overhead), 1),
        "overhead_outside_job_ms_p50": round(1000 * statistics.median(hops), 1),
        "overhead_in_job_ms_p50": round(1000 * statistics.median(in_job), 1),
        "job_catalog_ms_p50": round(1000 * statistics.median(catalog), 1),
        "status_poll_lag_ms_p50": round(1000 * statistics.median(poll_lag), 1),
    }


if __name__ == "__main__":
    main()
