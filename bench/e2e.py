"""End to end: the real Ray Serve app over MinIO and RabbitMQ containers, tiny SigLIP checkpoint.

- throughput: N generated 360p videos uploaded at once with a plain S3 client; videos/min and
  indexed video-seconds per wall second until all are indexed;
- each stage alone on the same videos, one after another in this process (fetch from MinIO, decode,
  embed with the same checkpoint, write to LanceDB on MinIO); the pipeline's rate divided by the
  slowest stage's rate is ``e2e_vs_slowest_stage_ratio``;
- freshness: single 10 s 360p clips uploaded one at a time, upload done -> status ``indexed`` (rows
  committed, so searchable), p50/p99;
- per-stage breakdown of the pipeline from the consumer's job log lines, and the overhead per video
  (freshness minus the job's own work: event and queue hops, router, catalog status writes).

``python -m bench.e2e [--full]``; needs the container engine (``make bench`` sets it up).
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import percentile, save_section, stopwatch
from storage.ids import video_id

DEFAULT_VIDEOS, FULL_VIDEOS = 50, 200
VIDEO_S = 10.0
SIZE = (640, 360)
FPS = 30
GOP = 60  # 2 s at 30 fps: a realistic keyframe interval
FRESHNESS_CLIPS, FULL_FRESHNESS_CLIPS = 12, 40
INDEX_TIMEOUT_S = 900.0
JOB_LINE = re.compile(
    r"job index (?P<uri>\S+) -> indexed \((?P<frames>\d+) frames\) in (?P<total>[\d.]+)s: (?P<stages>.*)$"
)
STAGE = re.compile(r"(\w+)=([\d.]+)s")


def _videos(directory: Path, n: int, first_seed: int) -> list[Path]:
    from infra.dev.samples import write_video

    return [
        write_video(directory / f"v{i:03d}.mp4", seconds=VIDEO_S, fps=FPS, size=SIZE, gop=GOP, seed=first_seed + i)
        for i in range(n)
    ]


def _wait_indexed(host: Any, ids: list[str], timeout_s: float) -> dict[str, float]:
    """Seconds (monotonic) at which each id was first seen indexed."""
    seen: dict[str, float] = {}
    deadline = time.monotonic() + timeout_s
    while len(seen) < len(ids):
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {len(seen)}/{len(ids)} videos indexed after {timeout_s:.0f}s")
        for vid in ids:
            if vid in seen:
                continue
            resp = host.http.get(f"/v1/videos/{vid}")
            if resp.status_code == 200 and resp.json()["status"] == "indexed":
                seen[vid] = time.monotonic()
            elif resp.status_code == 200 and resp.json()["status"] == "failed":
                raise RuntimeError(f"{vid} failed: {resp.json()['error']}")
        time.sleep(0.05)
    return seen


def _job_lines(prefix: str) -> list[dict[str, Any]]:
    """The consumer's per-job log lines of this run (Ray keeps replica logs in the session dir)."""
    import ray

    node: Any = ray._private.worker._global_node  # where this Ray instance keeps its logs
    logs = Path(node.get_session_dir_path()) / "logs"
    jobs = []
    for path in logs.rglob("*.log"):
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        for line in text.splitlines():
            match = JOB_LINE.search(line)
            if match and f"s3://{prefix}-videos/" in match["uri"]:
                stages = {k: float(v) for k, v in STAGE.findall(match["stages"])}
                jobs.append({"uri": match["uri"], "total": float(match["total"]), "stages": stages})
    return jobs


def _stages_alone(settings: Any, model_dir: Path, paths: list[Path], bucket: str, keys: list[str]) -> dict[str, float]:
    """Seconds for all ``paths`` per stage, each stage run alone over all of them."""
    from pipeline.decode import sample_frames
    from pipeline.embed import SiglipEncoder
    from pipeline.indexer import thumbnail_jpeg
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
                        settings.sampling.every_s,
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
    with stopwatch() as elapsed:
        for i, video_rows in enumerate(rows):
            vid = f"bench-alone-{i}"
            store.frames.replace(VideoFrames(vid, f"s3://x/{vid}", "1", "fp", "tiny", video_rows))
    seconds["write"] = elapsed()
    return seconds


