"""``python -m bench.stages.write [--full]``: frames/s into LanceDB on MinIO, one commit per video vs grouped.

The same videos (768-d vectors and thumbnail-sized blobs per frame) are written by the same number
of concurrent callers, as a consumer's Celery threads write them: once with one ``merge_insert`` per
video (``FrameTable.replace``), once through ``GroupedFrameWriter`` (several videos per
commit, each call returning after its commit). Each mode writes into a fresh database on a MinIO
container started from the local images (``eval "$(infra/containers/engine.sh)"`` first).
"""

from __future__ import annotations

import argparse
import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np

from bench.common import save_section
from storage.commits.frames import GroupedFrameWriter
from storage.config import S3Settings
from storage.frames import FrameRow, VideoFrames
from storage.tables import IndexStore

DIM = 768
THUMBNAIL_BYTES = 6_000  # a 192 px JPEG at quality 75


def make_videos(n_videos: int, n_frames: int, seed: int = 0) -> list[VideoFrames]:
    rng = np.random.default_rng(seed)
    videos = []
    for v in range(n_videos):
        vectors = rng.normal(size=(n_frames, DIM)).astype(np.float32)
        vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
        video_id = f"v{v:08d}"
        rows = [
            FrameRow(f"{video_id}-{i:06d}", float(i), vectors[i], rng.bytes(THUMBNAIL_BYTES)) for i in range(n_frames)
        ]
        videos.append(VideoFrames(video_id, f"s3://videos/{video_id}.mp4", "etag-1", "fp-1", "siglip-b16", rows))
    return videos


Write = Callable[[VideoFrames], None]


def write_all(videos: list[VideoFrames], callers: int, write: Write) -> tuple[float, int]:
    """Each caller thread writes its share of ``videos`` one after another. Returns (seconds, failures)."""
    failures: list[BaseException] = []

    def run(share: list[VideoFrames]) -> None:
        for video in share:
            try:
                write(video)
            except Exception as exc:
                failures.append(exc)

    threads = [threading.Thread(target=run, args=(videos[i::callers],)) for i in range(callers)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - started, len(failures)


def measure(s3: S3Settings, videos: list[VideoFrames], callers: int, grouped: bool, **writer: Any) -> dict[str, float]:
    store = IndexStore(s3.model_copy(update={"index_prefix": f"bench-write-{uuid.uuid4().hex[:8]}"}))
    # The table exists before the clock starts (the first commit of a fresh database creates it).
    first = videos[0].rows[0]
    warm = FrameRow("warm-000000", 0.0, first.vector, first.thumbnail)
    store.frames.replace_many([VideoFrames("warm", "s3://videos/warm", "1", "fp", "m", [warm])])
    table = store.frames.table()
    assert table is not None
    before = int(table.version)
    if grouped:
        group = GroupedFrameWriter(store.frames, **writer)

        def write(v: VideoFrames) -> None:
            group.replace(v)

        seconds, failed = write_all(videos, callers, write)
        group.close()
    else:

        def write(v: VideoFrames) -> None:
            store.frames.replace(v)

        seconds, failed = write_all(videos, callers, write)
    frames = sum(len(v.rows) for v in videos)
    rows = store.frames.count() - 1
    if failed == 0 and rows != frames:
        raise RuntimeError(f"wrote {frames} frames but the table holds {rows}")
    return {
        "seconds": seconds,
        "frames_per_s": frames / seconds,
        "commits": int(table.version) - before,
        "failed": failed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.stages.write", description=__doc__)
    parser.add_argument("--full", action="store_true", help="more videos and frames")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    from infra.harness.services import start_services

    n_videos, n_frames = (256, 60) if args.full else (64, 30)
    callers = 4
    writer = {"max_videos": 16, "max_rows": 50_000, "wait_s": 0.05}
    videos = make_videos(n_videos, n_frames)
    started = time.monotonic()
    with start_services() as services:
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        services.minio_client().make_bucket(bucket)
        s3 = services.s3_settings(bucket)
        per_video = measure(s3, videos, callers, grouped=False)
        grouped = measure(s3, videos, callers, grouped=True, **writer)
    metrics: dict[str, Any] = {
        "write_per_video_frames_per_s": round(per_video["frames_per_s"], 1),
        "write_grouped_frames_per_s": round(grouped["frames_per_s"], 1),
        "write_grouped_vs_per_video_ratio": round(grouped["frames_per_s"] / per_video["frames_per_s"], 2),
        "write_per_video_commits": per_video["commits"],
        "write_grouped_commits": grouped["commits"],
        "write_per_video_failed_jobs": per_video["failed"],
        "write_grouped_failed_jobs": grouped["failed"],
        "wall_s": round(time.monotonic() - started, 1),
    }
    notes = [
        f"{n_videos} videos x {n_frames} frames ({DIM}-d float32 + {THUMBNAIL_BYTES} B thumbnail), {callers} "
        f"concurrent callers, LanceDB on a MinIO container; grouped: at most {writer['max_videos']} videos per "
        f"commit, {writer['wait_s']} s wait. Per video {per_video['seconds']:.1f}s, grouped {grouped['seconds']:.1f}s.",
        "Commits counted as table versions; concurrent per-video merge_inserts conflict and are retried by Lance.",
    ]
    save_section("write", metrics, notes)
    for key, value in metrics.items():
        print(f"{key}: {value}")


if __name__ == "__main__":
    main()
