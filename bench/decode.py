"""Decode: sampled frames/s and x real time per core for 1 fps sampling of generated 1080p and 360p H.264.

Three ways to get one RGB frame a second, scaled to the encoder's input size, out of the same files:

- vidx: ``pipeline.decode.sample_frames`` (strategy ``auto``: only the GOPs and frames that hold a
  sample are decoded, unsampled non-reference frames skipped, swscale scaling, decoder threads);
- ffmpeg: ``ffmpeg -threads N -i x -vf fps=1,scale=W:H -f rawvideo -pix_fmt rgb24 -`` (what a user
  would otherwise feed a batch script with);
- PyAV full decode then pick: every frame decoded (decoder threads), the sampled ones converted.

The videos (camera-like texture panning under grain, x264 ``superfast``: CABAC, deblocking, three
B-frames; a keyframe every 2 s; 30 fps) are generated once and kept in the temp directory.

``python -m bench.decode [--full] [--profile]``; ``--profile`` runs only vidx's path on 1080p (for
``py-spy record -- python -m bench.decode --profile``) and writes no results.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from functools import partial
from pathlib import Path
from typing import Any

import av

from bench.common import have_command, save_section
from infra.dev.samples import write_textured_video
from pipeline.decode import DecodeStats, sample_frames, scaled_size
from pipeline.decode_settings import DecodeLimits, DecodeStrategy

EVERY_S = 1.0
FPS = 30
GOP_S = 2.0
MAX_SIDE = 384  # SamplingSettings.decode_max_side's default
#: (name, size, seconds, seconds with --full)
CASES = [("1080p", (1920, 1080), 20.0, 120.0), ("360p", (640, 360), 40.0, 300.0)]
CACHE = Path(tempfile.gettempdir()) / "vidx-bench-decode"


@dataclass(frozen=True, slots=True)
class Run:
    frames: int
    wall_s: float
    cpu_s: float

    def row(self, video_s: float) -> dict[str, float]:
        return {
            "sampled_fps": round(self.frames / self.wall_s, 1),
            "x_realtime": round(video_s / self.wall_s, 2),
            "cores_used": round(self.cpu_s / self.wall_s, 2),
            "x_realtime_per_core": round(video_s / self.cpu_s, 2),
            "wall_s": round(self.wall_s, 2),
            "cpu_s": round(self.cpu_s, 2),
            "frames": self.frames,
        }


def _cpu_s(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def measure(fn: Callable[[], int], who: int = resource.RUSAGE_SELF) -> Run:
    """Wall and CPU time (all threads, or the children's for a subprocess) of one call."""
    cpu0, wall0 = _cpu_s(who), time.perf_counter()
    frames = fn()
    return Run(frames, time.perf_counter() - wall0, _cpu_s(who) - cpu0)


def video(name: str, size: tuple[int, int], seconds: float) -> Path:
    path = CACHE / f"{name}-{seconds:g}s-gop{GOP_S:g}-{FPS}fps.mp4"
    if not path.exists():
        started = time.monotonic()
        tmp = path.with_suffix(".part.mp4")
        write_textured_video(tmp, seconds=seconds, fps=FPS, size=size, gop_s=GOP_S, seed=1)
        tmp.rename(path)
        print(f"  generated {path.name} in {time.monotonic() - started:.0f}s", flush=True)
    return path


def vidx(path: Path, strategy: DecodeStrategy = DecodeStrategy.AUTO, stats: DecodeStats | None = None) -> int:
    limits = DecodeLimits(max_frames=1_000_000)
    return sum(1 for _ in sample_frames(path, EVERY_S, limits, MAX_SIDE, strategy=strategy, stats=stats))


def ffmpeg(path: Path, out_size: tuple[int, int], threads: int) -> int:
    width, height = out_size
    cmd = ["ffmpeg", "-v", "error", "-threads", str(threads), "-i", str(path)]
    cmd += ["-vf", f"fps={1 / EVERY_S:g},scale={width}:{height}", "-f", "rawvideo", "-pix_fmt", "rgb24", "-"]
    out = subprocess.run(cmd, capture_output=True, check=True).stdout
    return len(out) // (width * height * 3)


def pyav_full(path: Path, out_size: tuple[int, int]) -> int:
    """What one writes with PyAV unaided: decode every frame, convert the first one at or after each target."""
    picked, next_target = 0, 0.0
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        time_base = stream.time_base or Fraction(1, 1)
        for frame in container.decode(stream):
            if frame.pts is None or float(frame.pts * time_base) + 1e-3 < next_target:
                continue
            frame.to_ndarray(format="rgb24", width=out_size[0], height=out_size[1])
            picked += 1
            while next_target <= float(frame.pts * time_base) + 1e-3:
                next_target += EVERY_S
    return picked


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.decode", description=__doc__)
    parser.add_argument("--full", action="store_true", help="longer inputs")
    parser.add_argument("--profile", action="store_true", help="only vidx's path on 1080p, no results")
    args = parser.parse_args()
    if args.profile:
        name, size, seconds, _ = CASES[0]
        for _ in range(3):
            vidx(video(name, size, seconds))
        return
    cores = os.cpu_count() or 1
    metrics: dict[str, Any] = {}
    notes = [
        f"1 frame per {EVERY_S:g} s, scaled to {MAX_SIDE} px on the long side, from generated H.264 at {FPS} fps "
        f"with a keyframe every {GOP_S:g} s (x264 superfast: CABAC, deblocking, 3 B-frames, b-pyramid; ~12 Mb/s "
        "at 1080p of panning grain): two samples a GOP.",
        "x real time per core = video seconds / CPU seconds (user + system, all threads; ffmpeg's from its "
        "process); cores_used = CPU seconds / wall seconds. The CPU-time figures hold up on a busy machine, "
        "the wall-clock ones (sampled_fps, x_realtime) don't.",
        "decode_vs_ffmpeg_ratio = ffmpeg's CPU seconds / vidx's CPU seconds for the same samples (1080p); "
        "the wall-clock ratio is wall_ratio_vs_ffmpeg.",
        f"ffmpeg and vidx both run decoder threads for {cores} cores (ffmpeg -threads {cores}; vidx thread_count "
        "0 = FFmpeg's choice); each figure is one run.",
        "keyframes (approximate strategy, one sample a GOP, here half the samples) is shown for what a "
        "keyframe-only decode would cost; it is not the product's default.",
    ]
    for name, size, seconds, full_seconds in CASES:
        video_s = full_seconds if args.full else seconds
        path = video(name, size, video_s)
        out_size = scaled_size(*size, MAX_SIDE)
        stats = DecodeStats()
        runs = {
            "vidx": measure(partial(vidx, path, stats=stats)),
            "ffmpeg": measure(partial(ffmpeg, path, out_size, cores), resource.RUSAGE_CHILDREN),
            "pyav_full": measure(partial(pyav_full, path, out_size)),
            "vidx_keyframes": measure(partial(vidx, path, DecodeStrategy.KEYFRAMES)),
        }
        section: dict[str, Any] = {key: run.row(video_s) for key, run in runs.items()}
        section["video_s"] = video_s
        section["frames_decoded_fraction"] = round(stats.frames_decoded / max(1, round(video_s * FPS)), 3)
        section["cpu_ratio_vs_ffmpeg"] = round(runs["ffmpeg"].cpu_s / runs["vidx"].cpu_s, 2)
        section["wall_ratio_vs_ffmpeg"] = round(runs["ffmpeg"].wall_s / runs["vidx"].wall_s, 2)
        section["cpu_ratio_vs_pyav_full"] = round(runs["pyav_full"].cpu_s / runs["vidx"].cpu_s, 2)
        metrics[name] = section
        print(f"  {name} ({video_s:g} s): decoded {section['frames_decoded_fraction']:.0%} of the frames", flush=True)
        for key, run in runs.items():
            row = run.row(video_s)
            print(
                f"  {name} {key:15s} {row['frames']:4d} frames  {row['sampled_fps']:7.1f} frames/s  "
                f"x{row['x_realtime']:6.2f} real time  x{row['x_realtime_per_core']:6.2f} per core "
                f"({row['cores_used']:.2f} cores)",
                flush=True,
            )
        print(
            f"  {name} vidx vs ffmpeg: x{section['cpu_ratio_vs_ffmpeg']} CPU, x{section['wall_ratio_vs_ffmpeg']} wall; "
            f"vs PyAV full decode: x{section['cpu_ratio_vs_pyav_full']} CPU",
            flush=True,
        )
    metrics["decode_vs_ffmpeg_ratio"] = metrics["1080p"]["cpu_ratio_vs_ffmpeg"]
    metrics["decode_x_realtime_per_core"] = metrics["1080p"]["vidx"]["x_realtime_per_core"]
    save_section("decode", metrics, notes)


if __name__ == "__main__":
    if not have_command("ffmpeg"):
        raise SystemExit("bench.decode needs ffmpeg on the PATH")
    main()
