"""Decode: sampled frames/s and x real time per core for 1 fps sampling of generated 1080p and 360p H.264.

Three ways to get one RGB frame a second, scaled to the encoder's input size, out of the same files:

- vidx: ``pipeline.media.decode.open_sampled`` (what the indexer calls: one open for the stream facts and
  the frames; strategy ``auto``: only the GOPs and frames that hold a sample are decoded, unsampled
  non-reference frames skipped, swscale scaling; one decoder thread), in its worker process (CPU
  time: this process's and the worker's for the decode);
- ffmpeg: ``ffmpeg -threads N -i x -vf fps=1,scale=W:H -f rawvideo -pix_fmt rgb24 -`` (what a user
  would otherwise feed a batch script with);
- PyAV full decode then pick: every frame decoded (decoder threads), the sampled ones converted.

The videos (camera-like texture panning under grain, x264 ``superfast``: CABAC, deblocking, three
B-frames; a keyframe every 2 s; 30 fps) are generated once and kept in the temp directory.

Exact sampling must decode each GOP from its keyframe to its last sample, so vidx's ratio to ffmpeg
(which decodes every frame) is bounded by 1 / the fraction of frames it decodes if every frame cost
the same; ``keyframe_cpu_share`` (of a one-thread full decode, timed per packet) says how far the
keyframes, which vidx always decodes, make that bound unreachable.

The cost of decoding in a worker process (the watchdog that abandons a decode at ``max_decode_s``)
is measured on the same inputs: each video decoded in a warm worker and in-process, alternately,
best of ``ISOLATION_ROUNDS``; plus a short clip (where a fixed cost weighs most) and the start of a
fresh worker, which a video pays only after a worker was killed.

``python -m bench.stages.decode [--full] [--seconds S] [--profile] [--isolation]``; ``--profile`` runs only
vidx's path on 1080p, in-process (for ``py-spy record -- python -m bench.stages.decode --profile``);
``--isolation`` only the worker's cost; ``--seconds`` is a check run on shorter videos (1080p of
``S`` seconds, 360p twice that) without the isolation part. None of them writes results.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from fractions import Fraction
from functools import partial
from pathlib import Path
from typing import Any

import av

from bench.common import have_command, save_section
from infra.dev.samples import write_textured_video
from pipeline.media.decode import WORKER_ENTRY, DecodeStats, open_sampled, probe, scaled_size
from pipeline.media.settings import DecodeLimits, DecodeStrategy
from pipeline.media.workers import Worker
from storage.sampling import Sampling

EVERY_S = 1.0
FPS = 30
GOP_S = 2.0
MAX_SIDE = 384  # SamplingSettings.decode_max_side's default
#: (name, size, seconds, seconds with --full)
CASES = [("1080p", (1920, 1080), 20.0, 120.0), ("360p", (640, 360), 40.0, 300.0)]
CACHE = Path(tempfile.gettempdir()) / "vidx-bench-decode"
#: Runs of each isolation measurement (in-process and in a worker, alternately); the best one counts.
ISOLATION_ROUNDS = 5
#: The short clip of the isolation measurement: (size, seconds).
SHORT_CLIP = ((640, 360), 2.0)


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


def vidx(
    path: Path,
    strategy: DecodeStrategy = DecodeStrategy.AUTO,
    stats: DecodeStats | None = None,
    *,
    isolated: bool = True,
) -> int:
    limits = DecodeLimits(max_frames=1_000_000)
    video = open_sampled(path, Sampling(EVERY_S), limits, MAX_SIDE, strategy=strategy, stats=stats, isolated=isolated)
    return sum(1 for _ in video.frames)


def measure_vidx(path: Path, strategy: DecodeStrategy = DecodeStrategy.AUTO, *, isolated: bool = True) -> Run:
    """``measure`` of one vidx decode; a worker's CPU time is added to this process's."""
    stats = DecodeStats()
    run = measure(partial(vidx, path, strategy, stats, isolated=isolated))
    return replace(run, cpu_s=run.cpu_s + stats.worker_cpu_s)


def isolation_cost(paths: dict[str, Path]) -> dict[str, Any]:
    """Wall and CPU seconds per video decoded in a warm worker and in this process, on the same files
    (best of ``ISOLATION_ROUNDS`` each, alternating), and the start of a fresh worker."""
    starts = []
    for _ in range(ISOLATION_ROUNDS):
        started = time.perf_counter()
        # An interpreter importing PyAV and numpy, until it says it is ready.
        Worker(WORKER_ENTRY, start_timeout_s=120).close()
        starts.append(time.perf_counter() - started)
    found: dict[str, Any] = {"worker_start_s": round(min(starts), 3)}
    # The pool's worker warm before anything is timed.
    probe(paths["short"], DecodeLimits())
    for name, path in paths.items():
        runs: dict[str, list[Run]] = {"worker": [], "in_process": []}
        for _ in range(ISOLATION_ROUNDS):
            runs["worker"].append(measure_vidx(path))
            runs["in_process"].append(measure_vidx(path, isolated=False))
        worker = min(runs["worker"], key=lambda r: r.wall_s)
        here = min(runs["in_process"], key=lambda r: r.wall_s)
        found[name] = {
            "worker_wall_s": round(worker.wall_s, 4),
            "in_process_wall_s": round(here.wall_s, 4),
            "overhead_wall_s": round(worker.wall_s - here.wall_s, 4),
            "overhead_wall_pct": round(100 * (worker.wall_s / here.wall_s - 1), 1),
            "worker_cpu_s": round(worker.cpu_s, 4),
            "in_process_cpu_s": round(here.cpu_s, 4),
            "overhead_cpu_pct": round(100 * (worker.cpu_s / here.cpu_s - 1), 1),
            "frames": worker.frames,
        }
    return found


def print_isolation(found: dict[str, Any]) -> None:
    print(f"  a fresh decode worker starts in {found['worker_start_s']:.2f} s (paid again after a kill)", flush=True)
    for name, row in found.items():
        if isinstance(row, dict):
            print(
                f"  {name:6s} worker {row['worker_wall_s']:7.3f} s  in-process {row['in_process_wall_s']:7.3f} s  "
                f"overhead {row['overhead_wall_s'] * 1000:+7.1f} ms ({row['overhead_wall_pct']:+.1f}% wall, "
                f"{row['overhead_cpu_pct']:+.1f}% CPU), {row['frames']} frames",
                flush=True,
            )


def short_clip() -> Path:
    size, seconds = SHORT_CLIP
    return video(f"{size[1]}p-short", size, seconds)


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


def keyframe_cpu_share(path: Path) -> tuple[float, int, int]:
    """The share of a one-thread full decode's CPU time spent on keyframes (each packet timed), the
    keyframes and the frames."""
    keyframes_s = total_s = 0.0
    keyframes = frames = 0
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        stream.codec_context.thread_count = 1
        for packet in container.demux(stream):
            started = time.thread_time()
            stream.codec_context.decode(packet)
            spent = time.thread_time() - started
            total_s += spent
            frames += packet.size > 0
            if packet.is_keyframe:
                keyframes_s += spent
                keyframes += 1
    return keyframes_s / total_s, keyframes, frames


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.stages.decode", description=__doc__)
    parser.add_argument("--full", action="store_true", help="longer inputs")
    parser.add_argument("--profile", action="store_true", help="only vidx's path on 1080p, in-process, no results")
    parser.add_argument("--isolation", action="store_true", help="only the cost of the decode worker, no results")
    parser.add_argument("--seconds", type=float, help="check run: 1080p of this length, 360p twice it, no results")
    args = parser.parse_args()
    if args.profile:
        name, size, seconds, _ = CASES[0]
        for _ in range(3):
            vidx(video(name, size, seconds), isolated=False)
        return
    if args.isolation:
        print_isolation(isolation_cost({"short": short_clip(), **{c[0]: video(*c[:3]) for c in CASES}}))
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
        f"ffmpeg runs decoder threads for {cores} cores (-threads {cores}); vidx its default, one decoder thread "
        "for the sampled decode (frame threads cost CPU time and barely shorten a decode that is mostly "
        "keyframes); each figure is one run.",
        "frames_decoded_bound = 1 / frames_decoded_fraction: the CPU ratio to a full decode that exact sampling "
        "would allow if every frame cost the same; ratio_of_bound = cpu_ratio_vs_ffmpeg / that bound. "
        "keyframe_cpu_share: the share of a one-thread full decode's CPU time that goes to keyframes, all of "
        "which vidx decodes; cost_weighted_bound = 1 / (that share + the rest's share x the fraction of the "
        "other frames vidx decodes), the bound against a full decode by the same decoder if non-key frames "
        "cost alike (an estimate).",
        "keyframes (approximate strategy, one sample a GOP, here half the samples) is shown for what a "
        "keyframe-only decode would cost; it is not the product's default.",
        f"isolation: the same videos (and a {SHORT_CLIP[1]:g} s {SHORT_CLIP[0][1]}p clip) decoded in a warm worker "
        f"process and in-process, best of {ISOLATION_ROUNDS} each; worker_start_s is what a fresh worker costs "
        "(after one was killed for overrunning max_decode_s).",
    ]
    paths: dict[str, Path] = {"short": short_clip()}
    for case, (name, size, seconds, full_seconds) in enumerate(CASES):
        video_s = full_seconds if args.full else seconds
        if args.seconds:
            video_s = args.seconds * (1 + case)
        path = video(name, size, video_s)
        out_size = scaled_size(*size, MAX_SIDE)
        paths[name] = path
        stats = DecodeStats()
        vidx_run = measure(partial(vidx, path, stats=stats))
        runs = {
            "vidx": replace(vidx_run, cpu_s=vidx_run.cpu_s + stats.worker_cpu_s),
            "ffmpeg": measure(partial(ffmpeg, path, out_size, cores), resource.RUSAGE_CHILDREN),
            "pyav_full": measure(partial(pyav_full, path, out_size)),
            "vidx_keyframes": measure_vidx(path, DecodeStrategy.KEYFRAMES),
        }
        section: dict[str, Any] = {key: run.row(video_s) for key, run in runs.items()}
        section["video_s"] = video_s
        fraction = stats.frames_decoded / max(1, round(video_s * FPS))
        section["frames_decoded_fraction"] = round(fraction, 3)
        section["frames_decoded_bound"] = round(1 / fraction, 2)
        key_share, keyframes, frames = keyframe_cpu_share(path)
        section["keyframe_cpu_share"] = round(key_share, 3)
        # An estimate: vidx decodes every keyframe (one a planned GOP), the rest cost alike.
        other_decoded = (stats.frames_decoded - stats.gops_planned) / max(1, frames - keyframes)
        section["cost_weighted_bound"] = round(1 / (key_share + (1 - key_share) * other_decoded), 2)
        section["cpu_ratio_vs_ffmpeg"] = round(runs["ffmpeg"].cpu_s / runs["vidx"].cpu_s, 2)
        section["ratio_of_bound"] = round(section["cpu_ratio_vs_ffmpeg"] / section["frames_decoded_bound"], 3)
        section["wall_ratio_vs_ffmpeg"] = round(runs["ffmpeg"].wall_s / runs["vidx"].wall_s, 2)
        section["cpu_ratio_vs_pyav_full"] = round(runs["pyav_full"].cpu_s / runs["vidx"].cpu_s, 2)
        metrics[name] = section
        print(
            f"  {name} ({video_s:g} s): decoded {section['frames_decoded_fraction']:.1%} of the frames "
            f"(bound x{section['frames_decoded_bound']}); keyframes are {section['keyframe_cpu_share']:.0%} "
            f"of a full decode's CPU (cost-weighted bound x{section['cost_weighted_bound']})",
            flush=True,
        )
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
            f"vs PyAV full decode: x{section['cpu_ratio_vs_pyav_full']} CPU; "
            f"{section['ratio_of_bound']:.0%} of the bound",
            flush=True,
        )
    metrics["decode_vs_ffmpeg_ratio"] = metrics["1080p"]["cpu_ratio_vs_ffmpeg"]
    metrics["decode_x_realtime_per_core"] = metrics["1080p"]["vidx"]["x_realtime_per_core"]
    metrics["decode_bound_ratio"] = metrics["1080p"]["frames_decoded_bound"]
    metrics["decode_ratio_of_bound"] = metrics["1080p"]["ratio_of_bound"]
    print(
        f"  decode_vs_ffmpeg_ratio {metrics['decode_vs_ffmpeg_ratio']} (bound {metrics['decode_bound_ratio']}, "
        f"{metrics['decode_ratio_of_bound']:.0%} of it), decode_x_realtime_per_core "
        f"{metrics['decode_x_realtime_per_core']}",
        flush=True,
    )
    if args.seconds:
        return
    metrics["isolation"] = isolation_cost(paths)
    print_isolation(metrics["isolation"])
    save_section("decode", metrics, notes)


if __name__ == "__main__":
    if not have_command("ffmpeg"):
        raise SystemExit("bench.stages.decode needs ffmpeg on the PATH")
    main()