def _profile(pid: int, seconds: int, out: Path) -> subprocess.Popen[bytes]:
    """Start py-spy on a replica for ``seconds`` (a flame graph SVG at ``out``)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    spy = Path(sys.executable).parent / "py-spy"
    cmd = [str(spy), "record", "--pid", str(pid), "--duration", str(seconds), "--rate", "50", "--output", str(out)]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.e2e", description=__doc__)
    parser.add_argument("--full", action="store_true")
    parser.add_argument("--videos", type=int, help=f"videos in the throughput run (default {DEFAULT_VIDEOS})")
    parser.add_argument("--clips", type=int, help=f"clips in the freshness run (default {FRESHNESS_CLIPS})")
    parser.add_argument("--profile", type=Path, default=Path("docs/profiles/e2e-consumer.svg"))
    args = parser.parse_args()
    n_videos = args.videos or (FULL_VIDEOS if args.full else DEFAULT_VIDEOS)
    n_clips = args.clips or (FULL_FRESHNESS_CLIPS if args.full else FRESHNESS_CLIPS)

    from infra.dev.tinymodel import build_tiny_siglip
    from tests.faults.harness import start_app
    from tests.services import start_services, unique_prefix

    notes: list[str] = []
    metrics: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="vidx-bench-") as tmp_name:
        tmp = Path(tmp_name)
        print(f"generating {n_videos} + {n_clips} videos ({VIDEO_S:g}s {SIZE[0]}x{SIZE[1]} {FPS} fps)", flush=True)
        (tmp / "batch").mkdir()
        (tmp / "clips").mkdir()
        paths = _videos(tmp / "batch", n_videos, 1000)
        clips = _videos(tmp / "clips", n_clips, 5000)
        model_dir = build_tiny_siglip(tmp / "tiny", seed=0)
        with start_services() as services:
            prefix = unique_prefix()
            with start_app(services, prefix, model_dir, tmp / "state") as host:
                client = services.minio_client()
                bucket = host.bucket
                # Warm-up: one video through every hop, so imports and first commits don't count.
                client.fput_object(bucket, "warmup/w.mp4", str(clips[0]), content_type="video/mp4")
                _wait_indexed(host, [video_id(bucket, "warmup/w.mp4")], 300)

                # Freshness: one clip at a time.
                fresh: list[float] = []
                for i, clip in enumerate(clips):
                    key = f"fresh/c{i:03d}.mp4"
                    client.fput_object(bucket, key, str(clip), content_type="video/mp4")
                    done_upload = time.monotonic()
                    seen = _wait_indexed(host, [video_id(bucket, key)], 120)
                    fresh.append(seen[video_id(bucket, key)] - done_upload)
                print(f"freshness p50 {statistics.median(fresh):.2f}s over {len(fresh)} clips", flush=True)

                # Throughput: everything at once.
                pids = host.replica_pids("IndexConsumer")
                spy = None
                if pids:
                    spy = _profile(pids[0], 120 if args.full else 45, args.profile)
                keys = [f"batch/v{i:03d}.mp4" for i in range(n_videos)]
                with stopwatch() as elapsed:
                    for key, path in zip(keys, paths, strict=True):
                        client.fput_object(bucket, key, str(path), content_type="video/mp4")
                    _wait_indexed(host, [video_id(bucket, k) for k in keys], INDEX_TIMEOUT_S)
                wall = elapsed()
                if spy is not None:
                    try:
                        spy.wait(timeout=180)
                    except subprocess.TimeoutExpired:
                        spy.kill()
                jobs = _job_lines(prefix)
                alone = _stages_alone(host.settings, model_dir, paths, bucket, keys)

    batch_jobs = [j for j in jobs if "/batch/" in j["uri"]]
    fresh_jobs = [j for j in jobs if "/fresh/" in j["uri"]]
    per_video = {k: v / n_videos for k, v in alone.items()}
    slowest_stage, slowest_s = max(per_video.items(), key=lambda kv: kv[1])
    pipeline_rate = n_videos / wall
    metrics.update(
        {
            "videos": n_videos,
            "video_s_each": VIDEO_S,
            "resolution": f"{SIZE[0]}x{SIZE[1]}",
            "wall_s": round(wall, 2),
            "videos_per_min": round(60 * pipeline_rate, 1),
            "indexed_video_s_per_wall_s": round(n_videos * VIDEO_S / wall, 2),
            "stage_alone_s_per_video": {k: round(v, 4) for k, v in per_video.items()},
            "slowest_stage": slowest_stage,
            "e2e_vs_slowest_stage_ratio": round(pipeline_rate / (1 / slowest_s), 3),
            "freshness_p50_s": round(statistics.median(fresh), 3),
            "freshness_p99_s": round(percentile(fresh, 99), 3),
            "freshness_clips": len(fresh),
        }
    )
    if batch_jobs:
        stage_names = sorted({s for j in batch_jobs for s in j["stages"]})
        metrics["pipeline_stage_s_per_video"] = {
            s: round(sum(j["stages"].get(s, 0.0) for j in batch_jobs) / len(batch_jobs), 4) for s in stage_names
        }
    if fresh_jobs:
        work = [sum(v for k, v in j["stages"].items() if k != "catalog") for j in fresh_jobs]
        catalog = [j["stages"].get("catalog", 0.0) for j in fresh_jobs]
        hops = max(0.0, statistics.median(fresh) - statistics.median([j["total"] for j in fresh_jobs]))
        metrics["job_s_p50_fresh"] = round(statistics.median([j["total"] for j in fresh_jobs]), 3)
        metrics["queue_hops_ms_p50"] = round(1000 * hops, 1)
        metrics["catalog_writes_ms_p50"] = round(1000 * statistics.median(catalog), 1)
        metrics["overhead_ms_per_video"] = round(1000 * (hops + statistics.median(catalog)), 1)
        metrics["work_s_p50_fresh"] = round(statistics.median(work), 3)
    else:
        notes.append("no consumer job lines found in the Ray logs: per-stage breakdown not measured")
        metrics["overhead_ms_per_video"] = "not measured"
    notes.append(
        "stages alone run one video after another in one process; the pipeline runs the app's consumer "
        "concurrency and overlaps stages across videos, so the ratio can exceed 1"
    )
    notes.append(f"profile of the consumer during the batch: {args.profile}")
    save_section("e2e", metrics, notes)
    for k, v in metrics.items():
        print(f"{k}: {v}")


if __name__ == "__main__":
    main()
